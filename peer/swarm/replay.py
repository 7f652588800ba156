"""Catch-up by replay: a peer one or a few rounds behind the swarm's state rebuilds it from a state it
still holds and the payloads that counted since, instead of downloading the whole state.

Every peer in sync records the step each of its rounds took (`Step`: the digest of the state the round
was applied to, and its counted payloads, content-addressed) against the state it led to, for the last
`KEEP_STEPS` rounds, and keeps the payloads as long (shoal.peer.swarm.server). A peer whose state is
not the majority's asks a holder of the majority's state for the steps that led there (`StateSteps`),
finds the newest state on that path it holds itself (`plan_replay`), and, when the payloads it lacks weigh
less than the state, pulls them and applies the steps with its optimizer's own transition
(`Exchange.replay`). The result must have the majority's digest: anything else (a device that computes
the step otherwise, a source that lied about the steps) falls back to the download, and says so.

Why K = 4: a payload that came late costs one step, and a peer paused for a few rounds (a laptop lid,
a long stall, a brief loss of its link) needs as many steps as rounds passed; past that, the payloads
of every round since, from every participant, soon outweigh one state. Each kept round holds that
round's payloads, a small multiple of one payload per participant.

Pure: no network. The swarm's stages (shoal.peer.swarm.stages) do the pulls.
"""

import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from shoal.protocol import MalformedPayloadError, parse_message
from shoal.protocol.swarm_pb2 import CountedPayload, StateStep, StateSteps

KEEP_STEPS = 4
"""Rounds whose steps (and counted payloads) a peer keeps for others to replay (module docstring)."""
DIGEST_BYTES = 32
MAX_OWNER_BYTES = 1024  # a public-key subkey
MAX_COUNTED = 4096  # payloads one round counts at most (shoal.protocol.rules)
MAX_STEPS_BYTES = 4 << 20  # one reply: stays under libp2p's message limit


@dataclass(frozen=True, slots=True)
class Counted:
    """One payload that counted in a round: whose, its digest, its claimed samples, its size."""

    owner: bytes
    digest: bytes
    samples: int
    size: int


@dataclass(frozen=True, slots=True)
class Step:
    """Round `round`'s counted payloads (in owner order) applied to the state `before`."""

    round: int
    before: bytes
    counted: tuple[Counted, ...]


class Steps:
    """The steps this peer took in its last `keep` rounds, by the digest of the state each led to."""

    def __init__(self, keep: int = KEEP_STEPS):
        self.keep = keep
        self._by_after: dict[bytes, Step] = {}

    def record(self, after: bytes, step: Step) -> None:
        self._by_after.pop(after, None)
        self._by_after[after] = step
        for old in list(self._by_after)[: -self.keep]:
            del self._by_after[old]

    def chain(self, digest: bytes) -> list[Step]:
        """The steps that led to the state `digest`, the last first, as far back as they are kept."""
        steps: list[Step] = []
        while (step := self._by_after.get(digest)) is not None and len(steps) < self.keep:
            steps.append(step)
            digest = step.before
        return steps

    def __len__(self) -> int:
        return len(self._by_after)


def encode(steps: Sequence[Step]) -> bytes:
    return StateSteps(
        steps=[
            StateStep(
                round=s.round,
                before=s.before,
                counted=[
                    CountedPayload(owner=c.owner, digest=c.digest, samples=c.samples, size=c.size)
                    for c in s.counted
                ],
            )
            for s in steps
        ]
    ).SerializeToString()


def parse_steps(data: bytes, max_payload_bytes: int) -> list[Step]:
    """Untrusted steps (a `StateSteps` reply), checked for form: at most KEEP_STEPS, rounds falling,
    digests of 32 bytes, counted payloads in strict owner order, sizes within the run's payload limit.
    Raises MalformedPayloadError (`bad_steps`, or `too_large`). Whether they lead where they say is
    known only by replaying them (`plan_replay`, then the digest of the result)."""
    message = parse_message(StateSteps, data, max_bytes=MAX_STEPS_BYTES)
    if len(message.steps) > KEEP_STEPS:
        raise MalformedPayloadError("bad_steps", f"{len(message.steps)} steps, at most {KEEP_STEPS} kept")
    steps: list[Step] = []
    for step in message.steps:
        if len(step.before) != DIGEST_BYTES:
            raise MalformedPayloadError("bad_steps", "a step's state digest is not 32 bytes")
        if steps and step.round >= steps[-1].round:
            raise MalformedPayloadError("bad_steps", "the steps' rounds do not fall")
        if len(step.counted) > MAX_COUNTED:
            raise MalformedPayloadError("bad_steps", f"{len(step.counted)} payloads counted in one round")
        counted = tuple(Counted(c.owner, c.digest, c.samples, c.size) for c in step.counted)
        for c in counted:
            if not 0 < len(c.owner) <= MAX_OWNER_BYTES or len(c.digest) != DIGEST_BYTES or c.samples <= 0:
                raise MalformedPayloadError("bad_steps", "a counted payload's owner, digest or samples")
            if not 0 < c.size <= max_payload_bytes:
                raise MalformedPayloadError("too_large", f"a counted payload of {c.size} bytes")
        if any(a.owner >= b.owner for a, b in itertools.pairwise(counted)):
            raise MalformedPayloadError("bad_steps", "counted payloads out of their owners' order")
        steps.append(Step(step.round, step.before, counted))
    return steps


@dataclass(frozen=True, slots=True)
class Plan:
    """How to replay: from the held state `start`, the steps oldest first; what must be pulled."""

    start: bytes
    steps: tuple[Step, ...]
    missing: tuple[tuple[int, Counted], ...]
    """(round, payload) of the counted payloads this peer does not hold."""

    @property
    def bytes(self) -> int:
        """What the replay pulls (the steps' own reply aside)."""
        return sum(c.size for _, c in self.missing)


def plan_replay(
    chain: Sequence[Step], held_states: Collection[bytes], holds: Callable[[int, bytes], bool]
) -> Plan | None:
    """The shortest replay along `chain` (the last step first) from a state this peer holds; None if
    the chain passes through none of them."""
    for index, step in enumerate(chain):
        if step.before in held_states:
            steps = tuple(reversed(chain[: index + 1]))
            missing = tuple((s.round, c) for s in steps for c in s.counted if not holds(s.round, c.digest))
            return Plan(step.before, steps, missing)
    return None
