"""The token ledger: every window of the corpus trained once per epoch, however peers come and go.

The swarm walks the training stream's windows (`seq_len + 1` tokens each) in one seeded order per
epoch (shoal.peer.data.order: position p of epoch e holds window `permuted(p, W, key(seed, e))`), cut
into *chunks* of `stride` positions (the run's micro-batch size). The ledger records which chunks of
the current epoch the swarm has consumed. It is part of the state every peer shares (the swarm
compares, re-syncs and checkpoints it with the parameters), so a joiner or a restarted peer goes on
where the swarm is.

Round r draws from one *class* of chunks, `r mod classes` (position p is in class `p mod classes`):
`classes` is 1 plus the rounds a round's settlement lags behind its allocation (an overlapped optimizer
applies round r a round later, so round r + 1 is drawn before round r is settled: the two draw from
disjoint classes, and each round sees its class exactly as its last round left it). In its class, a
round's peer in slot s of S takes the *lane* of available chunks `A[s], A[S + s], A[2S + s], ...` (A:
the class's unconsumed chunks of the current epoch in order, then those of the next), and trains its
windows from the lane's start, as many as it has time for: its `Claim` (slot, slots, windows) travels
with its payload.

Settlement (`settle`, once the round's aggregate is applied) marks consumed the lane chunks a claim
trained whole, for the contributions that counted and were not rejected, and only for claims drawn
from the same ledger (each carries its class's digest): what a peer left out by the fan-in, a
straggler, a leaver or a rejected payload trained goes back, first in line for the class's next round.
What "trained once" means: a window counts in the round whose counted payload claimed it. Work that
did not count may linger in its peer's next payload (DeMo's carry and error feedback, DiLoCo's local
drift), as a momentum's residual always does; its windows are trained again. A chunk trained in part
(a step cut short with a halved micro-batch) goes back whole.

A class whose chunks are all consumed starts its next epoch. A claim that reaches past the class's
next epoch (a corpus too small for a round's work) wraps around, and what it trains twice is counted
(`duplicates`), never credited twice.
"""

import hashlib
import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from shoal.peer.data.claims import claim_bytes, claim_of, view_bytes, view_tensor
from shoal.peer.data.order import permuted

VERSION = 1
DIGEST_BYTES = 16
HEADER = 4  # int64s before the epochs: version, classes, chunks, settled round + 1
KEEP_ROUNDS = 8  # settled rounds whose claims are kept, to replay them on an adopted ledger
KEEP_REPLAYS = 64  # replayed settlements kept until read (`TokenLedger.replays`)
MAX_SLOTS = 4096  # participants of one round a claim may name
MAX_CLAIM_WINDOWS = 1 << 40


@dataclass(frozen=True, slots=True)
class Claim:
    """What one payload says it trained: the first `windows` places of its lane in round `round`
    (`TokenLedger.window_ids`)."""

    round: int
    slot: int
    slots: int
    windows: int
    ledger: bytes
    """The digest of the round's class in the ledger the lane was drawn from (`TokenLedger.digest`)."""

    def problem(self) -> str | None:
        """Why an untrusted claim cannot be credited (None: it can)."""
        if not 1 <= self.slots <= MAX_SLOTS or not 0 <= self.slot < self.slots:
            return f"slot {self.slot} of {self.slots}"
        if not 0 <= self.windows <= MAX_CLAIM_WINDOWS:
            return f"{self.windows} windows"
        if len(self.ledger) != DIGEST_BYTES or self.round < 0:
            return "no ledger digest"
        return None


@dataclass(slots=True)
class Lane:
    """One peer's lane in one round: its chunks, and how many of its windows it has trained (the
    batches handed out count them: `take`)."""

    round: int
    slot: int
    slots: int
    digest: bytes
    available: np.ndarray
    """The class's available chunks when the round was drawn: (position, epoch offset 0 or 1) rows."""
    windows: int = 0
    """Places of the lane trained so far this round (`TokenLedger.window_ids`)."""
    audit: dict[int, list[tuple[np.ndarray, np.ndarray]]] | None = None
    """When kept (not None): per optimizer step, the window indices and epochs of its micro-batches."""
    _step: int = -1
    _base: int = 0

    def take(self, step: int, micro: int, size: int) -> int:
        """The lane offset of the `micro`-th micro-batch of `size` places in optimizer step `step`: a
        step starts after the last one's places, and starts over from there when its first micro-batch
        comes again (an out-of-memory restart with a halved size). Counts the places through it."""
        if step != self._step:
            self._step, self._base = step, self.windows
        if micro == 0:
            self.windows = self._base
        offset = self.windows
        self.windows += size
        return offset

    def claim(self) -> Claim:
        return Claim(self.round, self.slot, self.slots, self.windows, self.digest)

    def claim_bytes(self) -> bytes:
        """Its claim, to append to its payload (`claim_bytes`)."""
        return claim_bytes(self.claim())


