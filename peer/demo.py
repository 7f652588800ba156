"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle, Kingma, arXiv 2411.19870), over any Exchange.

Per step and parameter p with gradient g (DESIGN.md, "DeMo"):

    p     *= 1 - lr * weight_decay
    delta  = decay * delta + lr * g                              (kept as DCT coefficients)
    kept   = top-k DCT coefficients of every chunk of delta     (sent: indices + values)
    delta -= error_feedback * kept                               (unquantized kept part)
    combined[c] = mean over the participants that sent coefficient c of their values
                  (weighted by sample counts if asked)
    p     -= lr * sign(idct(combined))

With the defaults (error_feedback 1, 32-bit values, unweighted) a step equals the reference code
published with the paper (github.com/bloc97/DeMo, demo.py), whose all-gather + scatter_reduce("mean")
this reproduces. Parameters of one chunk shape are transformed together as one batch of tiles
(`shoal.peer.tile_groups`), and one payload per step carries them all: a step is one collective,
with one message header per slice instead of per tensor.
Every participant decodes the same gathered bytes in rank order, its own included, so replicas stay
bit-identical even with quantized values. A malformed contribution is dropped and counted by reason
(and reported to the exchange, which may strike its sender); one whose norm exceeds `clip_ratio`
times the round's median is scaled down to it (shoal.peer.robust) and counted as `clipped`. The
shared state is the parameters: the exchange may replace them with the swarm's before the update.

    opt = DeMo(model.parameters(), lr=1e-3, exchange=LoopbackExchange.group(1)[0])
    loss.backward(); opt.step(); opt.zero_grad()
