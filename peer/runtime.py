"""The round loop of one peer, with checkpoints and a clean stop.

Each round: compute (forward and backward on this peer's batches), then the optimizer's step, which
encodes, exchanges, decodes and applies (DeMo: one step per round; DiLoCo: `inner_steps` inner
steps, the last one ending in the outer step). Each phase is timed into a `RoundReport`.

Checkpoints (shoal.peer.checkpoint) are written every `checkpoint_every` rounds and when a stop is
asked for (`stop_on_signals`: SIGTERM or SIGINT set an event that the loop checks after each round,
so the peer leaves at a round boundary, with a checkpoint, within one round). `resume()` loads the
newest one; the exchange then re-syncs the peer if the swarm moved on meanwhile.
"""

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from shoal.compression import Codec
from shoal.peer.checkpoint import CheckpointStore
from shoal.peer.demo import DeMo
from shoal.peer.diloco import DiLoCo
from shoal.peer.exchange import Exchange

ALGORITHMS = ("demo", "diloco-standard", "diloco-delayed", "diloco-eager")

Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""batches(step) -> (inputs, targets) of this peer's step-th micro-batch."""


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one round did on this peer."""

    round: int
    """The swarm's round number (the exchange's), or the local count for exchanges without one."""
    loss: float
    """Training loss of the round's last micro-batch."""
    participants: int
    """Contributions aggregated in the round (the exchange's world size after it)."""
    compute_s: float
    """Forward and backward passes (and DiLoCo's inner optimizer steps)."""
    exchange_s: float
    """The optimizer step that communicates: encode, exchange, decode, apply."""
    samples: int
    finished_at: float
    """Unix time the round ended on this peer (compare with the schedule's deadline)."""


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (from the main thread only): a stop at the next round end."""
    stop = threading.Event()

    def handler(signum: int, _frame) -> None:
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)
    return stop


class Trainer:
    """One peer's training: the model, its optimizer over `exchange`, and the loop.

    Args:
        model: a module whose `forward(inputs, targets=...)` returns the loss.
        exchange: how this peer meets the others.
        algorithm: one of ALGORITHMS.
        batches: this peer's micro-batches, by step.
        lr: DeMo's learning rate, or the inner AdamW's for DiLoCo.
        topk: DeMo's coefficients per chunk.
        inner_steps: DiLoCo's H.
        outer_lr: DiLoCo's outer learning rate.
        codec: how DiLoCo's pseudo-gradients travel (None: exactly).
        checkpoints: where to keep checkpoints (None: nowhere).
        checkpoint_every: rounds between checkpoints (0: only on stop).
    """

    def __init__(
        self,
        model: nn.Module,
        exchange: Exchange,
        *,
        algorithm: str,
        batches: Batches,
        lr: float = 2e-3,
        topk: int = 32,
        inner_steps: int = 5,
        outer_lr: float = 0.4,
        codec: Codec | None = None,
        checkpoints: CheckpointStore | None = None,
        checkpoint_every: int = 0,
    ):
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        self.model, self.exchange, self.algorithm, self.batches = model, exchange, algorithm, batches
        self.checkpoints, self.checkpoint_every = checkpoints, checkpoint_every
        self.steps = 0
        """Micro-batches trained; every round trains `inner_steps` of them."""
        if algorithm == "demo":
            self.optimizer = DeMo(model.parameters(), lr=lr, exchange=exchange, compression_topk=topk)
            self.inner_steps = 1
            self.diloco = None
        else:
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
            self.inner_steps = inner_steps
            self.diloco = DiLoCo(
                model,
                self.optimizer,
                exchange=exchange,
                inner_steps=inner_steps,
                mode=algorithm.removeprefix("diloco-"),
                outer_lr=outer_lr,
                codec=codec,
            )

    @property
    def rounds_done(self) -> int:
        return self.steps // self.inner_steps

    def run(self, rounds: int, stop: threading.Event | None = None) -> list[RoundReport]:
        """Trains `rounds` rounds, or until `stop` is set (then checkpoints and returns early)."""
        reports = []
        for _ in range(rounds):
            reports.append(self.round())
            stopping = stop is not None and stop.is_set()
            if self.checkpoints is not None and (
                stopping or (self.checkpoint_every and self.rounds_done % self.checkpoint_every == 0)
            ):
                self.save()
            if stopping:
                break
        return reports

    def round(self) -> RoundReport:
        compute_s = exchange_s = 0.0
        samples = 0
        for _ in range(self.inner_steps):
            start = time.perf_counter()
            inputs, targets = self.batches(self.steps)
            loss = self.model(inputs, targets=targets)
            loss.backward()
            middle = time.perf_counter()
            if self.diloco is None:
                self.optimizer.step(samples=inputs.shape[0])
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.diloco.step(samples=inputs.shape[0])
            end = time.perf_counter()
            compute_s += middle - start
            # DiLoCo's inner steps compute; its last one also exchanges
            if self.diloco is None or (self.steps + 1) % self.inner_steps == 0:
                exchange_s += end - middle
            else:
                compute_s += end - middle
            self.steps += 1
            samples += inputs.shape[0]
        last_round = getattr(self.exchange, "last_round", None)
        return RoundReport(
            round=self.rounds_done - 1 if last_round is None else last_round,
            loss=loss.item(),
            participants=self.exchange.world_size,
            compute_s=compute_s,
            exchange_s=exchange_s,
            samples=samples,
            finished_at=time.time(),
        )

    def finish(self) -> None:
        """Ends training: DiLoCo applies the round still in flight; every peer lands on the shared state."""
        if self.diloco is not None:
            self.diloco.finish()

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.close()

    def state_dict(self) -> dict:
        """Tensors and plain values only (loadable with weights_only=True)."""
        state = {"steps": self.steps, "algorithm": self.algorithm}
        state["model"] = self.model.state_dict()
        state["optimizer"] = self.optimizer.state_dict()
        if self.diloco is not None:
            state["shared"] = [t.detach().clone() for t in self.diloco.shared_state()]
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("algorithm") != self.algorithm:
            raise ValueError(f"checkpoint of {state.get('algorithm')!r}, this peer runs {self.algorithm!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.diloco is not None:
            self.diloco.load_shared_state(state["shared"])
        self.steps = int(state["steps"])

    def save(self) -> None:
        if self.checkpoints is not None:
            round_number = getattr(self.exchange, "last_round", None)
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
