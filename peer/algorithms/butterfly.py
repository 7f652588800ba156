"""Butterfly averaging of dense pseudo-gradients: a reduce-scatter, then an all-gather.

In a round whose participants are decided (by a coordinator) and ordered, say n of them, every
tensor's blocks are cut into n contiguous pieces; participant i *owns* piece i:
1. it pulls piece i of every other participant's payload, straight from its author;
2. it averages them with its own (sample-weighted, each part screened as shoal.peer.algorithms.robust says:
   weights capped, norms bounded, opposed parts left out), encodes the mean with the run's codec
   and serves it;
3. every participant pulls the other n - 1 means and puts the pieces together.

Each peer then sends and receives 2 (n - 1) / n payloads per round, against n - 1 when every peer
pulls every payload (the gather of shoal.peer.swarm.exchange): half at n = 4, an eighth at n = 16. The price:
the mean is quantized a second time (by its owner), and an owner could serve different means to
different peers; they would then disagree on their state, which the next round's state check finds
and repairs like any other disagreement (shoal.peer.swarm.exchange). Hivemind's averager reduces the same way
("butterfly all-reduce"), as does OpenDiLoCo through it.

Pieces follow the codec's blocks, so the pieces of an encoded tensor are slices of its byte streams:
an author cuts a piece from the payload it already encoded, with nothing encoded again, and piece i
decodes to exactly the values the whole payload decodes to there. A codec qualifies when it is dense
and each block's values fill whole bytes (`shardable`).

This module is the pure part (tensors and messages, no network); SwarmExchange moves the pieces.
"""

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeGuard, cast

import torch

from shoal.compression import Codec, DecodeLimits, DenseCodec, decode_tensor, streams, values
from shoal.peer.algorithms.robust import Robustness, add_screened_mean
from shoal.protocol import (
    CodecId,
    EncodedTensor,
    MalformedPayloadError,
    Payload,
    ValueEncoding,
    parse_message,
)

MIN_PARTICIPANTS = 3
"""Fewer, and a butterfly saves nothing: with 2 peers each still sends and receives one payload."""


def shardable(codec: Codec) -> TypeGuard[DenseCodec]:
    """Whether payloads of `codec` can be cut into pieces along its blocks."""
    per_tensor = (ValueEncoding.VALUE_ENCODING_SIGN, ValueEncoding.VALUE_ENCODING_LEVELS2)  # one scale table
    if not isinstance(codec, DenseCodec) or codec.encoding in per_tensor:
        return False
    return codec.block * values.BITS[cast(ValueEncoding, codec.encoding)] % 8 == 0


