"""The round loop of one peer (`Trainer`), with checkpoints and a clean stop. No network here: the
trainer runs over any `Exchange` (loopback threads, torch.distributed, or the swarm's, driven by
shoal.peer.job.runtime.SwarmPeer).

Each round: compute (forward and backward on this peer's micro-batches, gradients accumulated),
then the optimizer's step, which encodes, exchanges, decodes and applies (DeMo: one step per round;
DiLoCo: `inner_steps` inner steps, the last one ending in the outer step). Each phase is timed into
a `RoundReport`.

Heterogeneous hardware: the micro-batch size starts at `batch_size` and is halved when the device
runs out of memory (the round's accumulation is restarted, never crashed; below 1 it is a clear
`OutOfMemory`), and with a `compute_window` as many micro-batches are accumulated per step as fit
in it, measured on the previous rounds, so a fast GPU contributes more samples per round than a
laptop CPU. `autocast` wraps the forward passes (bf16 on GPUs that support it, shoal.peer.train.hardware).

Checkpoints (shoal.peer.checkpoint) are written every `checkpoint_every` rounds and when a stop is
asked for (`stop_on_signals`: SIGTERM or SIGINT set a flag that the loop checks after each round,
so the peer leaves at a round boundary, with a checkpoint, within one round). `resume()` loads the
newest one; the exchange then re-syncs the peer if the swarm moved on meanwhile.
"""

import contextlib
import functools
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from shoal.compression import Codec
from shoal.peer.algorithms.configs import AlgorithmConfig
from shoal.peer.algorithms.exchange import Exchange, Plan
from shoal.peer.algorithms.schedule import Schedule
from shoal.peer.algorithms.synchronizer import synchronizer
from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.data.ledger import TokenLedger
from shoal.peer.models.loading import LossFn, model_loss
from shoal.peer.train.hardware import LossScale
from shoal.peer.train.ranks import LocalRanks
from shoal.peer.train.stopping import StopRequest

PHASES = ("compute", "encode", "exchange", "decode", "apply")

Batches = Callable[[int, int, int, Plan | None], tuple[torch.Tensor, torch.Tensor]]
"""batches(step, micro, batch_size, plan) -> (inputs, targets): the `micro`-th micro-batch of this
peer's `step`-th optimizer step, `batch_size` samples, for the round `plan` (`Trainer.round`'s: a
swarm peer's RoundPlan, whose round, slot and data seed choose its data; None without one)."""


class OutOfMemory(RuntimeError):
    """Even one sample per micro-batch does not fit on the device."""


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, and the RuntimeErrors MPS and CPU allocators raise."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one round did on this peer."""

    round: int
    """The swarm's round number (the exchange's), or the local count for exchanges without one."""
    loss: float
    """Mean training loss of the round's micro-batches."""
    participants: int
    """Contributions aggregated in the round (the exchange's world size after it)."""
    samples: int
    finished_at: float
    """Unix time the round ended on this peer (compare with the schedule's deadline)."""
    phases: dict[str, float]
    """Seconds per phase (PHASES): compute, then the optimizer's encode, exchange, decode, apply."""
    tokens: int = 0
    """Target tokens trained on."""
    micro_batches: int = 1
    """Micro-batches accumulated per optimizer step: those the round did, over its steps (rounded down
    where a window's remainder gave some steps one more)."""
    batch_size: int = 0
    """Samples per micro-batch."""
    lr: float = 0.0
    """The learning rate of the round's last step."""

    @property
    def compute_s(self) -> float:
        """Forward and backward passes (and DiLoCo's inner optimizer steps)."""
        return self.phases["compute"]

    @property
    def exchange_s(self) -> float:
        """The optimizer step that communicates: encode, exchange, decode, apply."""
        return sum(self.phases[k] for k in PHASES[1:])


