"""The failure injector of the swarm integration tests: peer i exits, hangs or lies at round r.

A fault is `KIND@ROUND`, given to a test peer (tests/integration/swarm_peer.py) as `--fault`:

- `exit@r`: the peer kills itself (-9) as its computation for swarm round r starts: a crash, or a
  volunteer's machine switched off. Its DHT record outlives it for a few rounds.
- `hang@r`: it stops itself (SIGSTOP) there: the training process freezes, while its DHT process and
  libp2p daemon, separate processes, go on answering: a peer that is there and never delivers. The
  test's clean-up kills it.
- `lie@r`: from round r on, every payload it sends has its values' signs flipped, well-formed
  (shoal.peer.bench.hostile.poison): a peer that poisons the run.
- `vanish@r`: in the first round from r in which a bounded fan-in (`--gather`) will choose it (it
  predicts the rotation from the last round's candidates), it announces its payload and kills itself
  (-9) before anyone can pull it: a chosen peer that vanishes.

    planned = inject(faults, exchange)   # SwarmPeer.rounds(planned=...) calls it before each round
"""

import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shoal.peer.bench import hostile
from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.records import RoundPlan
from shoal.protocol.rules import choose

KINDS = ("exit", "hang", "lie", "vanish")


@dataclass(frozen=True)
class Fault:
    kind: str
    round: int

    @staticmethod
    def parse(text: str) -> "Fault":
        kind, _, number = text.partition("@")
        if kind not in KINDS or not number.isdigit():
            raise ValueError(f"a fault is KIND@ROUND with KIND one of {', '.join(KINDS)}, not {text!r}")
        return Fault(kind, int(number))


class LyingExchange(SwarmExchange):
    """A SwarmExchange that flips the signs of what it sends once `lying` is set (by `inject`)."""

    lying = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._generator = torch.Generator().manual_seed(11)

    def gather(self, payload, samples, state=None, plan=None):
        if self.lying:
            payload = hostile.poison(payload, "sign_flip", self._generator)
        return super().gather(payload, samples, state, plan)


class VanishingExchange(SwarmExchange):
    """A SwarmExchange that dies right after announcing its payload of the first round from `vanish_at`
    in which the fan-in's rotation chooses it (shoal.protocol.rules), as predicted from the
    candidates of the round before."""

    vanish_at: int | None = None
    candidates: frozenset[bytes] = frozenset()

    def _chosen(self, round_number, announced):
        self.candidates = frozenset(announced)
        return super()._chosen(round_number, announced)

    def _vanishes(self, round_number: int) -> bool:
        if self.vanish_at is None or round_number < self.vanish_at:
            return False
        return self.owner in choose(self.run.encode(), round_number, self.candidates, self.gather_limit)

    async def _announce(self, round_number, mine):
        vanishing = self._vanishes(round_number)
        if vanishing:
            # it serves nothing from here on: the DHT store returns once every replica acknowledged
            # it, so a quick peer that read the announcement from the first one could otherwise pull
            # the payload before the kill (the likely cause of a CI run whose round 5 counted 2)
            self.server.held.pop((round_number, mine.digest), None)
        await super()._announce(round_number, mine)
        if vanishing:
            os.kill(os.getpid(), signal.SIGKILL)


def exchange_type(faults: Sequence[Fault]) -> type[SwarmExchange]:
    """The exchange a peer with `faults` needs."""
    kinds = {fault.kind for fault in faults}
    return LyingExchange if "lie" in kinds else VanishingExchange if "vanish" in kinds else SwarmExchange


def inject(faults: Sequence[Fault], exchange: SwarmExchange) -> Callable[[RoundPlan], None]:
    """The hook that carries out `faults` as each round's computation starts."""

    def planned(plan: RoundPlan) -> None:
        for fault in faults:
            if fault.kind == "lie" and plan.round >= fault.round:
                exchange.lying = True
            elif plan.round == fault.round and fault.kind == "exit":
                os.kill(os.getpid(), signal.SIGKILL)
            elif plan.round == fault.round and fault.kind == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.kind == "vanish":
                exchange.vanish_at = fault.round

    return planned
