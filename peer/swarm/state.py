"""The state every participant of a run shares, cut into verifiable pieces.

Between rounds all participants of a run hold the same *shared state*: the parameters (DeMo), or the
global parameters and the outer momentum (DiLoCo). A snapshot of it is

- `data`: the little-endian float32 values of each shared tensor, in order (the receiver knows the
  shapes: same run configuration, same model);
- a `StateManifest` (protocol/swarm.proto): its round, its size, and the SHA-256 of every 1 MiB piece;
- its *digest*: the SHA-256 of the serialized manifest. That 32-byte value is announced with each
  round, so peers can compare states without moving them, and a peer whose state differs can pull the
  majority's from several sources at once: the manifest is checked against the digest, each piece
  against the manifest, so a piece can come from anyone and a lost source costs only its piece in
  flight (`download`).

The functions here touch no network: `download` is given the function that fetches one piece.
"""

import asyncio
import hashlib
import math
import sys
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from shoal.protocol import MalformedPayloadError, parse_message
from shoal.protocol.rules import majority, tallied, weighed
from shoal.protocol.swarm_pb2 import StateManifest, StateRequest

if TYPE_CHECKING:
    from shoal.peer.swarm.records import Announcement

CHUNK_BYTES = 1 << 20
DIGEST_BYTES = 32
MIN_CHUNK_BYTES, MAX_CHUNK_BYTES = 1 << 10, 1 << 22  # pieces go in one reply: stay under libp2p's 4 MiB

if sys.byteorder != "little":  # the wire carries little-endian float32; numpy views here are native
    raise ImportError("shoal's state snapshots assume a little-endian machine")


class StateUnavailable(RuntimeError):
    """No source could provide a valid copy of the wanted state."""


