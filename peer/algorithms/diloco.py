"""DiLoCo (Douillard et al., arXiv 2311.08105) with one-step-delayed and eager outer updates
(Kale, Douillard, Donchev, arXiv 2502.12996), over any Exchange.

Every `inner_steps` inner optimizer steps, participant m computes its outer pseudo-gradient
`delta_m(t) = theta(t-1) - theta_m(t)` (start of the phase minus end) and the outer optimizer, SGD (with
Nesterov momentum by default in standard mode only: OUTER_MOMENTUM), steps the global parameters theta:

- standard: block until `delta(t)` = the sample-weighted mean of every delta_m(t) is known, then
  `theta(t) = Outer(theta(t-1), delta(t))`; everyone restarts from theta(t), bit-identical.
- delayed (naive overlap): send delta_m(t) in the background and apply the previous round's mean
  delta(t-1) instead; the next phase starts from there. The paper measures this hurting loss badly.
- eager: apply `delta(t-1) - share_m(t-1) + share_m(t)` at once: last round's mean with this
  participant's stale share replaced by its fresh one (share = its samples over the round's total
  times what it sent; 1/M each with equal samples: `delta(t-1) + (delta_m(t) - delta_m(t-1)) / M`).
  When the true mean lands a round later it enters the next step. Participants differ by their own
  fresh shares, a bounded amount, instead of being bit-identical.

Shared state: what every participant holds alike, for the exchange to compare and for joiners to
download: the global parameters and the outer momentum. In eager mode those differ per participant,
so a second copy is kept: the *consensus* parameters and momentum, stepped with the true means only
(delta(t-1) at step t, as in delayed mode), identical everywhere. The outer SGD is linear in its
inputs, so the eager parameters are always the consensus plus this participant's own-share
correction; a joiner starts with no correction. `finish()` applies the last mean to the consensus and
ends every eager participant there, on bit-identical parameters (the sequence delta(0..T) applied in
order, as standard mode would).

Over the swarm each round's contributions are screened (shoal.peer.algorithms.robust: sample weights
capped, norms bounded by the median's, directions opposed to the others dropped); over an exchange of
trusted participants (LoopbackExchange, TorchDistributedExchange) nothing is, by default: plain weighted
means, the reference semantics (`robust=` decides otherwise). Malformed and opposed contributions are
left out and reported to the exchange, which strikes their senders. A round that counts nothing leaves the
parameters and the outer momentum as they were; a pseudo-gradient of this participant's or a round's
mean with NaN or infinite values is refused and counted, never applied nor encoded.

In delayed and eager mode the exchange runs on a background thread owned by this object while the
next inner phase computes; `stats` records how long it took and how long the caller waited for it.
Pseudo-gradients travel exactly (float32, the default) or through a codec of shoal.compression
(dense int8/int4, DCT top-k) with error feedback: what the codec dropped joins the next round's.

    diloco = DiLoCo(model, torch.optim.AdamW(model.parameters(), lr=4e-4, weight_decay=0.1,
                    betas=(0.9, 0.95)), exchange=exchange, inner_steps=50, mode="eager")
    for batch in batches:
        model(batch).backward()
        diloco.step()          # inner step, and every 50 steps an outer step
    diloco.finish()            # apply the last round still in flight
    diloco.close()
"""

import copy
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from shoal.compression import Codec, DCTTopKCodec, DecodeLimits, MalformedPayloadError, decode_tensor
from shoal.peer.algorithms.butterfly import Pieces
from shoal.peer.algorithms.canonical import NesterovSGD
from shoal.peer.algorithms.configs import outer_settings
from shoal.peer.algorithms.exchange import Averaged, Contribution, Exchange, Plan
from shoal.peer.algorithms.feedback import ErrorFeedback
from shoal.peer.algorithms.hooks import NO_HOOKS, Hooks
from shoal.peer.algorithms.in_flight import InFlight
from shoal.peer.algorithms.robust import (
    DILOCO,
    DILOCO_SPARSE,
    Reference,
    Robustness,
    Screened,
    Suspicion,
    default_for,
    finite,
    report,
    sender_keys,
)
from shoal.protocol import Payload, parse_message


