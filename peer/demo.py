"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle, Kingma, arXiv 2411.19870), over any Exchange.

Per step and parameter p with gradient g (DESIGN.md, "DeMo"):

    p     *= 1 - lr * weight_decay
    delta  = decay * delta + lr * g
    kept   = top-k DCT coefficients of every chunk of delta     (sent: indices + values)
    delta -= error_feedback * idct(kept)                         (unquantized kept part)
    combined[c] = mean over the participants that sent coefficient c of their values
                  (weighted by sample counts if asked)
    p     -= lr * sign(idct(combined))

With the defaults (error_feedback 1, 32-bit values, unweighted) a step equals the reference code
published with the paper (github.com/bloc97/DeMo, demo.py), whose all-gather + scatter_reduce("mean")
this reproduces. One payload per step carries every parameter, so a step is one collective.
Every participant decodes the same gathered bytes in rank order, its own included, so replicas stay
bit-identical even with quantized values. A malformed contribution is dropped and counted by reason.

    opt = DeMo(model.parameters(), lr=1e-3, exchange=LoopbackExchange.group(1)[0])
    loss.backward(); opt.step(); opt.zero_grad()
"""

from collections import Counter
from collections.abc import Callable, Iterable

import torch

from shoal.compression import DCTTopKCodec, DecodeLimits, MalformedPayloadError, dct
from shoal.compression.dct_topk import TopKCoefficients, unpack
from shoal.peer.exchange import Contribution, Exchange
from shoal.protocol import Payload, parse_message


class DeMo(torch.optim.Optimizer):
    """DeMo as a torch optimizer; see the module docstring for the update.

    Args:
        params: the parameters (or parameter groups with their own `lr` / `weight_decay`).
        lr: learning rate: the step size of the sign update and the scale of momentum accumulation.
        exchange: how participants meet (LoopbackExchange, TorchDistributedExchange, the swarm).
        compression_decay: momentum decay beta, in [0, 1) (reference 0.999).
        compression_topk: DCT coefficients sent per chunk (reference 32).
        compression_chunk: largest chunk side (reference 64).
        error_feedback: fraction alpha of the sent part removed from the momentum, in [0, 1]
            (reference 1.0; the paper's ablation favours 0.2).
        value_bits: 32, 16, 8, 4 or 1 bits per sent coefficient.
        weight_decay: decoupled weight decay.
        weight_by_samples: weight each participant's coefficients by its sample count.
        max_payload_bytes: contributions larger than this are rejected unread.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float,
        *,
        exchange: Exchange,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        error_feedback: float = 1.0,
        value_bits: int = 32,
        weight_decay: float = 0.0,
        weight_by_samples: bool = False,
        max_payload_bytes: int = 1 << 30,
    ):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= compression_decay < 1:
            raise ValueError(f"compression_decay must be in [0, 1), got {compression_decay}")
        if not 0 <= error_feedback <= 1:
            raise ValueError(f"error_feedback must be in [0, 1], got {error_feedback}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.codec = DCTTopKCodec(chunk=compression_chunk, topk=compression_topk, value_bits=value_bits)
        self.exchange = exchange
        self.decay = compression_decay
        self.error_feedback = error_feedback
        self.weight_by_samples = weight_by_samples
        self.max_payload_bytes = max_payload_bytes
        self.rejected: Counter[str] = Counter()
        """Contributions dropped, by MalformedPayloadError reason."""
        self.bytes_sent = 0
        """Payload bytes this participant has sent, in total."""
        self.bytes_received = 0
        """Payload bytes received from the other participants, in total."""

    def _trainable(self) -> list[tuple[dict, torch.Tensor]]:
        return [(group, p) for group in self.param_groups for p in group["params"] if p.requires_grad]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, samples: int = 1) -> float | None:
        """One DeMo step; `samples` is this participant's sample count (for weighting and reports)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        trainable = self._trainable()
        payload = Payload(
            tensors=[self.codec.pack(self._compress(group, p), p.dtype) for group, p in trainable]
        )
        data = payload.SerializeToString()
        contributions = self.exchange.gather(data, samples)
        self.bytes_sent += len(data)
        self.bytes_received += sum(len(c.payload) for c in contributions if c.rank != self.exchange.rank)
        received = self._accept(contributions, [p for _, p in trainable])
        for index, (group, p) in enumerate(trainable):
            direction = self._combine([(coeffs[index], weight) for coeffs, weight in received], p)
            # finite but huge values from a hostile peer can sum to inf and inf - inf to NaN: never apply NaN
            p.add_(torch.sign(torch.nan_to_num(direction, nan=0.0)).view_as(p), alpha=-group["lr"])
        return loss

    def _compress(self, group: dict, p: torch.Tensor) -> TopKCoefficients:
        """Steps 1-5: decay, accumulate, select, error feedback. Returns what this participant sends."""
        lr, weight_decay = group["lr"], group["weight_decay"]
        state = self.state[p]
        if "delta" not in state:
            state["delta"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        delta = state["delta"]
        if weight_decay:
            p.mul_(1 - lr * weight_decay)
        delta.mul_(self.decay)
        if (
            p.grad is not None
        ):  # an unused parameter still sends (its decayed momentum): same payload shape everywhere
            delta.add_(p.grad, alpha=lr)
        selection = self.codec.select(_matrix_view(delta))
        if self.error_feedback:
            delta.sub_(
                self.codec.reconstruct(selection).view_as(delta).to(delta.dtype), alpha=self.error_feedback
            )
        return selection

    def _accept(
        self, contributions: list[Contribution], params: list[torch.Tensor]
    ) -> list[tuple[list[TopKCoefficients], float]]:
        """Decodes and validates every contribution (rank order); drops and counts the malformed."""
        limits = DecodeLimits(max_numel=max((p.numel() for p in params), default=1))
        accepted = []
        for contribution in contributions:
            try:
                coeffs = self._decode(contribution, params, limits)
            except MalformedPayloadError as error:
                self.rejected[error.reason] += 1
                continue
            weight = float(contribution.samples) if self.weight_by_samples else 1.0
            if weight > 0:
                accepted.append((coeffs, weight))
        return accepted

    def _decode(
        self, contribution: Contribution, params: list[torch.Tensor], limits: DecodeLimits
    ) -> list[TopKCoefficients]:
        payload = parse_message(Payload, contribution.payload, max_bytes=self.max_payload_bytes)
        if len(payload.tensors) != len(params):
            raise MalformedPayloadError(
                "wrong_structure", f"{len(payload.tensors)} tensors for {len(params)} params"
            )
        if contribution.samples < 0:
            raise MalformedPayloadError("bad_samples", f"negative sample count {contribution.samples}")
        decoded = []
        for message, p in zip(payload.tensors, params, strict=True):
            expected = self.codec.plan(tuple(_matrix_view(p).shape))
            coeffs = unpack(message, p.device, limits)
            if coeffs.plan != expected:
                raise MalformedPayloadError(
                    "wrong_structure", f"tensor of plan {coeffs.plan} where {expected} was expected"
                )
            decoded.append(coeffs)
        return decoded

    def _combine(self, received: list[tuple[TopKCoefficients, float]], p: torch.Tensor) -> torch.Tensor:
        """Steps 7: per coefficient, the (weighted) mean over the participants that sent it; then idct."""
        plan = self.codec.plan(tuple(_matrix_view(p).shape))
        sums = torch.zeros(plan.num_chunks, plan.chunk_numel, device=p.device)
        weights = torch.zeros_like(sums)
        for coeffs, weight in received:  # rank order: the same float sums on every participant
            sums.scatter_add_(1, coeffs.indices, coeffs.values * weight)
            weights.scatter_add_(1, coeffs.indices, torch.full_like(coeffs.values, weight))
        combined = torch.where(weights > 0, sums / weights.clamp_min(1e-30), 0.0)
        return dct.inverse_dense(combined, plan, self.codec.workspace)


def _matrix_view(tensor: torch.Tensor) -> torch.Tensor:
    """0-d tensors travel as one-element 1-D tensors; every other tensor as it is."""
    return tensor.reshape(1) if tensor.dim() == 0 else tensor