def state_size(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the snapshot of these tensors."""
    return 4 * sum(t.numel() for t in tensors)


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """A captured shared state, ready to be served piece by piece."""

    round: int
    data: bytes
    manifest: bytes
    """The serialized StateManifest."""
    digest: bytes
    """SHA-256 of `manifest`."""
    chunk_bytes: int

    @staticmethod
    def capture(
        tensors: Sequence[torch.Tensor], round_number: int, chunk_bytes: int = CHUNK_BYTES
    ) -> "StateSnapshot":
        """Copies the tensors (any device, any float dtype) into a snapshot for `round_number`."""
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        flat = [t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors]
        data = torch.cat(flat).numpy().tobytes() if flat else b""
        digests = [
            hashlib.sha256(data[start : start + chunk_bytes]).digest()
            for start in range(0, len(data), chunk_bytes)
        ]
        manifest = StateManifest(
            round=round_number, size=len(data), chunk_bytes=chunk_bytes, chunk_digests=digests
        ).SerializeToString()
        return StateSnapshot(round_number, data, manifest, hashlib.sha256(manifest).digest(), chunk_bytes)

    def chunk(self, index: int) -> bytes:
        """Piece `index`; empty if there is no such piece."""
        return self.data[index * self.chunk_bytes : (index + 1) * self.chunk_bytes]


def parse_manifest(data: bytes, digest: bytes, expected_size: int) -> StateManifest:
    """An untrusted manifest, checked against the announced digest and the size this peer's own state
    has; raises MalformedPayloadError."""
    if hashlib.sha256(data).digest() != digest:
        raise MalformedPayloadError("digest_mismatch", "state manifest does not match the announced digest")
    pieces = math.ceil(expected_size / MIN_CHUNK_BYTES)
    manifest = parse_message(StateManifest, data, max_bytes=64 + (DIGEST_BYTES + 2) * pieces)
    if manifest.size != expected_size:
        raise MalformedPayloadError(
            "wrong_structure", f"state of {manifest.size} bytes, this run's is {expected_size}"
        )
    if not MIN_CHUNK_BYTES <= manifest.chunk_bytes <= MAX_CHUNK_BYTES:
        raise MalformedPayloadError("bad_manifest", f"piece size {manifest.chunk_bytes}")
    if len(manifest.chunk_digests) != math.ceil(manifest.size / manifest.chunk_bytes):
        raise MalformedPayloadError("bad_manifest", f"{len(manifest.chunk_digests)} piece digests")
    if any(len(d) != DIGEST_BYTES for d in manifest.chunk_digests):
        raise MalformedPayloadError("bad_manifest", "a piece digest is not 32 bytes")
    return manifest


def check_chunk(manifest: StateManifest, index: int, data: bytes) -> None:
    """Raises MalformedPayloadError unless `data` is piece `index` of the manifest's state."""
    expected = min(manifest.chunk_bytes, manifest.size - index * manifest.chunk_bytes)
    if len(data) != expected or hashlib.sha256(data).digest() != manifest.chunk_digests[index]:
        raise MalformedPayloadError("digest_mismatch", f"state piece {index} does not match its manifest")


def restore(data: bytes, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Float32 CPU tensors shaped like `like`, from verified snapshot bytes; rejects non-finite values."""
    if len(data) != state_size(like):
        raise MalformedPayloadError("wrong_structure", f"{len(data)} state bytes for {state_size(like)}")
    values = torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.empty(0)
    if not bool(torch.isfinite(values).all()):
        raise MalformedPayloadError("non_finite", "state holds NaN or infinite values")
    return [
        piece.view(t.shape) for piece, t in zip(values.split([t.numel() for t in like]), like, strict=True)
    ]


Fetch = Callable[[str, StateRequest], Awaitable[bytes]]
"""fetch(source, request) -> the reply's bytes; raises on transport errors (any OSError/TimeoutError or
what `transient` lists)."""


async def download(
    digest: bytes,
    sources: Sequence[str],
    fetch: Fetch,
    *,
    expected_size: int,
    transient: tuple[type[BaseException], ...] = (),
    parallel: int = 4,
    attempts_per_source: int = 2,
    rejected: Counter | None = None,
) -> tuple[StateManifest, bytes]:
    """The state with this digest, pulled from up to `parallel` sources at once, a piece at a time.

    Each worker takes a source and pulls the next missing piece from it; a piece that fails (transport
    error or wrong bytes) goes back for another worker, and a source that failed `attempts_per_source`
    times is replaced by the next unused one. Raises StateUnavailable when no source is left before
    every piece is held; what was already verified is never fetched twice.
    """
    errors: tuple[type[BaseException], ...]
    errors = (MalformedPayloadError, OSError, TimeoutError, asyncio.IncompleteReadError, *transient)
    rejected = rejected if rejected is not None else Counter()
    manifest = None
    for source in sources:
        try:
            manifest = parse_manifest(
                await fetch(source, StateRequest(state=digest, manifest=True)), digest, expected_size
            )
            break
        except errors as error:
            rejected[getattr(error, "reason", "unreachable")] += 1
    if manifest is None:
        raise StateUnavailable(f"none of {len(sources)} sources served the manifest of the state")
    count = len(manifest.chunk_digests)
    pieces: dict[int, bytes]
    missing, pieces = deque(range(count)), {}

    unused = deque(sources)

    async def worker() -> None:
        """Pieces from one source until it fails too often, then from the next unused source."""
        while unused and len(pieces) < count:
            source, failures = unused.popleft(), 0
            while len(pieces) < count and failures < attempts_per_source:
                if not missing:  # the rest is in flight elsewhere; take it over if that worker fails
                    await asyncio.sleep(0.05)
                    continue
                index = missing.popleft()
                try:
                    data = await fetch(source, StateRequest(state=digest, chunk=index))
                    check_chunk(manifest, index, data)
                except errors as error:
                    missing.append(index)
                    rejected[getattr(error, "reason", "unreachable")] += 1
                    failures += 1
                    await asyncio.sleep(0.05 * 2**failures)
                    continue
                pieces[index] = data

    await asyncio.gather(*(worker() for _ in range(min(parallel, len(sources)))))
    if len(pieces) < count:
        raise StateUnavailable(f"{count - len(pieces)} of {count} state pieces unavailable from every source")
    return manifest, b"".join(pieces[i] for i in range(count))


@dataclass(frozen=True)
class Tally:
    """A round's state vote counted by the coordinator: under a bounded fan-in its result lists only the
    chosen participants, and tallies every participant's state (`RoundResultReply.votes`)."""

    votes: Mapping[tuple[bytes, bool], int]
    """{(state digest, synced): participants}."""
    holders: Mapping[bytes, tuple[str, ...]]
    """Some participants holding each state (peer ids), to re-sync from."""


@dataclass(frozen=True)
class Decision:
    """Whose contributions count in a round, from the announcements of the payloads held (`decide`)."""

    counted: list[bytes]
    """The owners whose contributions count, in key order."""
    copies: list[bytes] = field(default_factory=list)
    """Owners that announced a payload a smaller key announced too (copying one is free, so the
    copier cannot be told from the author: left out, not struck)."""
    stale: list[bytes] = field(default_factory=list)
    """Other owners whose contribution was computed on another state than the majority's."""
    compared: bool = False
    """Whether states were compared (asked for, and someone's contribution is held)."""
    agreed: bytes | None = None
    """The majority's state (None: states not compared, or no one announced one)."""
    behind: bool = False
    """Whether this peer's own state is not the majority's: it re-syncs, from `sources` (peer ids)."""
    sources: list[str] = field(default_factory=list)
    earned: bool = True
    """Whether weight earned by counted work backs `agreed` (shoal.protocol.work); False: a headcount
    of identities, which a peer in sync follows off its own state only by a replay it can check."""


def decide(
    announced: "dict[bytes, Announcement]",
    mine: "Announcement",
    *,
    compare_states: bool,
    voters: "dict[bytes, Announcement] | Tally | None" = None,
    weights: Mapping[bytes, int] | None = None,
    own: bool = False,
    anchor: bytes | None = None,
) -> Decision:
    """The round's decision on this peer (its announcement `mine`), the same on every peer holding the
    same announcements: one contribution per distinct payload, for the smallest key, and, with
    `compare_states`, only those computed on the majority's state (`majority`). The majority is that of
    `announced`, or of `voters` when given: under a bounded fan-in every announcement of the round
    votes, not only the few chosen (two of them could not outvote a liar), and a peer behind re-syncs
    from any voter on the majority's state. Under a coordinator the votes come counted (a `Tally`). A
    peer in sync whose vote is missing (a coordinated round it was left out of) never takes a state no
    peer in sync voted for: fresh joiners and stale peers that alone made a round do not roll the swarm
    back to theirs.

    With `weights` (this peer's record of each identity's counted work, shoal.protocol.work), the votes
    weigh by it (`weighed`): fresh identities weigh nothing, however many. Where no earned weight
    backs any state, the headcount decides, marked `earned` False. `own`: this peer keeps its own
    state (in sync, it could not check the headcount's by a replay). `anchor`: the state the run key
    signed for the round (shoal.peer.swarm.anchor), which this peer takes whatever the vote."""
    held = sorted(announced)
    first_owner: dict[bytes, bytes] = {}
    for owner in held:
        first_owner.setdefault(announced[owner].digest, owner)
    copies = [owner for owner in held if first_owner[announced[owner].digest] != owner]
    held = [owner for owner in held if first_owner[announced[owner].digest] == owner]
    if not compare_states or not held:  # (a coordinated round may have no participant at all)
        return Decision(held, copies)
    if isinstance(voters, Tally):
        agreed, earned = tallied(voters.votes), True  # (the coordinator counted the votes)
        agreed = agreed if anchor is None else anchor
        holders = [a.peer for o, a in sorted(announced.items()) if a.state == agreed and o != mine.owner]
        # `agreed` None (no vote for a state) is held by no one
        holders += [
            p for p in voters.holders.get(cast(bytes, agreed), ()) if p not in holders and p != mine.peer
        ]
        synced_vote = any(synced and count > 0 for (_, synced), count in voters.votes.items())
    else:
        ballots = {owner: announced[owner] for owner in held} if voters is None else voters
        states = {owner: (a.state, a.synced) for owner, a in ballots.items()}
        agreed, earned = weighed(states, weights) if weights is not None else (majority(states), True)
        agreed, earned = (agreed, earned) if anchor is None else (anchor, True)
        holders = [a.peer for o, a in sorted(ballots.items()) if a.state == agreed and o != mine.owner]
        synced_vote = any(a.synced for a in ballots.values())
    if mine.synced and mine.state and not synced_vote and anchor is None:
        # a round that only newcomers (or peers out of sync) made, this peer's vote not among them: it
        # keeps the state the swarm agreed on last, and their contributions, on another, are stale
        agreed, holders = mine.state, []
    if own and mine.state:
        agreed, holders = mine.state, []
    stale = [owner for owner in held if announced[owner].state != agreed and owner != mine.owner]
    behind = agreed != mine.state
    sources = holders if behind else []
    left_out = set(stale)  # (a set: a flood of stale announcers is not quadratic)
    counted = [owner for owner in held if owner not in left_out and not (behind and owner == mine.owner)]
    return Decision(counted, copies, stale, True, agreed, behind, sources, earned)
