"""Votes earned by counted work: what a state vote weighs each announcer by (shoal.protocol.rules.weighed).

Identities are free (`shoal keygen`, or any new key), so a vote that counts heads is bought by whoever
runs the most of them. A peer therefore weighs each announcer by what the rounds it ended in sync
record of that identity: an identity whose contribution counted (computed on the agreed state, pulled,
checked against its announcement, not refused by the optimizer's screening) in at least `earn` of
this peer's last `window` recorded rounds has earned one vote; any other weighs nothing. A thousand
fresh keys weigh nothing, and neither does one whose payloads were only ever stale or refused. For a
peer that recorded fewer than `earn` rounds (a young swarm, a peer that just synced) nobody weighs
anything: there the headcount decides, which a peer in sync follows only by a replay it can check or
from peers it counted before. A round a peer counted alone is not recorded: nobody else checked it,
and two peers cut apart would each earn its own vote, then keep its own state where they meet.

One vote per earned identity, not a weight per counted round: two honest peers whose counted sets
differed in a round (one missed a payload) must still pick the same state in the next, and their
records differ exactly then; counts capped at one vote are the same on both once each identity has
earned its vote, and the same bar for everyone keeps them the same while a swarm is young (a bar
lowered to the rounds recorded split two honest peers of a new swarm, one of which missed the
other's first payload). Rounds, not samples: a sample count is the sender's own claim (capped at 2x
the median in a round's mean, shoal.peer.algorithms.robust, but claimed all the same).

What this leaves (docs/ROBUSTNESS.md): an identity that does honest, screened work for `earn` rounds
earns its vote, so an attacker that keeps more identities counted than there are honest peers decides
the state.

Pure and torch-free: the coordinator and the peers import it alike.
"""

from collections import Counter, deque
from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import TypeVar

WORK_WINDOW = 64
"""Rounds of counted work remembered: an identity that stops contributing loses its vote when its last
`EARN_ROUNDS` counted rounds leave the window."""
EARN_ROUNDS = 8
"""Counted rounds an identity needs within the window before its vote weighs anything."""

K = TypeVar("K", bound=Hashable)


class Work:
    """The counted contributions of this peer's last `window` verified rounds (see the module docstring).
    Memory: at most `window` rounds of the owners counted in each."""

    def __init__(self, window: int = WORK_WINDOW, earn: int = EARN_ROUNDS):
        if window < 1 or earn < 1:
            raise ValueError(f"window and earn must be >= 1, got {window}, {earn}")
        self.window, self.earn = window, earn
        self._rounds: deque[tuple[int, frozenset[bytes]]] = deque()
        self._counted: Counter[bytes] = Counter()

    def record(self, round_number: int, counted: Iterable[bytes]) -> None:
        """The owners whose contributions counted in `round_number`, a round this peer ended in sync;
        a round already recorded (or older than the newest) is ignored."""
        if self._rounds and round_number <= self._rounds[-1][0]:
            return
        owners = frozenset(counted)
        self._rounds.append((round_number, owners))
        self._counted.update(owners)
        while self._rounds[0][0] <= round_number - self.window:
            _, gone = self._rounds.popleft()
            self._counted.subtract(gone)
        self._counted = +self._counted  # (drops the zeros)

    def drop(self, round_number: int, owner: bytes) -> None:
        """`owner`'s contribution of `round_number` did not count after all (the optimizer refused it)."""
        for index, (number, owners) in enumerate(self._rounds):
            if number == round_number and owner in owners:
                self._rounds[index] = (number, owners - {owner})
                self._counted[owner] -= 1
                if not self._counted[owner]:
                    del self._counted[owner]

    def forfeit(self, owner: bytes) -> None:
        """Forgets what `owner` earned: it was caught announcing a false state."""
        if owner in self._counted:
            self._rounds = deque((number, owners - {owner}) for number, owners in self._rounds)
            del self._counted[owner]

    @property
    def rounds(self) -> int:
        """Rounds recorded (within the window)."""
        return len(self._rounds)

    def weight(self, owner: bytes) -> int:
        """1 if `owner` earned its vote, else 0."""
        return int(self.counted(owner) >= self.earn)

    def counted(self, owner: bytes) -> int:
        """The rounds recorded in which `owner`'s contribution counted."""
        return self._counted.get(owner, 0)

    def weights(self, owners: Iterable[bytes]) -> dict[bytes, int]:
        return {owner: self.weight(owner) for owner in owners}


def earned(rounds: Collection[int], number: int, window: int = WORK_WINDOW, earn: int = EARN_ROUNDS) -> bool:
    """Whether an identity counted in `rounds` has a vote in round `number`: `earn` of them within the
    `window` rounds before it (`Work.weight`, for a record kept as values: the coordinator's)."""
    return sum(number - window <= r < number for r in rounds) >= earn


def recorded(
    record: Mapping[K, tuple[int, ...]], number: int, counted: Collection[K], window: int = WORK_WINDOW
) -> dict[K, tuple[int, ...]]:
    """`record` ({identity: the rounds it counted in, ascending}) with round `number`'s `counted` added,
    rounds that left the window forgotten, and identities left with none dropped: at most `window`
    rounds per identity, and only identities counted within the window."""
    kept = {key: tuple(r for r in rounds if r > number - window) for key, rounds in record.items()}
    for key in counted:
        if not kept.get(key) or kept[key][-1] < number:
            kept[key] = (*kept.get(key, ()), number)
    return {key: rounds for key, rounds in kept.items() if rounds}