@dataclass(slots=True)
class OuterStats:
    """Counters of the outer steps, cumulative."""

    outer_steps: int = 0
    exchange_s: float = 0.0
    """Seconds the exchanges took (encode, collective, decode), on either thread."""
    waited_s: float = 0.0
    """Seconds the training loop spent on exchanges (encoding, and waiting for collectives): all of
    exchange_s in standard mode, ideally only the encoding in delayed and eager mode."""
    bytes_sent: int = 0
    """Payload bytes this participant sent."""
    rejected: int = 0
    """Contributions dropped as malformed."""
    clipped: int = 0
    """Contributions scaled down to the round's norm bound."""
    screened: Counter = field(default_factory=Counter)
    """Contributions left out as `opposed` to the others, or as persistent `outlier`s
    (shoal.peer.algorithms.robust), by reason."""
    refused: Counter = field(default_factory=Counter)
    """This participant's own pseudo-gradients (`own_non_finite`: its inner phase diverged; it sends
    zeros) and rounds' means (`aggregate_non_finite`) refused for NaN or infinite values, never applied
    nor encoded."""
    resyncs: int = 0
    """Times the exchange replaced the shared state with the swarm's."""
    uncounted: int = 0
    """Rounds whose aggregate left this participant's payload out (bounded fan-in: its work was carried)."""
    # a Counter of float seconds (typeshed types a Counter's values as int)
    phase_seconds: dict[str, float] = field(default_factory=cast("Callable[[], dict[str, float]]", Counter))
    """Seconds spent per phase of the outer steps: encode, exchange, decode, apply (wall time on the
    host, on whichever thread ran it)."""

    @property
    def hidden_s(self) -> float:
        """Exchange time overlapped with computation instead of waited for."""
        return max(self.exchange_s - self.waited_s, 0.0)


@dataclass(frozen=True, slots=True)
class _Sent:
    """What this participant sent in one round."""

    payload: bytes
    decoded: list[torch.Tensor]
    """The pseudo-gradient as every receiver decodes it."""
    samples: int
    phases: int = 1
    """Inner phases it averages: more than one when it carries phases a bounded fan-in left out."""


@dataclass(frozen=True, slots=True)
class _Carried:
    """Work a bounded fan-in left out, sent again with the next round's."""

    displacement: list[torch.Tensor]
    """The pseudo-gradients' sum over its inner phases."""
    phases: int
    samples: int


@dataclass(frozen=True, slots=True)
class _RoundResult:
    mean: list[torch.Tensor]
    """The sample-weighted mean of every accepted participant's pseudo-gradient, per parameter."""
    total_samples: float
    """The weight behind the mean: shares of it are samples / total_samples (0: nothing accepted)."""
    adopted: list[torch.Tensor] | None = None
    """The swarm's shared state, when this participant's differed at the start of the round."""
    own_share: float | None = None
    """The weight this participant's own payload had in the mean (0: left out); None: not known (the
    exchange averaged it), so samples / total_samples."""
    counted: bool = True
    """Whether this participant's payload was among the round's contributions (a bounded fan-in
    aggregates only some: shoal.protocol.rules)."""


