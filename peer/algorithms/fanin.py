"""Bounded fan-in (`--gather G`): at most G contributions count in a round, the same G on every peer.

Each peer still computes every round, but only G payloads are aggregated, so a peer downloads at most
G payloads a round whatever the swarm's size (docs/SCALE.md). The rule (`choose`) needs no message and
no history, only the round's candidates and the samples each one announced:

- the G candidates with the most samples count (a claim is capped at `CAP_RATIO` times the median
  claim, so a peer that inflates its count gains at most that);
- ties go to a draw from a hash of (run, round, key), new every round;
- a peer whose payload did not count claims those samples again with its next one, so its claim
  grows with every round it waits. Its work itself is not re-sent by default: by the time it would
  count it is up to N / G - 1 rounds stale, and `shoal bench converge --carry` measured re-sending it
  as worse for both DeMo (the sent coefficients back into the momentum) and DiLoCo (the
  pseudo-gradient averaged over the phases it waited); the optimizers' `carry=True` keeps that rule.
  DeMo's unsent momentum stays with each peer as always.

With equal compute this is a round-robin: every peer counts once every ceil(N / G) rounds, and none
waits longer. A peer twice as fast fills its claim twice as fast and counts about twice as often: the
rotation is weighted by samples. Peers that see the same candidates choose the same set; the exchange
decides who the candidates are (the swarm: the announcements it took, stragglers and banned peers left
out). Under a coordinator with `--gather G`, the coordinator applies this rule to the participants it
decided and lists only the chosen, with a tally of every participant's state for the vote
(shoal.coordinator.server.result_reply); under one without, every peer applies it to the same list.
"""

import hashlib
import statistics
from collections.abc import Mapping

CAP_RATIO = 4.0
"""A claim counts for at most this many times the round's median claim (an honest peer that waited
N / G - 1 rounds claims N / G rounds of samples: 4 at G = N / 4)."""


def draw(seed: bytes, round_number: int, key: bytes) -> int:
    """A 64-bit number from (seed, round, key), the same on every peer, unrelated from round to round."""
    digest = hashlib.sha256(b"shoal-gather\0" + seed + b"\0" + round_number.to_bytes(8, "little") + key)
    return int.from_bytes(digest.digest()[:8], "little")


def choose(seed: bytes, round_number: int, samples: Mapping[bytes, int], limit: int) -> frozenset[bytes]:
    """The keys of `samples` ({key: samples claimed}) whose contributions count in `round_number`: all
    of them when `limit` is 0 or there are no more than `limit`; else the `limit` with the largest capped
    claims, ties broken by `draw`. Claims below 1 count as 1."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if limit == 0 or len(samples) <= limit:
        return frozenset(samples)
    claims = {key: max(int(count), 1) for key, count in samples.items()}
    cap = CAP_RATIO * statistics.median(claims.values())

    def rank(key: bytes) -> tuple[float, int]:
        return min(claims[key], cap), draw(seed, round_number, key)

    return frozenset(sorted(claims, key=rank, reverse=True)[:limit])
