"""How long an uncoordinated round computes when `--compute-fraction` is not given (`AutoWindow`).

A round of `round_seconds` ends at its deadline: every payload must be announced and pulled by then.
A fixed share of the round (the old default: half) leaves a peer idle for whatever its exchange did
not need. Instead each round computes until its deadline minus a reserve, the time this peer measured
its exchange to need (`needed`, the collect stage's: shoal.peer.swarm.collect): storing its
announcement and a poll's wait for the others to read it; and the longest pull of the round, from an
announcement read to its payload held, whenever the others announced (waiting for a later peer would
feed back: the peer with the larger reserve would measure the others' lateness and grow it). Its
encode time comes on top (the payload is made after the computation).

The reserve is the announcement's time, 1.5 times the pull, the encode and a margin. It grows at once
to what a round needed, doubles after a round whose payloads did not all arrive by the deadline, and
shrinks to the larger of the last two rounds' needs, so that one quick round does not cut the next one
short; it never exceeds half a round (the old default's share), and starts at half of
`DEFAULT_ROUND_S` at most, before anything was measured (a longer round starts computing the longer).

An overlapped algorithm (DeMo with overlap, DiLoCo's late modes) plans its next round while the last
one is exchanged: the same rule then gives it nearly the whole round, its exchange running alongside.
A coordinated round keeps the coordinator's compute budget (shoal.peer.job.runtime).

The round's length is the swarm's: its first peer chooses it, and the others follow its clock. Without
--round-seconds the first peer chooses one that its exchange fits (`round_seconds_for`). The exchange
is taken to cost `EXCHANGE_LATENCY_S` (the announcement's store, a poll's wait and the pulls' round
trips, as measured) plus the pulls of the others' payloads over the link assumed (`LINK_MBIT`, a home
link, each way, with `PEERS` peers, or --gather's). A peer that does not overlap its exchange idles
for it, so it takes at most `IDLE_SHARE` of a round; an overlapped one computes through it, which is
planned to take at most `OVERLAP_SHARE` of the round, so that a slow pull still ends within it. The
payload is the one the fit's dry run made (shoal.peer.train.fit); without one (--fit off), the latency alone.
"""

import math
from dataclasses import dataclass, field

from shoal.peer.config.spec import DEFAULT_ROUND_S, FIRST_FRACTION

MARGIN_S = 0.3
"""Kept on top of the measured need: the DHT's poll interval and the clocks' skew."""
SLACK = 1.5
ROUND_STEP_S = 5.0
"""A round chosen longer than the shortest is a multiple of this."""
LINK_MBIT = 10.0
"""The link a first peer assumes of the swarm's peers, each way, to choose its round."""
PEERS = 4
"""The swarm a first peer assumes: each peer pulls the payloads of the others (at most --gather)."""
EXCHANGE_LATENCY_S = 1.3
"""An exchange's cost beyond its transfer: the announcement's store, a poll's wait, the pulls' round
trips (as measured: BENCHMARKS.md, the utilization a default swarm gets)."""
OVERLAP_SHARE = 0.5
"""The share of a round an algorithm that computes through its exchange is planned to spend on it: the
rest is slack for a slow pull, whose payload would otherwise be late (BENCHMARKS.md)."""
IDLE_SHARE = 0.05
"""The share of a round an algorithm that idles for its exchange is planned to spend on it: half the 10%
that 90% of plain torch's tokens/s leaves, as the window also keeps the pulls' slack and a margin
(BENCHMARKS.md)."""


def round_seconds_for(payload_bytes: int | None, *, overlapped: bool, gather: int = 0) -> float:
    """The round a swarm's first peer chooses (module docstring): the shortest multiple of ROUND_STEP_S,
    at least DEFAULT_ROUND_S, that the exchange of `payload_bytes` (None: unknown) over LINK_MBIT fits,
    in IDLE_SHARE of it, or in OVERLAP_SHARE where the algorithm computes through the exchange."""
    pulls = max(1, min(gather or PEERS, PEERS) - 1)
    exchange_s = EXCHANGE_LATENCY_S + pulls * (payload_bytes or 0) * 8 / (LINK_MBIT * 1e6)
    needed = exchange_s / OVERLAP_SHARE if overlapped else exchange_s / IDLE_SHARE
    return max(DEFAULT_ROUND_S, ROUND_STEP_S * math.ceil(needed / ROUND_STEP_S))


@dataclass
class AutoWindow:
    """The compute window of each round (see the module docstring); no I/O."""

    round_seconds: float
    reserve_s: float = field(init=False)
    """Seconds kept at the end of a round for the encode and the exchange."""

    _last_need_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.reserve_s = min(self.most_s, FIRST_FRACTION * DEFAULT_ROUND_S)
        self._last_need_s = self.reserve_s

    @property
    def most_s(self) -> float:
        return FIRST_FRACTION * self.round_seconds

    def seconds(self, deadline: float, now: float) -> float:
        """The compute window of a round that ends at `deadline` and starts computing at `now`."""
        return deadline - now - self.reserve_s

    def observe(self, needed: tuple[float, float] | None, encode_s: float) -> None:
        """After a round: what its exchange needed, (seconds to announce and be read, of the longest
        pull); None if a payload was still being pulled at the deadline."""
        grown = 2 * self.reserve_s  # a pull missed the deadline
        need = grown if needed is None else needed[0] + SLACK * needed[1] + encode_s + MARGIN_S
        kept = need if need >= self.reserve_s else max(need, self._last_need_s)
        self._last_need_s = need
        self.reserve_s = min(max(kept, MARGIN_S), self.most_s)