@dataclass(slots=True)
class Settled:
    """What settling one round did."""

    round: int
    credited: dict[bytes, int] = field(default_factory=dict)
    """Windows credited, by sender."""
    duplicates: int = 0
    """Windows of credited chunks that were already consumed."""
    unledgered: int = 0
    """Windows claimed from another ledger (a peer not yet in sync) or by a malformed claim."""
    before: bytes = b""
    """The digest of the round's class before the settlement (`TokenLedger.digest`): the ledger its
    claims were drawn from."""
    after: bytes = b""
    """The same after it: settlements chain from `before` to `after`, so that the history of a ledger
    the swarm ended on can be read back across re-syncs, whichever peer settled each round."""
    replayed: bool = False
    """A round settled again on a ledger this peer adopted (`TokenLedger.load`)."""


class TokenLedger:
    """The ledger of a training stream of `windows` windows, micro-batches of `stride`, the run's
    `seed`, and `lag` rounds between a round's draw and its settlement (module docstring).

    Thread-safe: the training thread draws lanes and settles, the exchange records what rounds decided.
    """

    def __init__(
        self,
        windows: int,
        stride: int,
        *,
        seed: int = 0,
        lag: int = 0,
        most_places: int = 1 << 20,
        seq_len: int = 0,
    ):
        if stride < 1 or lag < 0 or most_places < stride:
            raise ValueError(f"stride {stride}, lag {lag}, most_places {most_places}")
        self.windows, self.stride, self.seed, self.classes = windows, stride, seed, lag + 1
        self.most_places = most_places
        self.seq_len = seq_len
        """Target tokens of a window (what a window consumed counts for)."""
        """The most places one peer can train in a round (the run's micro-batches a step, times its
        steps a round, times `stride`): a claim of more is not credited."""
        self.chunks = math.ceil(windows / stride)
        if self.chunks < self.classes * 1:
            raise ValueError(
                f"{windows} windows of micro-batches of {stride} cannot fill {self.classes} classes"
            )
        self.epochs = np.zeros(self.classes, dtype=np.int64)
        self.done = np.zeros((2, self.chunks), dtype=bool)  # per position: its class's epoch, the next
        self.settled = -1
        """Rounds up to this one are settled."""
        self._lengths = np.full(self.chunks, stride, dtype=np.int64)
        self._lengths[-1] = windows - (self.chunks - 1) * stride
        self._claims: dict[int, dict[bytes, Claim]] = {}
        self._rejected: dict[int, set[bytes]] = {}
        self.recent: dict[int, Settled] = {}
        """The last rounds settled."""
        self._replays: list[Settled] = []
        self._lock = threading.RLock()
        self.totals = Settled(-1)
        self.names: dict[bytes, str] = {}
        """The peer id each sender seen printed (its record's), for people: `credited_peers`."""
        """Everything settled so far on this peer (credited: by sender)."""

    # -- drawing ---------------------------------------------------------------------------------

    def class_of(self, round_number: int) -> int:
        return round_number % self.classes

    def lane(self, round_number: int, slot: int, slots: int) -> Lane:
        """The lane of `slot` of `slots` in round `round_number`; first settles the rounds of its class
        whose settlement is due."""
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} outside [0, {slots})")
        with self._lock:
            self.settle_through(round_number - self.classes)
            cls = self.class_of(round_number)
            available = self._available(cls, slots)
            if round_number > 0 and self.settled < 0 and not self._claims and len(available):
                # a ledger that has seen no round of a swarm past its first: a joiner's, before its
                # first re-sync. Its lane is not the swarm's, and its claim counts for nothing: it
                # draws elsewhere than round 0's peers did, or its first payload, on the run's first
                # parameters, would be theirs again (a replay to the others)
                shift = (round_number * 0x9E3779B1) % len(available)
                unsynced = hashlib.sha256(b"unsynced" + self.digest(cls)).digest()[:DIGEST_BYTES]
                return Lane(round_number, slot, slots, unsynced, np.roll(available, -shift, axis=0))
            return Lane(round_number, slot, slots, self.digest(cls), available)

    def view(self, round_number: int) -> bytes:
        """The ledger as round `round_number`'s shared state holds it, every round before it settled
        (the exchange asks for it when the round's aggregate is due: the last one is applied then)."""
        with self._lock:
            self.settle_through(round_number - 1)
            return self.to_bytes()

    def _available(self, cls: int, slots: int) -> np.ndarray:
        """The first of class `cls`'s available chunks, as many as `slots` lanes can reach in a round
        (all of them when fewer): (position, epoch offset) rows, the current epoch's, then the next's."""
        need = (self.most_places // self.stride + 2) * slots
        rows = []
        for later in (0, 1):
            found = _first_false(self.done[later, cls :: self.classes], need)
            rows.append(np.stack([found * self.classes + cls, np.full_like(found, later)], 1))
            need -= len(found)
            if need <= 0:
                break
        return np.concatenate(rows)

    def lane_chunks(self, lane: Lane, chunks: int) -> np.ndarray:
        """The lane's first `chunks` chunks: rows of `lane.available` (past the next epoch: wrapped)."""
        if len(lane.available) == 0 or chunks <= 0:
            return np.zeros((0, 2), dtype=np.int64)
        picks = (np.arange(chunks) * lane.slots + lane.slot) % len(lane.available)
        return lane.available[picks]

    def window_ids(self, lane: Lane, offset: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """The stream's window indices of the lane's places [offset, offset + count), and the epoch of
        each. A lane holds `stride` places per chunk; the epoch's last chunk fills only its first ones
        (a micro-batch there is short), so chunks stay aligned to places."""
        places = np.arange(offset, offset + count)
        rows = self.lane_chunks(lane, math.ceil((offset + count) / self.stride))
        chunk, within = places // self.stride, places % self.stride
        positions, later = rows[chunk, 0], rows[chunk, 1]
        real = within < self._lengths[positions]
        positions, later, within = positions[real], later[real], within[real]
        epochs = self.epochs[self.class_of(lane.round)] + later
        ids = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            pick = epochs == epoch
            ids[pick] = permuted(
                positions[pick] * self.stride + within[pick], self.windows, self.epoch_key(epoch)
            )
        return ids, epochs

    def batch(self, lane: Lane, step: int, micro: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The window indices (and their epochs) of a micro-batch (`Lane.take`); one whose places fall
        in the unfilled end of the epoch's short last chunk moves on to the next chunk."""
        ids, epochs = self.window_ids(lane, lane.take(step, micro, size), size)
        if len(ids) == 0:
            lane.windows = math.ceil(lane.windows / self.stride) * self.stride
            offset = lane.windows
            lane.windows += size
            ids, epochs = self.window_ids(lane, offset, size)
        if lane.audit is not None:
            if micro == 0:
                lane.audit[step] = []
            lane.audit.setdefault(step, []).append((ids, epochs))
        return ids, epochs

    def epoch_key(self, epoch: int) -> int:
        return (self.seed * 1_000_003 + epoch * 7_919 + 1) % (1 << 63)

    # -- settling --------------------------------------------------------------------------------

    def record(self, round_number: int, claims: dict[bytes, Claim]) -> None:
        """The claims of the contributions that counted in a round, by sender (the exchange's)."""
        with self._lock:
            if round_number > self.settled:
                self._claims[round_number] = dict(claims)

    def name(self, peer_ids: dict[bytes, str]) -> None:
        """Learns the peer ids of senders (from the run's records); kept after they leave."""
        with self._lock:
            self.names.update(peer_ids)

    def credited_peers(self) -> list[str]:
        """Every sender credited so far on this peer, by the peer id it printed where one is known."""
        with self._lock:
            return sorted(self.names.get(sender, sender.hex()) for sender in self.totals.credited)

    def record_payloads(self, round_number: int, payloads: dict[bytes, bytes]) -> None:
        """`record` for the payloads that counted, by sender: the claims they carry (`claim_of`)."""
        claims = {sender: claim_of(payload) for sender, payload in payloads.items()}
        self.record(round_number, {s: c for s, c in claims.items() if c is not None})

    def view_tensor(self, round_number: int) -> torch.Tensor:
        """`view` as a tensor of the shared state (`view_tensor`)."""
        return view_tensor(self.view(round_number))

    def adopt_tensor(self, tensor: torch.Tensor, round_number: int) -> None:
        """Loads the view an adopted state of round `round_number` holds; ValueError if it is none."""
        self.load(view_bytes(tensor, self.size_bytes), round_number)

    def twin(self, view: torch.Tensor) -> "TokenLedger":
        """A ledger of the same corpus and run holding a state's `view`, apart from this one: to replay
        rounds on (shoal.peer.swarm.replay). ValueError if the view is not one of this run's."""
        twin = TokenLedger(
            self.windows,
            self.stride,
            seed=self.seed,
            lag=self.classes - 1,
            most_places=self.most_places,
            seq_len=self.seq_len,
        )
        twin.load(view_bytes(view, self.size_bytes))
        return twin

    def reject(self, round_number: int, sender: bytes) -> None:
        """A contribution the optimizer left out: its claim is not credited."""
        with self._lock:
            self._rejected.setdefault(round_number, set()).add(sender)

    def settle_through(self, round_number: int) -> list[Settled]:
        """Settles, in order, every recorded round up to `round_number` not yet settled."""
        with self._lock:
            due = sorted(r for r in self._claims if self.settled < r <= round_number)
            return [self.settle(r) for r in due]

    def settle(self, round_number: int, *, count: bool = True) -> Settled:
        """Credits the round's recorded claims (module docstring); rounds settle in order. `count`
        False: a replay, not added to `totals`."""
        with self._lock:
            claims = self._claims.get(round_number, {})
            rejected = self._rejected.get(round_number, set())
            result = self._credit(round_number, {s: c for s, c in claims.items() if s not in rejected})
            self.settled = max(self.settled, round_number)
            self.recent[round_number] = result
            for old in [r for r in self._claims if r < round_number - KEEP_ROUNDS]:
                del self._claims[old]
                self._rejected.pop(old, None)
                self.recent.pop(old, None)
            if not count:
                result.replayed = True
                self._replays = [*self._replays[-(KEEP_REPLAYS - 1) :], result]
                return result
            for sender, windows in result.credited.items():
                self.totals.credited[sender] = self.totals.credited.get(sender, 0) + windows
            self.totals.duplicates += result.duplicates
            self.totals.unledgered += result.unledgered
            return result

    def settled_after(self, round_number: int) -> list[Settled]:
        """The rounds settled after `round_number` that are still kept (`recent`), in order."""
        with self._lock:
            return [self.recent[r] for r in sorted(self.recent) if r > round_number]

    def replays(self) -> list[Settled]:
        """The rounds settled again on adopted ledgers since the last call (the last `KEEP_REPLAYS`)."""
        with self._lock:
            replays, self._replays = self._replays, []
            return replays

    def _credit(self, round_number: int, claims: dict[bytes, Claim]) -> Settled:
        cls = self.class_of(round_number)
        digest = self.digest(cls)
        result = Settled(round_number, before=digest)
        available: dict[int, np.ndarray] = {}  # by slots
        for sender in sorted(claims):
            claim = claims[sender]
            wrong = claim.problem() or claim.windows > self.most_places
            if claim.round != round_number or wrong or claim.ledger != digest:
                result.unledgered += claim.windows
                continue
            drawn = available.setdefault(claim.slots, self._available(cls, claim.slots))
            lane = Lane(round_number, claim.slot, claim.slots, digest, drawn)
            whole = claim.windows // self.stride  # the chunks trained whole; past its lane, all again
            rows = self.lane_chunks(lane, min(whole, math.ceil((len(drawn) - claim.slot) / claim.slots)))
            lengths = self._lengths[rows[:, 0]]
            result.duplicates += (whole - len(rows)) * self.stride
            seen = self.done[rows[:, 1], rows[:, 0]]
            # a chunk twice in one lane (wrapped around) counts once
            _, first = np.unique(rows, axis=0, return_index=True)
            fresh = np.zeros(len(rows), dtype=bool)
            fresh[first] = True
            fresh &= ~seen
            self.done[rows[fresh, 1], rows[fresh, 0]] = True
            result.credited[sender] = int(lengths[fresh].sum())
            result.duplicates += int(lengths[~fresh].sum())
        self._advance(cls)
        result.after = self.digest(cls)
        return result

    def _advance(self, cls: int) -> None:
        mine = slice(cls, None, self.classes)
        while self.done[0, mine].all():
            self.done[0, mine] = self.done[1, mine]
            self.done[1, mine] = False
            self.epochs[cls] += 1

    # -- the shared state ------------------------------------------------------------------------

    def digest(self, cls: int) -> bytes:
        """A digest of one class: its epoch and which of its chunks are consumed."""
        with self._lock:
            data = np.packbits(self.done[:, cls :: self.classes]).tobytes()
            head = np.array([VERSION, self.classes, self.chunks, cls, self.epochs[cls]], dtype="<i8")
            return hashlib.sha256(head.tobytes() + data).digest()[:DIGEST_BYTES]

    def to_bytes(self) -> bytes:
        """The whole ledger, fixed size for a run (`size_bytes`)."""
        with self._lock:
            head = np.array([VERSION, self.classes, self.chunks, self.settled + 1], dtype="<i8")
            return head.tobytes() + self.epochs.astype("<i8").tobytes() + np.packbits(self.done).tobytes()

    def describe(self) -> str:
        """What peers of a run must share for their ledgers to agree (pinned in the run's config)."""
        return (
            f"{self.windows} windows in chunks of {self.stride}, {self.classes} class(es), at most "
            f"{self.most_places} a peer a round"
        )

    @property
    def size_bytes(self) -> int:
        return 8 * (HEADER + self.classes) + math.ceil(2 * self.chunks / 8)

    def load(self, data: bytes, round_number: int | None = None) -> None:
        """Takes a ledger's bytes: the swarm's as round `round_number` was drawn (adopted), or a
        checkpoint's (None). ValueError if they are not a ledger of this corpus and run. An adopted
        ledger is brought to where this one is: the rounds this peer settled past it are settled again
        on it, from their kept claims."""
        if len(data) != self.size_bytes:
            raise ValueError(f"a ledger of {len(data)} bytes, {self.size_bytes} expected")
        head = np.frombuffer(data[: 8 * HEADER], dtype="<i8")
        if head[0] != VERSION or head[1] != self.classes or head[2] != self.chunks or head[3] < 0:
            raise ValueError(f"a ledger of another corpus or run: {head.tolist()}")
        epochs = np.frombuffer(data[8 * HEADER : 8 * (HEADER + self.classes)], dtype="<i8")
        if (epochs < 0).any():
            raise ValueError("a ledger with a negative epoch")
        bits = np.unpackbits(np.frombuffer(data[8 * (HEADER + self.classes) :], dtype=np.uint8))
        with self._lock:
            replay = round_number is not None
            again = (
                [r for r in sorted(self._claims) if int(head[3]) - 1 < r <= self.settled] if replay else []
            )
            self.epochs = epochs.astype(np.int64)
            self.done = bits[: 2 * self.chunks].reshape(2, self.chunks).astype(bool)
            self.settled = int(head[3]) - 1
            for r in again:
                self.settle(r, count=False)
            if not replay:
                self._claims.clear()

    def progress(self) -> tuple[int, float, int]:
        """(epoch, share of it consumed, windows consumed since the run began): the slowest class's
        epoch; the share counts the classes already past it whole."""
        with self._lock:
            epoch, share, total = int(self.epochs.min()), 0, 0
            for cls in range(self.classes):
                every = self._windows_of(cls, None)
                share += every if self.epochs[cls] > epoch else self._windows_of(cls, self.done[0])
                total += int(self.epochs[cls]) * every + self._windows_of(cls, self.done[0])
                total += self._windows_of(cls, self.done[1])
            return epoch, share / self.windows, total

    def _windows_of(self, cls: int, done: np.ndarray | None) -> int:
        """Windows of class `cls`'s chunks: all of them, or those marked in `done`."""
        marks = (
            np.ones(len(range(cls, self.chunks, self.classes)), bool)
            if done is None
            else done[cls :: self.classes]
        )
        count = int(np.count_nonzero(marks)) * self.stride
        last = self.chunks - 1
        if last % self.classes == cls and marks[last // self.classes]:
            count -= self.stride - int(self._lengths[last])
        return count


def _first_false(marks: np.ndarray, count: int) -> np.ndarray:
    """The indices of the first `count` False entries of `marks` (fewer if it holds fewer), read in
    growing blocks: a ledger of millions of chunks is not scanned whole for a round's few."""
    found, start, block = [], 0, max(2 * count, 4096)
    while count > 0 and start < len(marks):
        hits = np.flatnonzero(~marks[start : start + block])[:count] + start
        found.append(hits)
        count -= len(hits)
        start += block
        block *= 2
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
