"""The one failure injector of the integration tests: named faults, each from a given round, `KIND@ROUND`.

A test peer (tests/integration/swarm_peer.py) takes them as `--fault KIND@ROUND` (repeatable); a real
`shoal join` reads them from the environment, this module being its registry (shoal.peer.job.faults):

    SHOAL_FAULTS="tests.integration.faults:sign_flip@0" shoal join ARGS...

Either way they reach `build_peer` as a `Faults` value whose exchange is a `FaultyExchange`
(`exchange_type(faults)`): the peer trains honestly, and the exchange carries the faults out from the
round it plans (`plan_round`).

The process:
- `exit@r`: the peer kills itself (-9) as round r's computation starts: a crash, a machine switched off.
- `hang@r`: it stops itself (SIGSTOP) there: the training process freezes, while its DHT process and
  libp2p daemon, separate processes, go on answering: a peer that is there and never delivers.
- `vanish@r`: in the first round from r in which a bounded fan-in (`--gather`) chooses it (predicted
  from the last round's candidates, shoal.protocol.rules), it announces its payload and kills itself
  before anyone can pull it: a chosen peer that vanishes.

What it sends, well-formed (shoal.peer.bench.hostile.poison), from round r on:
- `lie@r` or `sign_flip@r`: its update's signs flipped at the largest scale the defences allow;
  `random@r`: a random direction; `topk@r`: 4x the run's top-k (a config_mismatch);
- `sample_lie@r`: a sign flip claiming 2^40 samples;
- `alie@r`: "a little is enough" (Baruch et al., 2019): its own update plus its own norm along one
  fixed direction, every round (inside the honest spread of cosines);
- `collude@r`: colluders, one adversary's several peers (`SHOAL_COLLUSION=FOLDER:INDEX`): each round
  the leader (index 0) leaves its honest payload in FOLDER, and every member sends that update
  negated at `COLLUDE_SCALE` times its norm, member k at (1 + k/256) times that, so that no two are
  the same bytes (a copy counts once); a member that does not find the leader's within
  `COLLUDE_WAIT_S` flips its own (one that does leaves `ROUND.INDEX` there);
- `claim_and_stale_digest@r`: its honest payload claiming 2^40 samples, announced with a random digest
  of the state it was computed on;
- `unserved_and_replay@r`: one round in two it announces its payload and answers every pull with
  nothing, the other it sends its first payload again with an unknown protobuf field appended (new
  bytes, old content);
- `attacks@r`: one malformed payload a round (ATTACKS: a tensor missing, NaNs, oversized, zeros served
  for the announced bytes, a replay), then honest ones; it keeps the swarm's state by aggregating only
  the others' payloads, as they do once they drop its own.

What it claims: `claim_reachable@r`: its record says it can be dialed, whatever its relays found
(from the start, whatever r). `sybil@r`: one of many free identities that hold one poisoned state
(`SYBIL_SEED`'s noise, the same on every Sybil, the token ledger's view as it was in its first round),
never update it, claim to be in sync on it every round and serve it; each trains on its own lanes, so
that its payloads are its own.

What it serves: `butterfly_lie@r`: garbage for the mean of the piece it owns in butterfly rounds
(shoal.peer.algorithms.butterfly), its cuts of its own payload honest.
"""

import dataclasses
import hashlib
import os
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import zstandard

from shoal.peer.bench import hostile
from shoal.peer.job.faults import Faults
from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.server import PayloadServer
from shoal.peer.swarm.stages import RoundStages
from shoal.peer.swarm.state import StateSnapshot
from shoal.protocol import Payload
from shoal.protocol.rules import choose

POISONED = {
    "lie": "sign_flip",
    "sign_flip": "sign_flip",
    "random": "random",
    "topk": "topk",
    "sample_lie": "sign_flip",  # and 2^40 samples claimed
    "alie": "alie",  # "a little is enough": its update plus its own norm along one fixed direction
}
"""Faults that rewrite every payload with shoal.peer.bench.hostile.poison, and the attack each is."""
KINDS = (
    "exit",
    "hang",
    "vanish",
    *POISONED,
    "collude",
    "claim_and_stale_digest",
    "unserved_and_replay",
    "attacks",
    "claim_reachable",
    "sybil",
    "butterfly_lie",
)
ATTACKS = ("wrong_shape", "nan", "oversized", "digest", "replay")
"""`attacks@r`: one a round, in this order, from round r."""
COLLUDE_WAIT_S = 1.0
"""How long a colluder waits for its leader's payload (they finish a round's computation together)."""
OVERSIZED_BYTES = 1 << 20
"""What `oversized` appends: past the 1 MiB payload limit of the test peers."""
SYBIL_SEED = 1234
"""`sybil`: the seed of the poisoned state every Sybil holds."""


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

    @staticmethod
    def parse_all(text: str) -> tuple["Fault", ...]:
        """Faults separated by spaces or commas (SHOAL_FAULTS)."""
        return tuple(Fault.parse(item) for item in text.replace(",", " ").split())


