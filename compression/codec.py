"""The codec interface, the registry keyed by the wire enum, and validation shared by all codecs.

A message is self-describing, so decoding is a function of (message, limits, device): the registry
maps `EncodedTensor.codec` to the class whose `decode_message` handles it. `check_registry` (run when
`shoal.compression` is imported) fails unless every `CodecId` but UNSPECIFIED has exactly one codec.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from shoal.protocol import CodecId, DType, EncodedTensor, MalformedPayloadError

DTYPES: dict[DType, torch.dtype] = {
    DType.DTYPE_FLOAT32: torch.float32,
    DType.DTYPE_FLOAT16: torch.float16,
    DType.DTYPE_BFLOAT16: torch.bfloat16,
    DType.DTYPE_FLOAT64: torch.float64,
}
WIRE_DTYPES: dict[torch.dtype, DType] = {dtype: wire for wire, dtype in DTYPES.items()}


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeLimits:
    """Bounds on what a received message may claim, checked before anything is allocated."""

    max_numel: int = 1 << 28
    """Largest element count of one tensor (2**28 float32 = 1 GiB)."""
    max_dims: int = 8
    """Most dimensions of one tensor."""
    max_chunk: int = 256
    """Largest side of a DCT chunk (bounds the basis matrices a message can make us build)."""

    def __post_init__(self) -> None:
        for name in ("max_numel", "max_dims", "max_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeLimits.{name} must be >= 1, got {getattr(self, name)}")


class Codec(ABC):
    """Turns a tensor into an EncodedTensor and back."""

    codec_id: ClassVar[int]

    def __init__(self, *, limits: DecodeLimits | None = None):
        self.limits = limits or DecodeLimits()

    @abstractmethod
    def encode(self, tensor: torch.Tensor) -> EncodedTensor:
        """The message for `tensor` (any floating dtype, any device)."""

    def decode(self, message: EncodedTensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor a message describes, whichever codec produced it; on `device`."""
        return decode_tensor(message, device=torch.device(device), limits=self.limits)

    @classmethod
    @abstractmethod
    def decode_message(
        cls, message: EncodedTensor, *, device: torch.device, limits: DecodeLimits
    ) -> torch.Tensor:
        """Decodes a message whose `codec` is `cls.codec_id`; raises MalformedPayloadError."""


CODECS: dict[int, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator: makes `cls` the decoder of messages carrying `cls.codec_id`."""
    if cls.codec_id in CODECS:
        raise RuntimeError(f"codec id {cls.codec_id} registered twice: {CODECS[cls.codec_id]} and {cls}")
    CODECS[cls.codec_id] = cls
    return cls


def check_registry() -> None:
    """Every wire codec id has a codec and every codec a wire id."""
    wire = {value for value in CodecId.values() if value != CodecId.CODEC_ID_UNSPECIFIED}
    if wire != set(CODECS):
        raise RuntimeError(
            f"codec registry out of sync with the wire enum: enum {sorted(wire)}, registered {sorted(CODECS)}"
        )


def decode_tensor(
    message: EncodedTensor, *, device: torch.device | str = "cpu", limits: DecodeLimits | None = None
) -> torch.Tensor:
    """Decodes any EncodedTensor, validating it against `limits`."""
    codec = CODECS.get(message.codec)
    if codec is None:
        raise MalformedPayloadError("unknown_codec", f"codec id {message.codec} is not known")
    return codec.decode_message(message, device=torch.device(device), limits=limits or DecodeLimits())


def checked_shape(message: EncodedTensor, limits: DecodeLimits) -> tuple[tuple[int, ...], torch.dtype]:
    """The message's shape and dtype, after the checks every codec needs."""
    if len(message.shape) > limits.max_dims:
        raise MalformedPayloadError(
            "bad_shape", f"{len(message.shape)} dims exceed the limit of {limits.max_dims}"
        )
    numel = 1
    for size in message.shape:  # python ints: a product of claimed sizes cannot overflow
        numel *= size
        if numel > limits.max_numel or size > limits.max_numel:  # a 0 elsewhere must not excuse 2**63
            raise MalformedPayloadError(
                "too_large", f"shape {list(message.shape)} exceeds the limit of {limits.max_numel} elements"
            )
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise MalformedPayloadError("bad_dtype", f"dtype {message.dtype} is not known")
    return tuple(message.shape), dtype


def wire_dtype(tensor: torch.Tensor) -> DType:
    """The wire dtype of a tensor to encode; a clear error for a tensor no codec can carry."""
    if tensor.dtype not in WIRE_DTYPES:
        raise ValueError(f"can only encode float32/float16/bfloat16/float64 tensors, got {tensor.dtype}")
    return WIRE_DTYPES[tensor.dtype]


def checked_output(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` cast to the message's dtype; rejected if a value does not fit it (overflow to inf)."""
    result = tensor.to(dtype)
    if not bool(torch.isfinite(result).all()):
        raise MalformedPayloadError("non_finite", f"decoded values overflow {dtype}")
    return result
