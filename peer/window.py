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
shrinks halfway to the need each round, so that one quick round does not cut the next one short; it
never exceeds half a round (the old default's share) and starts there, before anything was measured.

An overlapped algorithm (DeMo with overlap, DiLoCo's late modes) plans its next round while the last
one is exchanged: the same rule then gives it nearly the whole round, its exchange running alongside.
A coordinated round keeps the coordinator's compute budget (shoal.peer.runtime).
"""

from dataclasses import dataclass, field

FIRST_FRACTION = 0.5
"""The share of a round kept for the exchange before one was measured, and at most."""
MARGIN_S = 0.3
"""Kept on top of the measured need: the DHT's poll interval and the clocks' skew."""
SLACK = 1.5


@dataclass
class AutoWindow:
    """The compute window of each round (see the module docstring); no I/O."""

    round_seconds: float
    reserve_s: float = field(init=False)
    """Seconds kept at the end of a round for the encode and the exchange."""

    def __post_init__(self) -> None:
        self.reserve_s = self.most_s

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
        if need < self.reserve_s:
            need = 0.5 * (need + self.reserve_s)
        self.reserve_s = min(max(need, MARGIN_S), self.most_s)
