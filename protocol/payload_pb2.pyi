from shoal.protocol import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Payload(_message.Message):
    __slots__ = ("tensors", "trained")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[_tensor_pb2.EncodedTensor]
    trained: Trained
    def __init__(self, tensors: _Optional[_Iterable[_Union[_tensor_pb2.EncodedTensor, _Mapping]]] = ..., trained: _Optional[_Union[Trained, _Mapping]] = ...) -> None: ...

class Trained(_message.Message):
    __slots__ = ("round", "slot", "slots", "places", "ledger")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    PLACES_FIELD_NUMBER: _ClassVar[int]
    LEDGER_FIELD_NUMBER: _ClassVar[int]
    round: int
    slot: int
    slots: int
    places: int
    ledger: bytes
    def __init__(self, round: _Optional[int] = ..., slot: _Optional[int] = ..., slots: _Optional[int] = ..., places: _Optional[int] = ..., ledger: _Optional[bytes] = ...) -> None: ...