class Trainer:
    """One peer's training: the model, its optimizer over `exchange`, and the loop.

    Args:
        model: the model; with the default `loss_fn` its `forward(inputs, targets=...)` returns the loss.
        exchange: how this peer meets the others.
        algorithm: the algorithm and its hyperparameters (shoal.peer.algorithms.configs); DiLoCo's
            butterfly averaging goes piece by piece where the exchange can (shoal.peer.algorithms.butterfly),
            and needs a dense, block-aligned codec.
        batches: this peer's micro-batches (see `Batches`).
        codec: how DiLoCo's pseudo-gradients travel (None: exactly).
        checkpoints: where to keep checkpoints (None: nowhere).
        checkpoint_every: rounds between checkpoints (0: only on stop).
        loss_fn: how to compute the loss of a micro-batch.
        batch_size: samples per micro-batch to start with (halved on out-of-memory).
        compute_window: seconds of computation per round to fill with micro-batches (None: one
            micro-batch per optimizer step).
        max_micro_batches: at most this many micro-batches per optimizer step.
        autocast: a context manager factory wrapping each forward pass.
        schedule: the learning rate at each step, from the swarm's round (the plan's) and the step's
            share of it (shoal.peer.algorithms.schedule); None: the algorithm's, constant.
        grad_clip: each step's gradient clipped to this norm (0: not clipped).
        weight_decay: DeMo's, or DiLoCo's inner AdamW's (None: the algorithm's).
        outer_device: where DiLoCo keeps its outer state (`--outer-state cpu`; None: with the model).
        ranks: this peer's data-parallel ranks, of which this trainer is rank 0 (shoal.peer.train.ranks: the
            others compute its micro-batches with it, and it alone steps); None: one process. A step
            across ranks is not cut short by the compute window, and out of memory is not recovered.
        loss_scale: fp16's dynamic loss scaling (shoal.peer.train.hardware.LossScale; None: no scaling).
    """

    def __init__(
        self,
        model: nn.Module,
        exchange: Exchange,
        *,
        algorithm: AlgorithmConfig,
        batches: Batches,
        codec: Codec | None = None,
        checkpoints: CheckpointStore | None = None,
        checkpoint_every: int = 0,
        loss_fn: LossFn = model_loss,
        batch_size: int = 8,
        compute_window: float | None = None,
        max_micro_batches: int = 64,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        schedule: Schedule | None = None,
        grad_clip: float = 0.0,
        weight_decay: float | None = None,
        outer_device: torch.device | str | None = None,
        ranks: "LocalRanks | None" = None,
        loss_scale: LossScale | None = None,
        ledger: TokenLedger | None = None,
    ):
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if batch_size < 1 or max_micro_batches < 1:
            raise ValueError(f"batch_size ({batch_size}) and max_micro_batches must be >= 1")
        if compute_window is not None and not compute_window > 0:
            raise ValueError(f"compute_window must be > 0 seconds, got {compute_window}")
        self.model, self.exchange, self.algorithm, self.batches = model, exchange, algorithm, batches
        self.ledger = ledger
        """A swarm's token ledger (shoal.peer.data.ledger), kept in its checkpoints."""
        self.checkpoints, self.checkpoint_every = checkpoints, checkpoint_every
        self.loss_fn, self.autocast = loss_fn, autocast
        self.batch_size, self.compute_window, self.max_micro_batches = (
            batch_size,
            compute_window,
            max_micro_batches,
        )
        self.micro_batches = 1
        """Micro-batches accumulated per optimizer step, fitted to the compute window."""
        self.out_of_memory = 0
        """Times the micro-batch was halved after the device ran out of memory."""
        self.cut_short = 0
        """Steps whose accumulation stopped early, past their share of the compute window."""
        self._credited_before: set[str] = set()  # the credited peers of the checkpoint resumed from
        self.stop: StopRequest | None = None
        """The peer's stop, if any: an urgent one (a second signal) ends a step's accumulation."""
        self._micro_seconds: float | None = None  # moving average of one micro-batch's compute time
        self.steps = 0
        """Optimizer steps taken; every round takes `inner_steps` of them."""
        self.sync = synchronizer(model, exchange, algorithm, codec, weight_decay, outer_device)
        self.schedule, self.grad_clip = schedule, grad_clip
        if schedule is not None:  # a round's rate, for a replay of it (DeMo steps once a round)
            self.sync.set_schedule(functools.partial(schedule.lr, algorithm.lr))
        if ranks is not None and max_micro_batches < ranks.world:
            raise ValueError(
                f"--max-micro-batches {max_micro_batches} with --nproc-per-node {ranks.world}: each rank "
                "computes at least one micro-batch a step; at least as many as ranks"
            )
        self.ranks, self.loss_scale = ranks, loss_scale
        self.lr = algorithm.lr
        """The learning rate of the last step."""
        """The algorithm over the exchange (shoal.peer.algorithms.synchronizer)."""

    @property
    def inner_steps(self) -> int:
        """Optimizer steps a round (the synchronizer's: DiLoCo's H, DeMo's 1)."""
        return self.sync.inner_steps

    @property
    def rounds_done(self) -> int:
        return self.steps // self.inner_steps

    def run(self, rounds: int, stop: StopRequest | None = None) -> list[RoundReport]:
        """Trains `rounds` rounds, or until `stop` is set (then checkpoints and returns early): the loop
        of a trainer on its own (tests, a torch.distributed job). A swarm peer drives `round` and
        `end_round` itself, round by round (shoal.peer.job.runtime.SwarmPeer.rounds)."""
        reports = []
        for _ in range(rounds):
            reports.append(self.round())
            stopping = stop is not None and stop.is_set()
            self.end_round(stopping)
            if stopping:
                break
        return reports

    def end_round(self, stopping: bool) -> None:
        """After a round: a checkpoint every `checkpoint_every` rounds, and when a stop was asked for."""
        due = self.checkpoint_every and self.rounds_done % self.checkpoint_every == 0
        if self.checkpoints is not None and (stopping or due):
            self.save()

    def round(self, number: int | None = None, *, plan: Plan | None = None) -> RoundReport:
        """One round: `inner_steps` steps, the last exchanging. `number`: the round it computes for,
        as its report says (None: the rounds this trainer has done); `plan`: the exchange's plan of
        that round (a swarm peer's RoundPlan), handed to it with the round's payload."""
        phases = cast("dict[str, float]", Counter())  # a Counter of seconds (its update adds)
        before = Counter(self.sync.phase_seconds)
        samples = tokens = 0
        loss_sum = 0.0
        micro_batches, done = self.micro_batches, 0
        # every rank computes the micro-batches rank 0 announced: no window of its own
        window_end = None
        if self.compute_window is not None and self.ranks is None:
            window_end = time.perf_counter() + self.compute_window
        first = self.rounds_done if number is None else number  # the swarm's round, for the schedule
        for inner in range(self.inner_steps):
            start = time.perf_counter()
            step_micro, budget = micro_batches, None
            if window_end is not None:
                # the window's time left, shared among the steps left: a step that ran slow leaves the
                # next ones fewer micro-batches. One that goes past its share of the window stops
                # accumulating (the device slowed down: another process, thermal throttling), so that
                # the payload still makes the round's deadline
                budget = (window_end - start) / (self.inner_steps - inner)
                step_micro = self._micro_batches_within(budget)
            loss, step_samples, step_tokens, step_micro = self._accumulate(step_micro, budget, plan)
            done += step_micro
            if self.loss_scale is not None:
                self.loss_scale.unscale(list(self.model.parameters()))
            self._prepare_step(first + inner / self.inner_steps)
            middle = time.perf_counter()
            self.sync.step(samples=step_samples, plan=plan)
            end = time.perf_counter()
            phases["compute"] += middle - start
            # DiLoCo's inner optimizer steps count as computation; its last one also exchanges
            if (self.steps + 1) % self.inner_steps != 0:
                phases["compute"] += end - middle
            self.steps += 1
            samples += step_samples
            tokens += step_tokens
            loss_sum += loss
        self._fit_window(phases["compute"] / done)
        phases.update({k: v - before[k] for k, v in self.sync.phase_seconds.items()})
        return RoundReport(
            round=self.rounds_done - 1 if number is None else number,
            loss=loss_sum / self.inner_steps,
            participants=self.exchange.world_size,
            samples=samples,
            finished_at=time.time(),
            tokens=tokens,
            micro_batches=done // self.inner_steps,
            batch_size=self.batch_size,
            phases={k: phases[k] for k in PHASES},
            lr=self.lr,
        )

    def _prepare_step(self, position: float) -> None:
        """Before an optimizer step: the schedule's learning rate at `position` (the swarm's round and
        the step's share of it), and the gradient clipped (no host sync: torch scales by a tensor)."""
        if self.schedule is not None:
            self.lr = self.schedule.lr(self.algorithm.lr, position)
            self.sync.set_lr(self.lr)
        if self.grad_clip:
            grads = [p for p in self.model.parameters() if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(grads, self.grad_clip, foreach=True)

    def _accumulate(
        self, micro_batches: int, budget: float | None = None, plan: Plan | None = None
    ) -> tuple[float, int, int, int]:
        """Forward and backward over the step's micro-batches, or those done when `budget` seconds have
        passed (at least one; the gradient is then scaled to their mean, counted in `cut_short`); on
        out-of-memory, halves the micro-batch and starts the step's accumulation over. Returns (mean
        loss, samples, tokens, micro-batches done); the loss is read from the device once per step."""
        if self.ranks is not None:
            return self._accumulate_across_ranks(micro_batches, plan)
        while True:
            try:
                total = None
                samples = tokens = 0
                started = time.perf_counter()
                for micro in range(micro_batches):
                    inputs, targets = self.batches(self.steps, micro, self.batch_size, plan)
                    with self.autocast():
                        loss = self.loss_fn(self.model, inputs, targets)
                    (loss * (self._scale / micro_batches)).backward()
                    # summed in fp32 whatever the autocast's dtype: thousands of bf16 additions lose the sum
                    step_loss = loss.detach().float()
                    total = step_loss if total is None else total + step_loss
                    samples += inputs.shape[0]
                    tokens += targets.numel()
                    done = micro + 1
                    late = budget is not None and time.perf_counter() - started > budget
                    if done < micro_batches and (late or (self.stop is not None and self.stop.urgent)):
                        for p in self.model.parameters():
                            if p.grad is not None:
                                p.grad.mul_(micro_batches / done)
                        self.cut_short += 1
                        break
                # micro_batches >= 1: a loss was summed
                return cast(torch.Tensor, total).item() / done, samples, tokens, done
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                self._recover_from_oom(error)

    def _accumulate_across_ranks(self, micro_batches: int, plan: Plan | None) -> tuple[float, int, int, int]:
        """`_accumulate` across the peer's ranks (shoal.peer.train.ranks): rank 0's parameters broadcast, the
        m-th micro-batch of rank r drawn as the peer's m N + r-th, the gradients averaged. Counts the
        samples and tokens of every rank; the loss is rank 0's."""
        ranks, total, samples, tokens = self.ranks, None, 0, 0
        assert ranks is not None  # `_accumulate` comes here only with ranks
        for micro in range(micro_batches):
            drawn = [
                self.batches(self.steps, micro * ranks.world + rank, self.batch_size, plan)
                for rank in range(ranks.world)
            ]
            if micro == 0:
                ranks.announce(micro_batches, self.batch_size, drawn[0][0].shape[1], self._scale)
                ranks.broadcast_parameters(self.model)
            inputs, targets = ranks.share(drawn, tuple(drawn[0][0].shape))
            with self.autocast():
                loss = self.loss_fn(self.model, inputs, targets)
            (loss * (self._scale / micro_batches)).backward()
            step_loss = loss.detach().float()
            total = step_loss if total is None else total + step_loss
            samples += sum(x.shape[0] for x, _ in drawn)
            tokens += sum(y.numel() for _, y in drawn)
        ranks.reduce_gradients(self.model)
        return cast(torch.Tensor, total).item() / micro_batches, samples, tokens, micro_batches

    @property
    def _scale(self) -> float:
        return 1.0 if self.loss_scale is None else self.loss_scale.scale

    def _recover_from_oom(self, error: BaseException) -> None:
        for p in self.model.parameters():
            p.grad = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.batch_size == 1:
            raise OutOfMemory(
                "the model does not fit in the device's memory even with one sample per micro-batch: "
                f"choose a smaller --model or another --device ({error})"
            ) from None
        self.batch_size //= 2
        self.out_of_memory += 1

    def set_compute_window(self, seconds: float) -> None:
        """Fills the next rounds' computation to `seconds` (a coordinator's deadline, scaled)."""
        self.compute_window = max(seconds, 1e-3)
        self._refit()

    def expect_pace(self, micro_seconds: float) -> None:
        """Fills the first round's window at `micro_seconds` a micro-batch, measured before training (the
        fit's warmed-up dry run), instead of computing one micro-batch to learn the pace: a pace learned
        from that one (a warm-up, several times slower than the steps after it) took rounds of averaging
        to fill the window. A pace already measured is kept."""
        if micro_seconds > 0 and self._micro_seconds is None:
            self._micro_seconds = micro_seconds
            self._refit()

    def _fit_window(self, micro_seconds: float) -> None:
        """Sets the micro-batches per step so that a round's computation fills the compute window."""
        if self.compute_window is None or micro_seconds <= 0:
            return
        average = self._micro_seconds
        self._micro_seconds = micro_seconds if average is None else 0.5 * (average + micro_seconds)
        self._refit()

    def _refit(self) -> None:
        if self.compute_window is not None and self._micro_seconds is not None:
            self.micro_batches = self._micro_batches_within(self.compute_window / self.inner_steps)

    @property
    def _most_micro_batches(self) -> int:
        return self.max_micro_batches // (1 if self.ranks is None else self.ranks.world)

    def _micro_batches_within(self, seconds: float) -> int:
        """The micro-batches of a step that has `seconds` of the window (at least one): as many as the
        measured pace fits, so that the remainder of a window divided among DiLoCo's H steps is not
        lost (H = 10 in a window of 15 micro-batches would otherwise compute 10)."""
        if self._micro_seconds is None:
            return self.micro_batches
        return max(1, min(self._most_micro_batches, math.floor(seconds / self._micro_seconds)))

    def finish(self) -> None:
        """Ends training: an overlapped algorithm applies the round still in flight; every peer lands
        on the shared state."""
        self.sync.finish()

    def close(self) -> None:
        self.sync.close()
        if self.ranks is not None:
            self.ranks.close()

    def shared_state(self) -> list[torch.Tensor]:
        """What every peer of the swarm holds alike (Synchronizer.shared_state)."""
        return self.sync.shared_state()

    def load_shared_state(self, tensors: list[torch.Tensor]) -> None:
        """Takes the swarm's shared state (same order and shapes as `shared_state`)."""
        self.sync.load_shared_state(tensors)

    def state_dict(self) -> dict:
        """Tensors and plain values only (a checkpoint: shoal.peer.checkpoint.encode)."""
        synchronizing = self.sync.state_dict()  # first: it undoes DeMo's lookahead shift of the model
        model = self.model.state_dict()
        state = {"steps": self.steps, "algorithm": self.algorithm.name, "model": model, **synchronizing}
        tokens = self.ledger
        if tokens is not None:
            state["token_ledger"] = torch.frombuffer(bytearray(tokens.to_bytes()), dtype=torch.uint8)
            state["tokens_consumed"] = tokens.progress()[2] * tokens.seq_len  # provenance (shoal export)
            # by the peer ids peers print; those credited before a restart, from its checkpoint
            state["credited_peers"] = sorted(set(tokens.credited_peers()) | self._credited_before)
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("algorithm") != self.algorithm.name:
            raise ValueError(
                f"checkpoint of {state.get('algorithm')!r}, this peer runs {self.algorithm.name!r}"
            )
        self.model.load_state_dict(state["model"])
        self.sync.load_state_dict(state)
        self._credited_before = {str(peer) for peer in state.get("credited_peers", [])}
        self.steps = int(state["steps"])
        tokens = self.ledger
        if tokens is not None and "token_ledger" in state:
            tokens.load(state["token_ledger"].numpy().tobytes())

    def save(self) -> None:
        if self.checkpoints is not None:
            round_number = self.exchange.last_round
            self.checkpoints.save(
                self.rounds_done if round_number is None else round_number, self.state_dict()
            )

    def resume(self) -> bool:
        """Loads the newest checkpoint, if there is one."""
        state = self.checkpoints.load_latest() if self.checkpoints is not None else None
        if state is None:
            return False
        self.load_state_dict(state)
        return True