class FaultyServer(PayloadServer):
    """Serves what the exchange's faults say: nothing for an unserved payload, zeros in place of the
    bytes while `zeroing`, garbage for a butterfly piece's mean while `lying_pieces`."""

    unserved: set[bytes]
    zeroing = False
    lying_pieces = False

    async def serve(self, request, context):
        if request.digest in self.unserved:
            return  # an empty answer: "I hold nothing"
        async for chunk in super().serve(request, context):
            if self.zeroing:
                chunk.data = bytes(len(chunk.data))
            yield chunk

    async def piece(self, request, context) -> bytes:
        data = await super().piece(request, context)
        return b"\xff" * len(data) if self.lying_pieces and request.reduced and data else data


class FaultyStages(RoundStages):
    """Announces as its exchange's faults say (`peer`): with a random state digest
    (`claim_and_stale_digest`), or its payload and then its end (`vanish`)."""

    peer: "FaultyExchange"
    candidates: frozenset[bytes] = frozenset()
    """The announcers of the last round the fan-in chose among (those on the majority's state)."""

    async def hold(self, number, payload, samples, snapshot, schedule, *, coordinated=False):
        if self.peer.active("sybil") and snapshot is not None:
            snapshot = self.peer.poisoned(snapshot[1], number)
            self.standing.synced = True  # whatever its last round said
        return await super().hold(number, payload, samples, snapshot, schedule, coordinated=coordinated)

    def chosen(self, number, announced):
        self.candidates = frozenset(self.eligible(announced) if self.limits.gather_limit else announced)
        return super().chosen(number, announced)

    async def announce(self, number, mine, schedule):
        vanishing = self._vanishes(number)
        if vanishing:
            # it serves nothing from here on: the DHT store returns once every replica acknowledged it,
            # so a quick peer that read the announcement from the first one could otherwise pull the
            # payload before the kill
            self.server.held.pop((number, mine.digest), None)
        if self.peer.active("claim_and_stale_digest") and mine.state:
            mine = dataclasses.replace(mine, state=os.urandom(len(mine.state)))
        await super().announce(number, mine, schedule)
        if vanishing:
            os.kill(os.getpid(), signal.SIGKILL)

    def _vanishes(self, number: int) -> bool:
        fault = self.peer.active("vanish")
        if fault is None or number < fault.round:
            return False
        return self.owner in choose(self.run.encode(), number, self.candidates, self.limits.gather_limit)