def ranges(numel: int, block: int, count: int) -> list[tuple[int, int]]:
    """The `count` pieces of a tensor of `numel` values, as [start, end) element ranges along blocks
    of `block` values; as even as whole blocks allow (a piece may be empty)."""
    blocks = -(-numel // block)
    bounds = [min(numel, blocks * i // count * block) for i in range(count)] + [numel]
    return list(itertools.pairwise(bounds))


def cut(payload: Payload, count: int) -> list[bytes]:
    """The `count` pieces of this peer's own payload (trusted: it encoded it), serialized: every
    tensor's slice, as a flat tensor of the same encoding, uncompressed. Each stream is read once."""
    pieces: list[list[EncodedTensor]] = [[] for _ in range(count)]
    stream: torch.Tensor | bytes
    scales: torch.Tensor | bytes
    cpu = cast(torch.device, "cpu")  # from_wire moves its tensor with .to(device), which takes a str too
    for message in payload.tensors:
        numel = math.prod(message.shape)
        encoding, block = message.value_encoding, message.block_size
        bits = values.BITS[encoding]
        stream = streams.from_wire(
            message.values, message.values_zstd, values.values_size(encoding, numel), "values", cpu
        )
        groups = -(-numel // block)
        scales = streams.from_wire(
            message.scales, message.scales_zstd, values.scale_bytes(encoding, groups), "scales", cpu
        )
        stream, scales = stream.numpy().tobytes(), scales.numpy().tobytes()
        for piece, (start, end) in zip(pieces, ranges(numel, block, count), strict=True):
            first, last = start // block, -(-end // block)
            piece.append(
                EncodedTensor(
                    codec=message.codec,
                    shape=[end - start],
                    dtype=message.dtype,
                    block_size=block,
                    value_encoding=encoding,
                    values=stream[start * bits // 8 : -(-end * bits // 8)],
                    scales=scales[4 * first : 4 * last] if values.is_scaled(encoding) else b"",
                )
            )
    return [Payload(tensors=piece).SerializeToString() for piece in pieces]


@dataclass(frozen=True, slots=True)
class Part:
    """One participant's piece, as pulled (untrusted)."""

    sender: bytes
    samples: int
    data: bytes


@dataclass(slots=True)
class PieceMean:
    """An owner's mean of one piece."""

    data: bytes
    """The serialized Payload served to the others."""
    tensors: list[torch.Tensor]
    """Its decoded slices, per tensor: what every other participant decodes from `data`."""
    samples: int
    """The samples behind it (the accepted parts')."""
    rejected: list[tuple[bytes, str]] = field(default_factory=list)
    """(sender, reason) of the parts left out as malformed."""
    clipped: int = 0


class Pieces:
    """The pieces of one model's pseudo-gradients (see the module docstring).

    Args:
        codec: the run's codec (`shardable`); means are encoded with it too.
        shapes: the shapes of the tensors of a payload, in order.
        robust: how the owner screens the piece's parts (shoal.peer.algorithms.robust): weights capped, norms
            bounded by the median part's, parts opposed to the others left out as `opposed`.
        device: where decoded tensors go.
    """

    def __init__(
        self,
        codec: Codec,
        shapes: Sequence[torch.Size],
        *,
        robust: Robustness,
        device: torch.device | str = "cpu",
    ):
        if not shardable(codec):
            raise ValueError(f"{type(codec).__name__} payloads cannot be cut into pieces")
        self.codec, self.shapes, self.robust = codec, [torch.Size(s) for s in shapes], robust
        self.device = torch.device(device)
        self.block = codec.block
        self.bits = values.BITS[codec.encoding]
        self._residual: tuple[tuple[int, int], list[torch.Tensor]] | None = None

    def spans(self, index: int, count: int) -> list[tuple[int, int]]:
        """Piece `index` of `count`: its [start, end) range in each flattened tensor."""
        return [ranges(shape.numel(), self.block, count)[index] for shape in self.shapes]

    def max_bytes(self, index: int, count: int) -> int:
        """A bound on the serialized size of piece `index` of `count` (values, scales, framing)."""
        total = 0
        for start, end in self.spans(index, count):
            groups = -(-(end - start) // self.block) + 1
            total += -(-(end - start) * self.bits // 8) + 4 * groups + 64
        return total + 64

    def decode(self, index: int, count: int, data: bytes) -> list[torch.Tensor]:
        """The slices an untrusted piece (a part or a mean) carries; raises MalformedPayloadError."""
        payload = parse_message(Payload, data, max_bytes=self.max_bytes(index, count))
        spans = self.spans(index, count)
        if len(payload.tensors) != len(spans):
            raise MalformedPayloadError("wrong_structure", f"{len(payload.tensors)} tensors for {len(spans)}")
        decoded = []
        for message, (start, end) in zip(payload.tensors, spans, strict=True):
            if message.codec != CodecId.CODEC_ID_DENSE:
                raise MalformedPayloadError("wrong_structure", "a piece must be dense")
            limits = DecodeLimits(max_numel=max(end - start, 1))
            tensor = decode_tensor(message, device=self.device, limits=limits)
            if tuple(tensor.shape) != (end - start,):
                raise MalformedPayloadError(
                    "wrong_structure", f"shape {list(tensor.shape)}, expected [{end - start}]"
                )
            decoded.append(tensor.float())
        return decoded

    def mean(self, index: int, count: int, parts: Sequence[Part], *, feedback: bool = False) -> PieceMean:
        """The owner's mean of piece `index` from the participants' `parts` (in the round's order):
        malformed ones are left out, the rest screened (shoal.peer.algorithms.robust) and weighted by their
        samples.

        With `feedback` (the piece this peer owns), what encoding the mean dropped is added to its next
        mean of the same piece, as the authors do with their own payloads: error feedback on both
        sides, as in DoubleSqueeze (Tang et al., arXiv 1905.05957)."""
        accepted, senders, rejected = [], [], []
        for part in parts:
            try:
                if part.samples <= 0:
                    raise MalformedPayloadError("bad_samples", f"sample count {part.samples}")
                accepted.append((self.decode(index, count, part.data), part.samples))
                senders.append(part.sender)
            except MalformedPayloadError as error:
                rejected.append((part.sender, error.reason))
        spans = self.spans(index, count)
        mean = [torch.zeros(end - start, device=self.device) for start, end in spans]
        total, verdict = add_screened_mean(mean, accepted, self.robust)
        rejected += [(sender, why) for sender, why in zip(senders, verdict.reasons, strict=True) if why]
        if feedback and self._residual is not None and self._residual[0] == (index, count):
            for m, r in zip(mean, self._residual[1], strict=True):
                m.add_(r)
        messages = [self.codec.encode(m) for m in mean]
        sent = [self.codec.decode(message, device=self.device).float() for message in messages]
        if feedback:
            self._residual = ((index, count), [m - s for m, s in zip(mean, sent, strict=True)])
        data = Payload(tensors=messages).SerializeToString()
        return PieceMean(data, sent, round(total), rejected, verdict.clipped)

    def assemble(self, pieces: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        """Every tensor, whole, from the decoded slices of its `count` pieces in order."""
        return [
            torch.cat([piece[t] for piece in pieces]).reshape(shape) for t, shape in enumerate(self.shapes)
        ]