"""

import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import replace

import torch

from shoal.compression import DCTTopKCodec, DecodeLimits, MalformedPayloadError, dct
from shoal.compression.dct_topk import TopKCoefficients, unpack
from shoal.peer.exchange import Contribution, Exchange
from shoal.peer.robust import DEFAULT_CLIP_RATIO, clip_scales
from shoal.peer.tile_groups import Slice, slice_parameters
from shoal.protocol import Payload, parse_message

# workspace slots beyond the codec's 0 and 1 (transform scratch, magnitudes)
GRADIENT_SLOT, SUM_SLOT, WEIGHT_SLOT = 2, 2, 3


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
        max_slice_numel: parameters of one chunk shape are transformed together in slices of at most
            this many elements (a larger parameter alone); bounds the codec's scratch memory.
        clip_ratio: contributions whose norm exceeds this times the round's median are scaled down
            to it; None turns clipping off.
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
        max_slice_numel: int = 1 << 24,
        clip_ratio: float | None = DEFAULT_CLIP_RATIO,
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
        self.max_slice_numel = max_slice_numel
        self.clip_ratio = clip_ratio
        clip_scales([1.0], clip_ratio)  # validates it
        self._slice_cache: list[Slice] | None = None
        self.rejected: Counter[str] = Counter()
        """Contributions dropped, by MalformedPayloadError reason."""
        self.clipped = 0
        """Contributions scaled down to the round's norm bound."""
        self.resyncs = 0
        """Times the exchange replaced this participant's parameters with the swarm's."""
        self.bytes_sent = 0
        """Payload bytes this participant has sent, in total."""
        self.phase_seconds: Counter[str] = Counter()
        """Seconds spent per phase of the steps: encode, exchange, decode, apply (host wall time)."""
        self.bytes_received = 0
        """Payload bytes received from the other participants, in total."""

    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _slices(self) -> list[Slice]:
        if self._slice_cache is None:
            self._slice_cache = slice_parameters(self._trainable(), self.codec.chunk, self.max_slice_numel)
        return self._slice_cache

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, samples: int = 1) -> float | None:
        """One DeMo step; `samples` is this participant's sample count (for weighting and reports)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        settings = {
            p: (group["lr"], group["weight_decay"]) for group in self.param_groups for p in group["params"]
        }
        started = time.perf_counter()
        slices = self._slices()
        payload = Payload(
            tensors=[
                self.codec.pack(self._compress(piece, settings), piece.members[0].param.dtype)
                for piece in slices
            ]
        )
        data = payload.SerializeToString()
        params = self._trainable()
        encoded = time.perf_counter()
        contributions = self.exchange.gather(data, samples, state=params)
        adopted = self.exchange.adopted_state()
        if adopted is not None:
            self.load_shared_state(adopted)
        gathered = time.perf_counter()
        self.bytes_sent += len(data)
        self.bytes_received += sum(len(c.payload) for c in contributions if c.rank != self.exchange.rank)
        received = self._accept(contributions, slices)
        decoded = time.perf_counter()
        for index, piece in enumerate(slices):
            direction = self._combine([(coeffs[index], weight) for coeffs, weight in received], piece)
            # finite but huge values from a hostile peer can sum to inf and inf - inf to NaN: never apply NaN
            signs = torch.sign(torch.nan_to_num(direction, nan=0.0))
            for member in piece.members:
                member.matrix(member.param).add_(member.tiles(signs), alpha=-settings[member.param][0])
        phases = self.phase_seconds
        phases["encode"] += encoded - started
        phases["exchange"] += gathered - encoded
        phases["decode"] += decoded - gathered
        phases["apply"] += time.perf_counter() - decoded
        return loss

    def shared_state(self) -> list[torch.Tensor]:
        """What every participant holds alike: the trainable parameters (the momentum is local)."""
        return self._trainable()

    @torch.no_grad()
    def load_shared_state(self, tensors: list[torch.Tensor]) -> None:
        """Replaces the parameters with the swarm's (same order and shapes as `shared_state`)."""
        params = self._trainable()
        if [t.shape for t in tensors] != [p.shape for p in params]:
            raise ValueError("shared state does not match this optimizer's parameters")
        for p, t in zip(params, tensors, strict=True):
            p.copy_(t)
        self.resyncs += 1

    def _compress(self, piece: Slice, settings: dict) -> TopKCoefficients:
        """Steps 1-5 for a slice: decay, accumulate, select, error feedback. Returns what is sent.

        The momentum lives in the DCT domain: the transform is linear and orthonormal, so
        `dct(decay * delta + lr * g) = decay * dct(delta) + lr * dct(g)`. Each step then transforms
        only the gradient, and removing the sent part is a scatter of k values per chunk instead of
        an inverse transform.
        """
        first, plan = piece.members[0].param, piece.plan
        state = self.state[first]
        if "delta" not in state:  # the slice's momentum, DCT coefficients tile-major: one param-sized buffer
            state["delta"] = torch.zeros(
                plan.num_chunks, plan.chunk_numel, dtype=first.dtype, device=first.device
            )
        delta = state["delta"]
        gradients = self.codec.workspace.get(GRADIENT_SLOT, plan.numel, first.device, torch.float32).view(
            plan.shape
        )
        for member in piece.members:
            lr, weight_decay = settings[member.param]
            if weight_decay:
                member.param.mul_(1 - lr * weight_decay)
            if member.param.grad is None:  # an unused parameter still sends: same payload everywhere
                member.tiles(gradients).zero_()
            else:
                torch.mul(member.matrix(member.param.grad.contiguous()), lr, out=member.tiles(gradients))
        coefficients = dct.forward(gradients, plan, self.codec.workspace)
        delta.mul_(self.decay).add_(coefficients.reshape(delta.shape).to(delta.dtype))
        selection = self.codec.select_coefficients(delta, plan)
        if self.error_feedback:
            kept = selection.values.to(delta.dtype) * (1 - self.error_feedback)
            delta.scatter_(1, selection.indices, kept)
        return selection

    def _accept(
        self, contributions: list[Contribution], slices: list[Slice]
    ) -> list[tuple[list[TopKCoefficients], float]]:
        """Decodes and validates every contribution (rank order); drops and counts the malformed,
        clips the outsized."""
        limits = DecodeLimits(max_numel=max(piece.plan.numel for piece in slices))
        accepted = []
        for contribution in contributions:
            try:
                coeffs = self._decode(contribution, slices, limits)
            except MalformedPayloadError as error:
                self.rejected[error.reason] += 1
                self.exchange.reject(contribution, error.reason)
                continue
            weight = float(contribution.samples) if self.weight_by_samples else 1.0
            if weight > 0:
                accepted.append((coeffs, weight))
        if len(accepted) < 2 or self.clip_ratio is None:
            return accepted
        norms = torch.stack(
            [torch.stack([c.values.float().square().sum() for c in coeffs]).sum() for coeffs, _ in accepted]
        )
        scales = clip_scales(norms.sqrt().tolist(), self.clip_ratio)  # one host sync per step
        self.clipped += sum(scale < 1 for scale in scales)
        return [
            (coeffs if scale == 1 else [replace(c, values=c.values * scale) for c in coeffs], weight)
            for (coeffs, weight), scale in zip(accepted, scales, strict=True)
        ]

    def _decode(
        self, contribution: Contribution, slices: list[Slice], limits: DecodeLimits
    ) -> list[TopKCoefficients]:
        payload = parse_message(Payload, contribution.payload, max_bytes=self.max_payload_bytes)
        if len(payload.tensors) != len(slices):
            raise MalformedPayloadError(
                "wrong_structure", f"{len(payload.tensors)} tensors for {len(slices)} slices"
            )
        if contribution.samples < 0:
            raise MalformedPayloadError("bad_samples", f"negative sample count {contribution.samples}")
        decoded = []
        for message, piece in zip(payload.tensors, slices, strict=True):
            coeffs = unpack(message, piece.members[0].param.device, limits)
            if coeffs.plan != piece.plan:
                raise MalformedPayloadError(
                    "wrong_structure", f"plan {coeffs.plan} where {piece.plan} was expected"
                )
            decoded.append(coeffs)
        return decoded

    def _combine(self, received: list[tuple[TopKCoefficients, float]], piece: Slice) -> torch.Tensor:
        """Step 7: per coefficient, the (weighted) mean over the participants that sent it; then idct.

        Returns a view into the codec's workspace, valid until its next use."""
        plan, workspace = piece.plan, self.codec.workspace
        device = piece.members[0].param.device
        sums = workspace.get(SUM_SLOT, plan.numel, device, torch.float32).view(plan.num_chunks, -1).zero_()
        weights = (
            workspace.get(WEIGHT_SLOT, plan.numel, device, torch.float32).view(plan.num_chunks, -1).zero_()
        )
        for coeffs, weight in received:  # rank order: the same float sums on every participant
            sums.scatter_add_(1, coeffs.indices, coeffs.values * weight)
            weights.scatter_add_(1, coeffs.indices, torch.full_like(coeffs.values, weight))
        sums.div_(weights.clamp_(min=1e-30))  # where nobody sent a coefficient: 0 / tiny = 0
        return dct.inverse_dense(sums, plan, workspace, out=sums)  # sums is read before out is written