class FaultyExchange(SwarmExchange):
    """A SwarmExchange that carries out `faults` (set on the subclass `exchange_type` makes)."""

    faults: tuple[Fault, ...] = ()
    server_type = FaultyServer
    stages_type = FaultyStages

    def __init__(self, *args, **kwargs):
        if any(f.kind == "claim_reachable" for f in self.faults):
            kwargs["reachability"] = dataclasses.replace(kwargs["reachability"], reachable=True)
        super().__init__(*args, **kwargs)
        self.stages.peer = self
        self.server.unserved = set()
        self.now = -1  # the round planned last
        self.generator = torch.Generator().manual_seed(7)
        self.sent: list[bytes] = []  # unserved_and_replay: the payloads since its round
        self.honest = b""  # attacks: its first payload from its round, honest, replayed later
        self.attacked = 0  # attacks: payloads since its round
        self.poison: list[torch.Tensor] | None = None  # sybil: the state it holds

    def poisoned(self, state: list[torch.Tensor], number: int) -> tuple[StateSnapshot, list[torch.Tensor]]:
        """`sybil`: its poisoned state, captured for round `number`."""
        if self.poison is None:
            generator = torch.Generator().manual_seed(SYBIL_SEED)
            ledgered = self.tokens is not None  # the last tensor is the token ledger's view: kept
            model = state[:-1] if ledgered else state
            self.poison = [torch.randn(t.shape, generator=generator) for t in model]
            self.poison += [t.clone() for t in state[len(model) :]]
        return StateSnapshot.capture(self.poison, number), self.poison

    def active(self, kind: str) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and self.now >= f.round), None)

    def plan_round(self, last_round=None):
        plan = super().plan_round(last_round)
        if plan is not None:
            self.now = plan.round
            for fault in self.faults:
                if fault.round == plan.round and fault.kind in ("exit", "hang"):
                    os.kill(os.getpid(), signal.SIGKILL if fault.kind == "exit" else signal.SIGSTOP)
            self.server.lying_pieces = self.active("butterfly_lie") is not None
        return plan

    def gather(self, payload, samples, state=None, plan=None):
        for kind, attack in POISONED.items():
            if self.active(kind):
                payload = hostile.poison(payload, attack, self.generator)
        if self.active("collude"):
            payload = self._colluded(payload)
        if self.active("sample_lie") or self.active("claim_and_stale_digest"):
            samples = hostile.LIED_SAMPLES
        lane = getattr(plan, "lane", None)
        if self.active("unserved_and_replay"):
            payload = self._unserved_or_replayed(payload, b"" if lane is None else lane.claim_bytes())
        attack = self._attack(payload + (b"" if lane is None else lane.claim_bytes()))
        self.server.zeroing = attack == "digest"
        if attack is not None:
            payload = self._malformed(payload, attack)
        if attack == "replay":  # its first payload's very bytes, claim included: no claim of this round
            plan = dataclasses.replace(plan, lane=None)
        gathered = super().gather(payload, samples, state, plan)
        if self.attacked > 1:  # past its honest first payload: the others' alone
            if self.tokens is not None:  # and its token ledger, like theirs, leaves its claim out
                self.tokens.reject(gathered.round, self.owner)
            return gathered.only(c for c in gathered if c.sender != self.owner)
        return gathered

    def _colluded(self, payload: bytes) -> bytes:
        """`collude`: the leader's update of this round flipped, at this member's scale."""
        folder, _, index = os.environ["SHOAL_COLLUSION"].rpartition(":")
        member = int(index)
        shared = Path(folder) / f"{self.now}.payload"
        if member == 0:
            partial = shared.with_suffix(".partial")
            partial.write_bytes(payload)
            partial.rename(shared)  # whole or not at all
        else:
            deadline = time.monotonic() + COLLUDE_WAIT_S
            while not shared.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            if shared.exists():
                payload = shared.read_bytes()
                shared.with_suffix(f".{member}").touch()  # it did: the run can count the rounds
        scale = hostile.COLLUDE_SCALE * (1 + member / 256)
        return hostile.poison(payload, "collude", self.generator, scale=scale)

    def _unserved_or_replayed(self, payload: bytes, claim: bytes) -> bytes:
        """`claim`: what the exchange appends to the payload, and so to what it announces."""
        self.sent.append(payload)
        if len(self.sent) % 2 == 0:
            self.server.unserved.add(hashlib.sha256(payload + claim).digest())
            return payload
        if len(self.sent) > 1:  # the first again, with field 127 (not in payload.proto): new bytes
            return self.sent[0] + b"\xf8\x07" + bytes([len(self.sent) % 128])
        return payload

    def _attack(self, payload: bytes) -> str | None:
        """`attacks@r`: the attack of this round (None: honest), the first payload from r honest."""
        if not self.active("attacks"):
            return None
        self.attacked += 1
        self.honest = self.honest or payload
        index = self.attacked - 2
        return ATTACKS[index] if 0 <= index < len(ATTACKS) else None

    def _malformed(self, payload: bytes, attack: str) -> bytes:
        message = Payload.FromString(payload)
        if attack == "wrong_shape":
            del message.tensors[-1]
        elif attack == "nan":
            for tensor in message.tensors:  # DeMo sends float32 values: as many NaNs, raw
                raw = zstandard.decompress(tensor.values) if tensor.values_zstd else tensor.values
                tensor.values = torch.full((len(raw) // 4,), float("nan")).numpy().tobytes()
                tensor.values_zstd = False
        elif attack == "oversized":
            return payload + bytes(OVERSIZED_BYTES)
        elif attack == "replay":  # as sent, with the claim the exchange appended
            return self.honest
        else:
            return payload
        return message.SerializeToString()


def exchange_type(faults: Iterable[Fault]) -> type[SwarmExchange]:
    """The exchange a peer with `faults` runs (none: the honest SwarmExchange)."""
    faults = tuple(faults)
    if not faults:
        return SwarmExchange
    return type("FaultyExchange", (FaultyExchange,), {"faults": faults})


def gone(faults: Sequence[Fault]) -> bool:
    """Whether the faults end the peer's process before its run does."""
    return any(f.kind in ("exit", "hang", "vanish") for f in faults)


def faults(spec: str) -> Faults:
    """The registry `shoal join` reads (shoal.peer.job.faults): `SHOAL_FAULTS=tests.integration.faults:SPEC`,
    SPEC the faults `KIND@ROUND ...`; ValueError naming what it cannot parse."""
    return Faults(exchange_type=exchange_type(Fault.parse_all(spec)))