class DiLoCo:
    """The outer loop around the user's model and (unchanged) inner optimizer.

    Args:
        model: the model whose trainable parameters are synchronized.
        inner_optimizer: steps the model every call of `step` (AdamW in the paper).
        exchange: how participants meet.
        inner_steps: H, inner steps per outer step.
        outer_lr: outer learning rate (DiLoCo: 0.7; the eager paper: 0.4).
        outer_momentum: outer Nesterov momentum; None: the mode's in OUTER_MOMENTUM (0.9 standard, 0
            delayed and eager).
        nesterov: Nesterov momentum in the outer SGD.
        mode: "standard", "delayed" or "eager".
        codec: how pseudo-gradients travel; None sends them exactly (float32). A lossy codec gets
            error feedback: what it dropped joins the next round's pseudo-gradient.
        error_decay: beta of the error feedback, as SparseLoCo places it (arXiv 2508.15706): the
            codec encodes `e = beta * e + delta_m` and keeps `e - sent` (1: all that was dropped).
        max_payload_bytes: contributions larger than this are rejected unread.
        robust: how each round screens its contributions (shoal.peer.algorithms.robust); `robust.NONE`:
            plain weighted means, the reference semantics. None: `robust.NONE` over an exchange of
            trusted participants (`Exchange.trusted`: LoopbackExchange, TorchDistributedExchange);
            over the swarm `DILOCO`, or `DILOCO_SPARSE` with a top-k codec, whose payloads overlap
            too little for a per-round drop.
        butterfly: let the exchange average pseudo-gradients piece by piece, where it can
            (shoal.peer.algorithms.butterfly: the swarm under a coordinator); the codec must be dense and
            block-aligned (int8, int4, 16 or 32 bits). Each piece's parts are clipped against the
            median of that piece's.
        carry: when a bounded fan-in (shoal.protocol.rules) leaves this participant's payload out
            of a round, also send its pseudo-gradient again, averaged with the next one (`_carry`). Off
            by default: the carried phases are stale by then, and it cost loss in every setting
            measured (BENCHMARKS.md). With `carry` the samples of the carried phases are claimed again
            with the next payload; without, the work left out is lost.
        outer_device: where the outer state lives (`--outer-state cpu`: the host, pinned), with the
            error feedback, the decoded payloads and their mean; the model's parameters are copied
            there and back once an outer step. None: the parameters' device.
    """

    hooks: Hooks = NO_HOOKS
    """What a benchmark observes of its rounds (shoal.peer.algorithms.hooks)."""

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        *,
        exchange: Exchange,
        inner_steps: int,
        outer_lr: float = 0.7,
        outer_momentum: float | None = None,
        nesterov: bool = True,
        mode: str = "standard",
        codec: Codec | None = None,
        error_decay: float = 1.0,
        max_payload_bytes: int = 1 << 31,
        robust: Robustness | None = None,
        butterfly: bool = False,
        carry: bool = False,
        outer_device: torch.device | str | None = None,
    ):
        if inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {inner_steps}")
        if not 0 <= error_decay <= 1:
            raise ValueError(f"error_decay must be in [0, 1], got {error_decay}")
        settings = self._outer_settings = outer_settings(mode, outer_lr, outer_momentum, nesterov)
        self.carry = carry
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner_optimizer = inner_optimizer
        self.exchange = exchange
        self.inner_steps = inner_steps
        self.mode = mode
        # theta: the global parameters every inner phase starts from, stepped by torch's own SGD; with
        # `outer_device` (--outer-state cpu) they, the outer momentum, the error feedback, the payloads
        # decoded and their mean live there (pinned host memory under CUDA), off the accelerator
        self.global_params = [outer_copy(p, outer_device) for p in self.params]
        self.feedback = ErrorFeedback(codec, self.global_params, error_decay)
        self.max_payload_bytes = max_payload_bytes
        if robust is None:
            untrusted = DILOCO_SPARSE if isinstance(self.feedback.codec, DCTTopKCodec) else DILOCO
            robust = default_for(exchange, untrusted)
        self.suspicion = Suspicion(robust)
        # the outer steps are the shared state's: the same bits on every device (canonical)
        self.outer_optimizer = NesterovSGD(self.global_params, **settings)
        # what every participant holds alike: theta itself, except in eager mode (module docstring)
        self.consensus_params = self.global_params
        self.consensus_optimizer = self.outer_optimizer
        if mode == "eager":
            self.consensus_params = [p.detach().clone() for p in self.global_params]
            self.consensus_optimizer = NesterovSGD(self.consensus_params, **settings)
        self.pieces: Pieces | None = None
        if butterfly:
            device = self.global_params[0].device if self.params else "cpu"
            shapes = [p.shape for p in self.params]
            self.pieces = Pieces(self.feedback.codec, shapes, robust=robust, device=device)
        self.stats = OuterStats()
        self._inner_step = 0
        self._samples = 0
        self._in_flight: InFlight[_RoundResult] = InFlight("diloco-exchange")
        self._last_sent: _Sent | None = None
        self._carried: _Carried | None = None  # bounded fan-in: the work not counted yet (`_carry`)
        if self.pieces is None:  # (a butterfly round's mean comes piece by piece: not replayed)
            exchange.replays_with(self.replay)

    def step(self, *, samples: int = 1, plan: Plan | None = None) -> None:
        """One inner step (the inner optimizer's, then zero_grad); an outer step every `inner_steps`.

        `samples` is what this inner step trained on; the round's total weights this participant.
        `plan`: the round it computes for, handed to the exchange with the outer step's payload.
        """
        self.inner_optimizer.step()
        self.inner_optimizer.zero_grad(set_to_none=True)
        self._inner_step += 1
        self._samples += samples
        if self._inner_step % self.inner_steps == 0:
            self.outer_step(plan)

    @torch.no_grad()
    def outer_step(self, plan: Plan | None = None) -> None:
        """Ends the inner phase now: exchange pseudo-gradients and step the global parameters; `plan`
        goes to the exchange with them (Exchange.gather)."""
        previous = self._collect_pending()  # before encoding: the codec is not shared across threads
        self._carry(previous, self._last_sent)
        pseudo = [
            start - p.detach().to(start.device)
            for start, p in zip(self.global_params, self.params, strict=True)
        ]
        if not finite(pseudo):
            pseudo = self._refuse_own(pseudo)
        carried, phases, samples = self._carried, 1, self._samples
        if carried is not None:  # the mean over the phases, weighted by all their samples
            phases, samples = phases + carried.phases, samples + carried.samples
            pseudo = [d.add_(c).div_(phases) for d, c in zip(pseudo, carried.displacement, strict=True)]
        sent = self._encode(pseudo, max(samples, 1), phases)
        self._samples, self._carried = 0, None
        start: float | torch.Tensor  # a time, then a parameter
        if self.mode == "standard":
            start = time.perf_counter()
            result = self._round(sent, self.shared_state(), plan)
            self.stats.waited_s += time.perf_counter() - start
            self._carry(result, sent)
            self._adopt(result)
            self._apply_round(result, self.global_params, self.outer_optimizer)
        else:
            if previous is not None:  # the true mean of the last round enters the consensus first
                self._adopt(previous)
                self._apply_round(previous, self.consensus_params, self.consensus_optimizer)
            # the state compared in this round is the one its mean will be applied to, a step from now
            self._in_flight.start(self._round, sent, self.shared_state(), plan)
            if self.mode == "eager":
                self._apply(self._eager_direction(previous, sent))
        self._last_sent = sent
        for p, start in zip(self.params, self.global_params, strict=True):
            p.copy_(start)
        self.stats.outer_steps += 1

    def shared_state(self) -> list[torch.Tensor]:
        """The consensus parameters, then their outer momentum (zeros before the first outer step)."""
        state = self.consensus_optimizer.state
        momentum = [state[p].get("momentum_buffer") for p in self.consensus_params]
        zeros = [
            torch.zeros_like(p) if m is None else m
            for p, m in zip(self.consensus_params, momentum, strict=True)
        ]
        return [*self.consensus_params, *zeros]

    @torch.no_grad()
    def load_shared_state(self, tensors: list[torch.Tensor]) -> None:
        """Replaces the consensus (and, in eager mode, the eager parameters: no own correction yet)
        with the swarm's; same order and shapes as `shared_state`."""
        count = len(self.consensus_params)
        if [t.shape for t in tensors] != [p.shape for p in self.consensus_params] * 2:
            raise ValueError("shared state does not match this DiLoCo's parameters")
        copies = [(self.consensus_params, self.consensus_optimizer)]
        if self.consensus_params is not self.global_params:
            copies.append((self.global_params, self.outer_optimizer))
        for params, optimizer in copies:
            for p, value, momentum in zip(params, tensors[:count], tensors[count:], strict=True):
                p.copy_(value)
                optimizer.state[p]["momentum_buffer"] = momentum.to(p.device, p.dtype, copy=True)
        for p, start in zip(self.params, self.global_params, strict=True):
            p.copy_(start)
        self.stats.resyncs += 1

    def _adopt(self, result: _RoundResult) -> None:
        if result.adopted is not None:
            self.load_shared_state(result.adopted)

    def _eager_direction(self, previous: _RoundResult | None, fresh: _Sent) -> list[torch.Tensor]:
        """delta(t-1) - own stale share + own fresh share (arXiv 2502.12996).

        The stale share is the weight the last round's mean gave this participant's payload (0 if
        screening left it out; less if it was clipped). The fresh share is weighted against the last
        round's total (this round's is not known yet); in the first round, or after a round that
        accepted nothing, against M equal participants.
        """
        if previous is None or self._last_sent is None or previous.total_samples <= 0:
            return [d / max(self.exchange.world_size, 1) for d in fresh.decoded]
        stale = self._last_sent
        stale_share = previous.own_share
        if stale_share is None:
            stale_share = stale.samples / previous.total_samples
        fresh_share = fresh.samples / previous.total_samples
        return [
            mean - stale_share * old + fresh_share * new
            for mean, old, new in zip(previous.mean, stale.decoded, fresh.decoded, strict=True)
        ]

    def _carry(self, result: _RoundResult | None, sent: _Sent | None) -> None:
        """Bounded fan-in (shoal.protocol.rules) with `carry`: a pseudo-gradient left out of its
        round's aggregate is sent again with the next one, and its samples claimed again. A
        pseudo-gradient is a displacement per inner phase, so the next payload is then the mean over
        the phases it carries, weighing all their samples: summed instead, a peer that waited k rounds
        would move the swarm k times as far."""
        if result is None or sent is None or result.counted:
            return
        self.stats.uncounted += 1
        if not self.carry:
            return
        self._carried = _Carried([d * sent.phases for d in sent.decoded], sent.phases, sent.samples)

    def _collect_pending(self) -> _RoundResult | None:
        """Waits for the previous background round, if one is in flight (counted as waiting)."""
        if not self._in_flight.busy:
            return None
        start = time.perf_counter()
        result = self._in_flight.wait()
        self.stats.waited_s += time.perf_counter() - start
        return result

    def _encode(self, pseudo: list[torch.Tensor], samples: int, phases: int = 1) -> _Sent:
        """Encodes the pseudo-gradient (plus error feedback); keeps what the codec dropped."""
        start = time.perf_counter()
        data, decoded = self.feedback.encode(pseudo)
        self.stats.bytes_sent += len(data)
        elapsed = time.perf_counter() - start  # always on the training thread: waited for
        self.stats.phase_seconds["encode"] += elapsed
        self.stats.exchange_s += elapsed
        self.stats.waited_s += elapsed
        return _Sent(data, decoded, samples, phases)

    def _round(self, sent: _Sent, state: list[torch.Tensor], plan: Plan | None = None) -> _RoundResult:
        """Gathers every participant's payload and returns the weighted mean (rank order), screened."""
        start = time.perf_counter()
        if self.pieces is None:
            result = self.exchange.gather(sent.payload, sent.samples, state=state, plan=plan)
            averaged = Averaged.gathered(result)
        else:
            averaged = self.exchange.average(sent.payload, sent.samples, state, self.pieces, plan)
        contributions, adopted, counted = averaged.contributions, averaged.adopted, averaged.counted
        gathered = time.perf_counter()
        self.stats.phase_seconds["exchange"] += gathered - start
        if contributions is None:  # averaged by the exchange, piece by piece
            # only `Exchange.average`, called with pieces, averages; an Averaged has contributions or pieces
            assert self.pieces is not None and averaged.pieces is not None
            mean = self.pieces.assemble(averaged.pieces)
            self.stats.clipped += averaged.clipped
            end = time.perf_counter()
            self.stats.phase_seconds["decode"] += end - gathered
            self.stats.exchange_s += end - start
            return _RoundResult(mean, float(max(averaged.samples, 1)), adopted)
        reference = Reference(sent.decoded) if self.exchange.gather_limit > 0 else None  # robust.Reference
        mean, total, verdict, senders, malformed = self._aggregate(contributions, self.suspicion, reference)
        for contribution, reason in malformed:
            self.stats.rejected += 1
            self.exchange.reject(contribution, reason)
        own = [f for c, f in zip(senders, verdict.factors, strict=True) if c.payload == sent.payload]
        self.stats.clipped += verdict.clipped
        report(self.exchange, senders, verdict, self.stats.screened)
        end = time.perf_counter()
        self.stats.phase_seconds["decode"] += end - gathered
        self.stats.exchange_s += end - start
        share = own[0] / total if own and total > 0 else 0.0
        return _RoundResult(mean, total, adopted, own_share=share, counted=counted)

    def _aggregate(
        self, contributions: Sequence[Contribution], suspicion: Suspicion, reference: Reference | None
    ) -> tuple[list[torch.Tensor], float, Screened, list[Contribution], list[tuple[Contribution, str]]]:
        """The round's screened, weighted mean of the contributions (rank order: the same sums
        everywhere): (mean, total weight, the verdict, the contributions decoded, the malformed with
        their reason)."""
        mean = [torch.zeros_like(p, dtype=torch.float32) for p in self.global_params]
        accepted, senders, malformed = [], [], []
        for contribution in contributions:
            try:
                accepted.append((self._decode(contribution), contribution.samples))
                senders.append(contribution)
            except MalformedPayloadError as error:
                malformed.append((contribution, error.reason))
        total, verdict = self.hooks.aggregate(self)(
            mean, accepted, suspicion.policy, suspicion, sender_keys(senders), reference
        )
        return mean, total, verdict, senders, malformed

    @torch.no_grad()
    def replay(
        self, state: list[torch.Tensor], contributions: list[Contribution], rounds: tuple[int, int] = (0, 1)
    ) -> tuple[list[torch.Tensor], list[bytes]] | None:
        """A round applied to a shared state handed in (`shared_state`'s form), as `outer_step` applies
        it to the consensus: the next shared state, on new tensors, and the senders rejected
        (shoal.peer.algorithms.exchange.Replay; a peer behind the swarm catches up so). Screening
        weighs the senders on a copy of this participant's record of them, and with no reference of
        its own (it sent nothing in that round): where that decides otherwise than the round did, the
        result differs from the swarm's, and the exchange downloads the state instead. The outer step
        has no schedule: `rounds` does not change it."""
        count = len(self.consensus_params)
        if [t.shape for t in state] != [p.shape for p in self.consensus_params] * 2:
            return None
        like = self.consensus_params
        params = [t.to(p.device, p.dtype, copy=True) for t, p in zip(state[:count], like, strict=True)]
        optimizer = NesterovSGD(params, **self._outer_settings)
        for p, momentum in zip(params, state[count:], strict=True):
            optimizer.state[p]["momentum_buffer"] = momentum.to(p.device, p.dtype, copy=True)
        mean, total, _, _, malformed = self._aggregate(contributions, copy.deepcopy(self.suspicion), None)
        if total > 0 and finite(mean):
            self._outer(mean, params, optimizer)
        momenta = [optimizer.state[p]["momentum_buffer"] for p in params]
        return [*params, *momenta], [c.sender for c, _ in malformed]

    def _decode(self, contribution: Contribution) -> list[torch.Tensor]:
        if contribution.samples <= 0:
            raise MalformedPayloadError("bad_samples", f"sample count {contribution.samples}")
        payload = parse_message(Payload, contribution.payload, max_bytes=self.max_payload_bytes)
        if len(payload.tensors) != len(self.params):
            raise MalformedPayloadError(
                "wrong_structure", f"{len(payload.tensors)} tensors for {len(self.params)}"
            )
        decoded = []
        for message, p in zip(payload.tensors, self.global_params, strict=True):
            limits = DecodeLimits(max_numel=max(p.numel(), 1))
            tensor = decode_tensor(message, device=p.device, limits=limits)
            if tensor.shape != p.shape:
                raise MalformedPayloadError(
                    "config_mismatch", f"shape {list(tensor.shape)} where the run's is {list(p.shape)}"
                )
            decoded.append(tensor.float())
        return decoded

    def _refuse_own(self, pseudo: list[torch.Tensor]) -> list[torch.Tensor]:
        """An inner phase that diverged (NaN or infinite parameters): its pseudo-gradient is refused and
        zeros go out instead (no weight in any mean: shoal.peer.algorithms.robust leaves them out), the
        error feedback and the inner optimizer's moments, poisoned too, start over, and the model goes
        back to the global parameters at the end of the outer step, as after every phase."""
        self.stats.refused["own_non_finite"] += 1
        self.exchange.refuse("own_non_finite")
        self.feedback.reset()
        self.inner_optimizer.state.clear()
        return [torch.zeros_like(d) for d in pseudo]

    def _apply_round(self, result: _RoundResult, params: list[torch.Tensor], optimizer: NesterovSGD) -> None:
        """A round's mean applied to `params`, unless the round counted nothing: the parameters and the
        outer momentum then stay as they were."""
        if result.total_samples > 0:
            self._apply(result.mean, params, optimizer)

    def _apply(
        self,
        direction: list[torch.Tensor],
        params: list[torch.Tensor] | None = None,
        optimizer: NesterovSGD | None = None,
    ) -> None:
        """One outer step of `params` (the global parameters by default) along `direction`, unless it or
        the step is not finite (refused and counted: a sum of huge finite values can overflow, and so
        can the step, a huge direction on huge parameters or momentum)."""
        self.hooks.outer_direction(self, direction, params is None)
        if not finite(direction):
            self.stats.refused["aggregate_non_finite"] += 1
            self.exchange.refuse("aggregate_non_finite")
            return
        started = time.perf_counter()
        if not self._outer(direction, params or self.global_params, optimizer or self.outer_optimizer):
            self.stats.refused["aggregate_non_finite"] += 1
            self.exchange.refuse("aggregate_non_finite")
        self.stats.phase_seconds["apply"] += time.perf_counter() - started

    @staticmethod
    def _outer(direction: list[torch.Tensor], params: list[torch.Tensor], optimizer: NesterovSGD) -> bool:
        """The outer step itself: `params` moved along `direction` by `optimizer`, unless that would make
        them or their momentum non-finite (False: nothing moved)."""
        for start, d in zip(params, direction, strict=True):
            start.grad = d.to(start.dtype)
        applied = optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return applied

    @torch.no_grad()
    def finish(self) -> None:
        """Ends training: waits for the exchange in flight and applies what is left of it, so every
        mode ends with the full last round (delayed: its mean; eager: its mean, to the consensus, which
        the model then takes: bit-identical on every participant). Standard mode: no-op."""
        previous = self._collect_pending()
        if previous is None:
            return
        self._carry(previous, self._last_sent)  # (counted only: nothing follows it)
        self._adopt(previous)
        self._apply_round(previous, self.consensus_params, self.consensus_optimizer)
        self._last_sent = None
        for p, start, final in zip(self.params, self.global_params, self.consensus_params, strict=True):
            start.copy_(final)
            p.copy_(final)

    def close(self) -> None:
        """Waits for the exchange in flight (collectives must complete on every participant) and
        stops the background thread."""
        self._in_flight.close()

    def __enter__(self) -> "DiLoCo":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def outer_copy(param: torch.Tensor, device: torch.device | str | None) -> torch.Tensor:
    """A copy of `param` for the outer state: on its own device (None), or on `device`, in pinned
    memory when that is the host of a CUDA machine (its copies to and from the GPU then go by DMA)."""
    copy = param.detach().to(device or param.device, copy=True)
    if device is not None and copy.device.type == "cpu" and torch.cuda.is_available():
        copy = copy.pin_memory()
    return copy
