from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PayloadRequest(_message.Message):
    __slots__ = ("round", "digest", "shard", "shards", "reduced")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    REDUCED_FIELD_NUMBER: _ClassVar[int]
    round: int
    digest: bytes
    shard: int
    shards: int
    reduced: bool
    def __init__(self, round: _Optional[int] = ..., digest: _Optional[bytes] = ..., shard: _Optional[int] = ..., shards: _Optional[int] = ..., reduced: _Optional[bool] = ...) -> None: ...

class PayloadChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("round", "size", "chunk_bytes", "chunk_digests")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    size: int
    chunk_bytes: int
    chunk_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, round: _Optional[int] = ..., size: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., chunk_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("state", "manifest", "chunk", "steps")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    manifest: bool
    chunk: int
    steps: bool
    def __init__(self, state: _Optional[bytes] = ..., manifest: _Optional[bool] = ..., chunk: _Optional[int] = ..., steps: _Optional[bool] = ...) -> None: ...

class CountedPayload(_message.Message):
    __slots__ = ("owner", "digest", "samples", "size")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    owner: bytes
    digest: bytes
    samples: int
    size: int
    def __init__(self, owner: _Optional[bytes] = ..., digest: _Optional[bytes] = ..., samples: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class StateStep(_message.Message):
    __slots__ = ("round", "before", "counted")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BEFORE_FIELD_NUMBER: _ClassVar[int]
    COUNTED_FIELD_NUMBER: _ClassVar[int]
    round: int
    before: bytes
    counted: _containers.RepeatedCompositeFieldContainer[CountedPayload]
    def __init__(self, round: _Optional[int] = ..., before: _Optional[bytes] = ..., counted: _Optional[_Iterable[_Union[CountedPayload, _Mapping]]] = ...) -> None: ...

class StateSteps(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StateStep]
    def __init__(self, steps: _Optional[_Iterable[_Union[StateStep, _Mapping]]] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("size",)
    SIZE_FIELD_NUMBER: _ClassVar[int]
    size: int
    def __init__(self, size: _Optional[int] = ...) -> None: ...

class RelayRequest(_message.Message):
    __slots__ = ("run", "peer", "payload", "state")
    RUN_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    run: str
    peer: str
    payload: PayloadRequest
    state: StateRequest
    def __init__(self, run: _Optional[str] = ..., peer: _Optional[str] = ..., payload: _Optional[_Union[PayloadRequest, _Mapping]] = ..., state: _Optional[_Union[StateRequest, _Mapping]] = ...) -> None: ...

class ReachRequest(_message.Message):
    __slots__ = ("ports",)
    PORTS_FIELD_NUMBER: _ClassVar[int]
    ports: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ports: _Optional[_Iterable[int]] = ...) -> None: ...

class ReachReply(_message.Message):
    __slots__ = ("observed", "reachable", "checked")
    OBSERVED_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    observed: str
    reachable: bool
    checked: bool
    def __init__(self, observed: _Optional[str] = ..., reachable: _Optional[bool] = ..., checked: _Optional[bool] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...

class RunReply(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: str
    def __init__(self, run: _Optional[str] = ...) -> None: ...
