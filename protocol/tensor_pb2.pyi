from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CodecId(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_ID_UNSPECIFIED: _ClassVar[CodecId]
    CODEC_ID_DENSE: _ClassVar[CodecId]
    CODEC_ID_DCT_TOPK: _ClassVar[CodecId]
    CODEC_ID_TOPK: _ClassVar[CodecId]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class ValueEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_ENCODING_UNSPECIFIED: _ClassVar[ValueEncoding]
    VALUE_ENCODING_FLOAT32: _ClassVar[ValueEncoding]
    VALUE_ENCODING_BFLOAT16: _ClassVar[ValueEncoding]
    VALUE_ENCODING_FLOAT16: _ClassVar[ValueEncoding]
    VALUE_ENCODING_INT8: _ClassVar[ValueEncoding]
    VALUE_ENCODING_INT4: _ClassVar[ValueEncoding]
    VALUE_ENCODING_SIGN: _ClassVar[ValueEncoding]
    VALUE_ENCODING_LEVELS2: _ClassVar[ValueEncoding]

class IndexCoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEX_CODING_PACKED: _ClassVar[IndexCoding]
    INDEX_CODING_ELIAS_FANO: _ClassVar[IndexCoding]
CODEC_ID_UNSPECIFIED: CodecId
CODEC_ID_DENSE: CodecId
CODEC_ID_DCT_TOPK: CodecId
CODEC_ID_TOPK: CodecId
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
VALUE_ENCODING_UNSPECIFIED: ValueEncoding
VALUE_ENCODING_FLOAT32: ValueEncoding
VALUE_ENCODING_BFLOAT16: ValueEncoding
VALUE_ENCODING_FLOAT16: ValueEncoding
VALUE_ENCODING_INT8: ValueEncoding
VALUE_ENCODING_INT4: ValueEncoding
VALUE_ENCODING_SIGN: ValueEncoding
VALUE_ENCODING_LEVELS2: ValueEncoding
INDEX_CODING_PACKED: IndexCoding
INDEX_CODING_ELIAS_FANO: IndexCoding

class EncodedTensor(_message.Message):
    __slots__ = ("codec", "shape", "dtype", "chunk_shape", "topk", "index_bits", "indices", "indices_zstd", "value_encoding", "values", "values_zstd", "block_size", "scales", "scales_zstd", "index_coding")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    INDEX_BITS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    INDICES_ZSTD_FIELD_NUMBER: _ClassVar[int]
    VALUE_ENCODING_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUES_ZSTD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    SCALES_ZSTD_FIELD_NUMBER: _ClassVar[int]
    INDEX_CODING_FIELD_NUMBER: _ClassVar[int]
    codec: CodecId
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    chunk_shape: _containers.RepeatedScalarFieldContainer[int]
    topk: int
    index_bits: int
    indices: bytes
    indices_zstd: bool
    value_encoding: ValueEncoding
    values: bytes
    values_zstd: bool
    block_size: int
    scales: bytes
    scales_zstd: bool
    index_coding: IndexCoding
    def __init__(self, codec: _Optional[_Union[CodecId, str]] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., chunk_shape: _Optional[_Iterable[int]] = ..., topk: _Optional[int] = ..., index_bits: _Optional[int] = ..., indices: _Optional[bytes] = ..., indices_zstd: _Optional[bool] = ..., value_encoding: _Optional[_Union[ValueEncoding, str]] = ..., values: _Optional[bytes] = ..., values_zstd: _Optional[bool] = ..., block_size: _Optional[int] = ..., scales: _Optional[bytes] = ..., scales_zstd: _Optional[bool] = ..., index_coding: _Optional[_Union[IndexCoding, str]] = ...) -> None: ...
