"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle, Kingma, arXiv 2411.19870), over any Exchange.

Per step and parameter p with gradient g (the paper's Algorithm 1):

    p     *= 1 - lr * weight_decay
    delta  = decay * delta + lr * g                              (kept as DCT coefficients)
    kept   = top-k DCT coefficients of every chunk of delta     (sent: indices + values)
    delta -= error_feedback * kept                               (unquantized kept part)
    combined[c] = mean over the participants that sent coefficient c of their values
                  (weighted by sample counts if asked)
    p     -= lr * sign(idct(combined))

With the defaults (error_feedback 1, 32-bit values, unweighted) over trusted participants
(LoopbackExchange, TorchDistributedExchange: nothing screened, `robust.NONE`) a step equals the
reference code published with the paper (github.com/bloc97/DeMo, demo.py), whose all-gather +
scatter_reduce("mean") this reproduces (tests/unit/test_reference_demo.py: bit for bit over gloo).
Parameters of one chunk shape are transformed together as one batch of tiles
(`shoal.peer.algorithms.tile_groups`), and one payload per step carries them all: a step is one collective,
with one message header per slice instead of per tensor.
Every participant decodes the same gathered bytes in rank order, its own included, so replicas stay
bit-identical even with quantized values. A malformed contribution is dropped and counted by reason
(and reported to the exchange, which may strike its sender). Over an untrusted exchange (the swarm),
or with `robust=` given, the rest are screened (shoal.peer.algorithms.robust, in the DCT domain where
they travel): one whose norm exceeds the round's median is scaled down to it (`clipped`), and a sender
whose recent agreement with the others is below 0, or far below the round's, is left out and reported
as an `outlier` (DeMo drops nothing on a single round's agreement by default: honest DeMo
contributions agree little). The message's top-k,
value encoding and chunk plan must be the run's (`config_mismatch`): a peer that sends more
coefficients than the run's k would get more say. The shared state is the parameters: the exchange
may replace them with the swarm's before the update, or rebuild the swarm's by replaying rounds with
`replay` (shoal.peer.swarm.replay), each at its own learning rate (`lr_at`).

`overlap=True` hides the exchange behind computation (the exchange must not block compute): step r
encodes its payload and hands it to a background thread owned by the optimizer, then applies
round r-1's aggregate, which arrived while step r's forward and backward ran. Every
update lands one step late, on parameters that every participant holds alike (the state a round
compares is the one its aggregate will be applied to, a step later); `finish()` applies the last
round, so all participants end on bit-identical parameters. The own contribution is not applied
ahead of the others': the update is the sign of the combined coefficients, so a participant's share
of it cannot be split off (DiLoCo's eager rule relies on the outer step being linear). Instead,
`lookahead=True` does what Psyche's overlapped DisTrO does (github PsycheFoundation/psyche,
shared/modeling/src/distro.rs): between steps the parameters sit at `p - lr * sign(momentum)`, this
participant's own guess of the update still in flight (its whole momentum, the sent part included),
so that the next gradient is taken about where the parameters will be; the next step puts the
parameters back first, exactly (from a copy, not by adding the shift back: replicas must stay
bit-identical), so every update still applies to the shared parameters.

    opt = DeMo(model.parameters(), lr=1e-3, exchange=LoopbackExchange.group(1)[0])
    loss.backward(); opt.step(); opt.zero_grad()
"""

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import cast, overload

import torch

from shoal.compression import DCTTopKCodec, DecodeLimits, MalformedPayloadError, dct
from shoal.compression.dct_topk import TopKCoefficients
from shoal.peer.algorithms import demo_receive
from shoal.peer.algorithms.demo_receive import SUM_SLOT, decode, screen
from shoal.peer.algorithms.exchange import Contribution, Exchange, Plan
from shoal.peer.algorithms.hooks import NO_HOOKS, Hooks
from shoal.peer.algorithms.in_flight import InFlight
from shoal.peer.algorithms.robust import (
    DEMO,
    Reference,
    Robustness,
    Screened,
    Suspicion,
    capped_weights,
    default_for,
    finite,
    report,
    sender_keys,
)
from shoal.peer.algorithms.tile_groups import Slice, slice_parameters
from shoal.protocol import Payload

GRADIENT_SLOT = SUM_SLOT  # the gradient's scratch (a step's transform), free again before the round's sums


@dataclass(frozen=True, slots=True)
class _Gathered:
    """A round's outcome as the exchange delivered it."""

    contributions: list[Contribution]
    adopted: list[torch.Tensor] | None
    """The swarm's parameters, when this participant's differed at the start of the round."""
    seconds: float
    selections: list[TopKCoefficients] = field(default_factory=list)
    """What this participant sent, per slice (to take back into its momentum if it did not count)."""
    samples: int = 0
    """The samples it announced with it."""
    counted: bool = True
    """Whether its payload counted (a bounded fan-in aggregates only some: shoal.protocol.rules)."""


@dataclass(frozen=True, slots=True)
class _Screened:
    """A round's contributions decoded and screened (`DeMo._screened`)."""

    accepted: list[tuple[list[TopKCoefficients], float]]
    """(coefficients, scaled by the norm bound where it clipped; weight) of those that count."""
    senders: list[Contribution]
    """The contributions decoded, in rank order."""
    decoded: list[list[TopKCoefficients]]
    verdict: Screened
    malformed: list[tuple[Contribution, str]]


@dataclass(slots=True)
class DeMoStats:
    """Counters of a DeMo optimizer, cumulative."""

    rejected: Counter[str] = field(default_factory=Counter)
    """Contributions dropped, by MalformedPayloadError reason, or screened out (`opposed`) or
    reported (`outlier`: still applied) by shoal.peer.algorithms.robust."""
    clipped: int = 0
    """Contributions scaled down to the round's norm bound."""
    refused: Counter[str] = field(default_factory=Counter)
    """Steps whose own gradient held NaN or infinite values (`own_non_finite`): it was refused, never
    added to the momentum; the step still sends the momentum's top-k."""
    resyncs: int = 0
    """Times the exchange replaced this participant's parameters with the swarm's."""
    bytes_sent: int = 0
    """Payload bytes this participant has sent, in total."""
    bytes_received: int = 0
    """Payload bytes received from the other participants, in total."""
    # a Counter of float seconds (typeshed types a Counter's values as int)
    phase_seconds: dict[str, float] = field(default_factory=cast("Callable[[], dict[str, float]]", Counter))
    """Seconds spent per phase of the steps: encode, exchange, decode, apply (host wall time)."""
    exchange_s: float = 0.0
    """Seconds the exchanges took, on whichever thread ran them (phase_seconds["exchange"] is what the
    training thread waited: all of it without overlap)."""
    uncounted: int = 0
    """Rounds whose aggregate left this participant's payload out (bounded fan-in)."""
    carried_samples: int = 0
    """Samples whose work did not count yet (bounded fan-in with `carry`): announced with the next
    payload."""


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
        robust: how each round screens its contributions (shoal.peer.algorithms.robust); `robust.NONE` gives
            the reference semantics. None: `robust.NONE` over an exchange of trusted participants
            (`Exchange.trusted`: LoopbackExchange, TorchDistributedExchange), `robust.DEMO` over the
            swarm.
        canonical: compute each round's direction so that every device gets the same bits
            (`demo_receive.signs`: the inverse DCT in exact integer arithmetic), as peers that compare
            their states' digests must. None: over an untrusted exchange (the swarm), not over a
            trusted one, whose participants compare nothing and keep the reference's float inverse.
        overlap: exchange in the background and apply each round's aggregate one step late.
        lookahead: with overlap, compute each gradient at the parameters shifted by this
            participant's own sign-of-momentum guess of the update in flight (one more
            parameter-sized buffer and one more inverse transform per step).
        carry: when a bounded fan-in (shoal.protocol.rules) leaves this participant's payload out
            of a round, also put what it sent back into the momentum (`_carry`). Off by default: the
            re-sent coefficients are stale by then, and it cost loss in every setting measured
            (BENCHMARKS.md). Either way the unsent rest stays in the momentum (error feedback). With
            `carry`, the samples behind the carried work are claimed again with the next payload.
    """

    hooks: Hooks = NO_HOOKS
    """What a benchmark observes of its rounds (shoal.peer.algorithms.hooks)."""

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
        robust: Robustness | None = None,
        canonical: bool | None = None,
        overlap: bool = False,
        lookahead: bool = False,
        carry: bool = False,
    ):
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not 0 <= compression_decay < 1:
            raise ValueError(f"compression_decay must be in [0, 1), got {compression_decay}")
        if not 0 <= error_feedback <= 1:
            raise ValueError(f"error_feedback must be in [0, 1], got {error_feedback}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if lookahead and not overlap:
            raise ValueError("lookahead needs overlap: without it no update is in flight")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self.codec = DCTTopKCodec(chunk=compression_chunk, topk=compression_topk, value_bits=value_bits)
        self.exchange = exchange
        self.decay = compression_decay
        self.error_feedback = error_feedback
        self.weight_by_samples = weight_by_samples
        self.max_payload_bytes = max_payload_bytes
        self.max_slice_numel = max_slice_numel
        self.robust = default_for(exchange, DEMO) if robust is None else robust
        self.suspicion = Suspicion(self.robust)
        self.canonical = not exchange.trusted if canonical is None else canonical
        self._slice_cache: list[Slice] | None = None
        self.stats = DeMoStats()
        self._in_flight: InFlight[_Gathered] | None = InFlight("demo-exchange") if overlap else None
        self.carry = carry
        self.lookahead = lookahead
        self._origin: list[torch.Tensor] | None = None  # lookahead: the parameters before the shift
        self._shifted = False
        self.lr_at: Callable[[int], float] | None = None
        """The learning rate of a round (a schedule's), for `replay`; None: the groups' own, constant."""
        exchange.replays_with(self.replay)

    def _trainable(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def _slices(self) -> list[Slice]:
        if self._slice_cache is None:
            self._slice_cache = slice_parameters(self._trainable(), self.codec.chunk, self.max_slice_numel)
        return self._slice_cache

    @overload
    def step(self, closure: None = None, *, samples: int = 1, plan: Plan | None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float], *, samples: int = 1, plan: Plan | None = None) -> float: ...

    @torch.no_grad()
    def step(
        self, closure: Callable[[], float] | None = None, *, samples: int = 1, plan: Plan | None = None
    ) -> float | None:
        """One DeMo step; `samples` is this participant's sample count (for weighting and reports),
        `plan` the round it computed for, handed to the exchange with its payload (Exchange.gather)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.unshift()
        started = time.perf_counter()
        previous = self._collect()  # overlap: the last round, before anything touches the parameters
        waited = time.perf_counter()
        slices, settings = self._slices(), self._settings()
        self._refuse_non_finite_gradients()
        selections = [self._compress(piece, settings) for piece in slices]
        payload = Payload(
            tensors=[
                self.codec.pack(selection, piece.members[0].param.dtype)
                for selection, piece in zip(selections, slices, strict=True)
            ]
        )
        data = payload.SerializeToString()
        params = self._trainable()
        encoded = time.perf_counter()
        self.stats.phase_seconds["encode"] += encoded - waited
        self.stats.phase_seconds["exchange"] += waited - started
        self.stats.bytes_sent += len(data)
        claimed, self.stats.carried_samples = samples + self.stats.carried_samples, 0
        if self._in_flight is None:
            gathered = self._gather(data, claimed, params, selections, plan)
            self.stats.phase_seconds["exchange"] += gathered.seconds
            self._adopt(gathered)
            self._apply(gathered, settings)
        else:
            if previous is not None:
                self._apply(previous, settings, steps_since=1)
            if self.lookahead:
                params = self._shift(slices, selections, settings)
            # the state this round compares is the one its aggregate will be applied to, a step from now
            self._in_flight.start(self._gather, data, claimed, params, selections, plan)
        return loss

    @torch.no_grad()
    def finish(self) -> None:
        """Ends training: with overlap, waits for the round in flight and applies it, so that every
        participant lands on the same parameters. Without overlap: no-op."""
        self.unshift()
        previous = self._collect()
        if previous is not None:
            self._apply(previous, self._settings())

    def close(self) -> None:
        """Waits for the exchange in flight (collectives must complete on every participant) and
        stops the background thread; the round is not applied (see finish)."""
        if self._in_flight is not None:
            self._in_flight.close(raise_error=False)

    def _shift(
        self,
        slices: list[Slice],
        selections: list[TopKCoefficients],
        settings: dict[torch.Tensor, tuple[float, float]],
    ) -> list[torch.Tensor]:
        """Lookahead: keeps the parameters in `_origin` (returned: the round's shared state) and moves
        them by -lr * sign(idct(momentum)), the momentum as before the sent part was removed."""
        params = self._trainable()
        if self._origin is None:
            self._origin = [torch.empty_like(p) for p in params]
        for origin, p in zip(self._origin, params, strict=True):
            origin.copy_(p)
        self._shifted = True
        for piece, selection in zip(slices, selections, strict=True):
            plan = piece.plan
            first = piece.members[0].param
            momentum = self.codec.workspace.get(SUM_SLOT, plan.numel, first.device, torch.float32)
            momentum = momentum.view(plan.num_chunks, -1)
            momentum.copy_(self.state[first]["delta"]).scatter_(
                1, selection.indices, selection.values.float()
            )
            signs = dct.inverse_dense(momentum, plan, self.codec.workspace, out=momentum).sign_()
            piece.add_to_params(signs, [-settings[m.param][0] for m in piece.members])
        return self._origin

    @torch.no_grad()
    def unshift(self) -> None:
        """Lookahead: puts the parameters back where the last step left them, exactly (a checkpoint
        then holds the shared parameters; the next forward pass goes without the lookahead)."""
        if self._shifted:
            assert self._origin is not None  # `_shift` keeps the parameters there before it shifts them
            for p, origin in zip(self._trainable(), self._origin, strict=True):
                p.copy_(origin)
            self._shifted = False

    def _refuse_non_finite_gradients(self) -> None:
        """A gradient with NaN or infinite values (a diverged forward pass, an overflow) would poison the
        momentum for good: the step's gradients are dropped instead, and counted (one host sync a step)."""
        grads = [p.grad for p in self._trainable() if p.grad is not None]
        if finite(grads):
            return
        for p in self._trainable():
            p.grad = None
        self.stats.refused["own_non_finite"] += 1
        self.exchange.refuse("own_non_finite")

    def _settings(self) -> dict[torch.Tensor, tuple[float, float]]:
        return {
            p: (group["lr"], group["weight_decay"]) for group in self.param_groups for p in group["params"]
        }

    def _gather(
        self,
        data: bytes,
        samples: int,
        params: list[torch.Tensor],
        selections: list[TopKCoefficients],
        plan: Plan | None = None,
    ) -> _Gathered:
        """Step 6: the exchange, on the training thread or the background one."""
        start = time.perf_counter()
        result = self.exchange.gather(data, samples, state=params, plan=plan)
        seconds = time.perf_counter() - start
        self.stats.exchange_s += seconds
        return _Gathered(list(result), result.adopted, seconds, selections, samples, result.counted)

    def _collect(self) -> _Gathered | None:
        """The round in flight, waited for (None without overlap or before the first step); its
        adopted state, if any, replaces the parameters at once."""
        gathered = None if self._in_flight is None else self._in_flight.wait()
        if gathered is None:
            return None
        self._adopt(gathered)
        return gathered

    def _adopt(self, gathered: _Gathered) -> None:
        if gathered.adopted is not None:
            self.load_shared_state(gathered.adopted)

    def _apply(
        self, gathered: _Gathered, settings: dict[torch.Tensor, tuple[float, float]], steps_since: int = 0
    ) -> None:
        """Steps 7-8 for a gathered round: decode, combine, and step along the sign. If this participant's
        payload did not count, what it sent goes back into its momentum first (`_carry`); `steps_since`:
        momentum steps taken since it was sent (1 with overlap)."""
        started = time.perf_counter()
        if not gathered.counted:
            self.stats.uncounted += 1
            if self.carry:
                self.stats.carried_samples += gathered.samples
                self._carry(gathered, steps_since)
        slices, contributions = self._slices(), gathered.contributions
        others = (c for c in contributions if c.rank != self.exchange.rank)
        self.stats.bytes_received += sum(len(c.payload) for c in others)
        received = self._accept(contributions, slices, gathered)
        decoded = time.perf_counter()
        for piece, signs in self._signs(received, slices):
            piece.add_to_params(signs, [-settings[m.param][0] for m in piece.members])
        self.stats.phase_seconds["decode"] += decoded - started
        self.stats.phase_seconds["apply"] += time.perf_counter() - decoded

    def _carry(self, gathered: _Gathered, steps_since: int) -> None:
        """Bounded fan-in with `carry`: a payload left out of the round's aggregate goes back into the
        momentum, as if error feedback had never removed it (decayed as the momentum was since)."""
        scale = self.error_feedback * self.decay**steps_since
        for piece, selection in zip(self._slices(), gathered.selections, strict=True):
            delta = self.state[piece.members[0].param]["delta"]
            delta.scatter_add_(1, selection.indices, selection.values.to(delta.dtype) * scale)

    def shared_state(self) -> list[torch.Tensor]:
        """What every participant holds alike: the trainable parameters (the momentum is local), as
        the last step left them (without the lookahead shift)."""
        return cast("list[torch.Tensor]", self._origin) if self._shifted else self._trainable()

    @torch.no_grad()
    def load_shared_state(self, tensors: list[torch.Tensor]) -> None:
        """Replaces the parameters with the swarm's (same order and shapes as `shared_state`)."""
        params = self._trainable()
        if [t.shape for t in tensors] != [p.shape for p in params]:
            raise ValueError("shared state does not match this optimizer's parameters")
        self._shifted = False  # the lookahead shift belonged to the parameters replaced
        for p, t in zip(params, tensors, strict=True):
            p.copy_(t)
        self.stats.resyncs += 1

    def _compress(self, piece: Slice, settings: dict[torch.Tensor, tuple[float, float]]) -> TopKCoefficients:
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
        lrs = [settings[m.param][0] for m in piece.members]
        piece.scale_params([1 - lr * settings[m.param][1] for m, lr in zip(piece.members, lrs, strict=True)])
        piece.gather(gradients, [m.param.grad for m in piece.members], lrs)
        coefficients = dct.forward(gradients, plan, self.codec.workspace)
        delta.mul_(self.decay).add_(coefficients.reshape(delta.shape).to(delta.dtype))
        selection = self.codec.select_coefficients(delta, plan)
        if self.error_feedback:
            kept = selection.values.to(delta.dtype) * (1 - self.error_feedback)
            delta.scatter_(1, selection.indices, kept)
        return selection

    def _accept(
        self, contributions: list[Contribution], slices: list[Slice], gathered: _Gathered | None = None
    ) -> list[tuple[list[TopKCoefficients], float]]:
        """Decodes and validates every contribution (rank order); drops and counts the malformed,
        then screens the rest (shoal.peer.algorithms.robust; a round too small for the median rule
        against what this participant sent, in `gathered`)."""
        reference = None  # under a bounded fan-in only: robust.Reference
        if gathered is not None and gathered.selections and self.exchange.gather_limit > 0:
            reference = Reference(gathered.selections)
        screened = self._screened(contributions, slices, reference, self.suspicion)
        for contribution, reason in screened.malformed:
            self.stats.rejected[reason] += 1
            self.exchange.reject(contribution, reason)
        self.hooks.screened(self, screened.decoded, slices, sender_keys(screened.senders), screened.verdict)
        self.stats.clipped += screened.verdict.clipped
        report(self.exchange, screened.senders, screened.verdict, self.stats.rejected)
        return screened.accepted

    def _screened(
        self,
        contributions: list[Contribution],
        slices: list[Slice],
        reference: Reference | None,
        suspicion: Suspicion,
    ) -> "_Screened":
        """`_accept`'s decoding and screening, with nothing reported or counted."""
        limits = DecodeLimits(max_numel=max(piece.plan.numel for piece in slices))
        decoded, senders, malformed = [], [], []
        for contribution in contributions:
            try:
                decoded.append(decode(contribution, slices, limits, self.codec, self.max_payload_bytes))
                senders.append(contribution)
            except MalformedPayloadError as error:
                malformed.append((contribution, error.reason))
        samples = [float(c.samples) if self.weight_by_samples else 1.0 for c in senders]
        verdict = screen(
            decoded,
            capped_weights(samples, self.robust.sample_ratio),
            slices,
            sender_keys(senders),
            [float(c.samples) for c in senders],
            reference,
            suspicion=suspicion,
            workspace=self.codec.workspace,
        )
        accepted = []
        for coeffs, factor, weight in zip(decoded, verdict.factors, verdict.weights, strict=True):
            if weight > 0:
                scale = factor / weight  # the norm bound's; the weight applies in demo_receive._mean
                accepted.append(
                    (coeffs if scale == 1 else [replace(c, values=c.values * scale) for c in coeffs], weight)
                )
        return _Screened(accepted, senders, decoded, verdict, malformed)

    def _signs(
        self, received: list[tuple[list[TopKCoefficients], float]], slices: list[Slice]
    ) -> Iterator[tuple[Slice, torch.Tensor]]:
        """Step 8's direction, slice by slice: the sign of the combined coefficients' inverse DCT (a
        view into the codec's workspace, valid until the next slice)."""
        for index, piece in enumerate(slices):
            yield (
                piece,
                demo_receive.signs(
                    [(coeffs[index], weight) for coeffs, weight in received],
                    piece,
                    self.codec.workspace,
                    canonical=self.canonical,
                ),
            )

    @torch.no_grad()
    def replay(
        self, state: list[torch.Tensor], contributions: list[Contribution], rounds: tuple[int, int]
    ) -> tuple[list[torch.Tensor], list[bytes]] | None:
        """A round applied to shared parameters handed in, as this optimizer's steps apply it
        (shoal.peer.algorithms.exchange.Replay; a peer behind the swarm catches up so): the parameters
        at the start of round `rounds[1]`, on new tensors, and the senders rejected. Without overlap
        the round's sign step at its own learning rate, then the next step's weight decay; with it, the
        next step's weight decay, then the sign step at the next step's rate. The rates are `lr_at`'s
        (a schedule's), or else the groups' own. Screening as in `replay` of DiLoCo: a copy of this
        participant's record, no reference; the exchange checks the result against the swarm's."""
        params = self._trainable()
        if [t.shape for t in state] != [p.shape for p in params]:
            return None
        into = {p: t.to(p.device, p.dtype, copy=True) for p, t in zip(params, state, strict=True)}
        settings = self._settings()

        def lr(p: torch.Tensor, number: int) -> float:
            return settings[p][0] if self.lr_at is None else self.lr_at(number)

        applied, after = rounds[1] if self._in_flight is not None else rounds[0], rounds[1]
        slices = self._slices()
        screened = self._screened(contributions, slices, None, copy.deepcopy(self.suspicion))

        def decay() -> None:
            for piece in slices:
                ps = [m.param for m in piece.members]
                piece.scale_params([1 - lr(p, after) * settings[p][1] for p in ps], into)

        if self._in_flight is not None:
            decay()
        for piece, signs in self._signs(screened.accepted, slices):
            piece.add_to_params(signs, [-lr(m.param, applied) for m in piece.members], into)
        if self._in_flight is None:
            decay()
        return [into[p] for p in params], [c.sender for c, _ in screened.malformed]
