"""The rules a coordinator and its peers must apply alike, in one torch-free place both import: the
bounded fan-in's choice (`choose`) among the peers on the round's majority state (`majority`,
`eligible`), how many holders a round's tally names (`TALLY_HOLDERS`), and the shape of a libp2p
peer id (`is_peer_id`).

## Bounded fan-in

Bounded fan-in (`--gather G`): at most G contributions count in a round, the same G on every peer.

Each peer still computes every round, but only G payloads are aggregated, so a peer downloads at most
G payloads a round whatever the swarm's size (docs/SCALE.md). The rule (`choose`) needs no message and
no history, only the round's candidates:

- the candidates are ordered by a draw from a hash of (run, cycle, key), new every cycle of
  L = N / gcd(N, G) rounds, and round r of a cycle takes the r-th G of that order, read round and
  round (slots r G to r G + G - 1, modulo N): in a cycle every candidate counts exactly L G / N times,
  its fair share, spaced about N / G rounds apart;
- the candidates are the announcers on the round's majority state whose claim is believable
  (`eligible`): a contribution computed on another state, or claiming beyond belief (`overclaims`),
  cannot count, so it takes no slot;
- nothing a peer says about itself enters the choice: a rule that chose the largest sample claims
  gave a peer claiming 2^40 samples a slot every round (docs/ROBUSTNESS.md). Claims only weigh a
  contribution in its round's mean, capped there at 2x the median (shoal.peer.algorithms.robust), and
  a claim beyond belief strikes its sender, every round it is announced, so that it cannot hold slots
  until its strikes come from the rounds it was chosen in.

A peer whose payload did not count keeps its work only as the optimizers keep it: DeMo's unsent
momentum stays in its momentum; DiLoCo's pseudo-gradient is dropped unless `carry=True` sends it again
with the next (`shoal bench converge --carry` measured re-sending it as worse for both: by the time it
would count it is up to N / G - 1 rounds stale).

Every peer counts G / N of the rounds, whatever its device: a faster peer's contributions weigh
more in the rounds it counts in (their samples), not count more often. Peers that see the same
candidates choose the same set; the exchange decides who the candidates are (the swarm: the
announcements it took, stragglers and banned peers left out), and a candidate set that changes within
a cycle (a peer joined, was banned or straggled) shifts the rotation for the rest of it. Under a
coordinator with `--gather G`, the coordinator applies this rule to the participants it decided and
lists only the chosen, with a tally of every participant's state for the vote
(shoal.coordinator.replies.result_reply); under one without, every peer applies it to the same list.
"""

import hashlib
import math
import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

BELIEVABLE_RATIO = 64.0
"""A sample claim above this times the round's lower-median claim is beyond belief: the contribution is
left out and its sender struck (`overclaim`; three strikes ban it anyway, so keeping it at a capped
weight meanwhile would only serve a liar). Honest peers differ by their devices' speed; a swarm whose
peers differ by more needs a coordinator, which bounds claims by measured throughput."""
TALLY_HOLDERS = 4
"""Holders a coordinator names per state in a round's tally (`RoundResultReply.votes`, with
`--gather`), and the most a peer takes from one: more is another peer's text to dial."""

PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{16,128}")
"""A libp2p peer id as text: base58, of the lengths real ids have (an Ed25519 or RSA key's hash)."""


def is_peer_id(text: object) -> bool:
    """Whether untrusted `text` has the shape of a base58 libp2p peer id."""
    return isinstance(text, str) and PEER_ID.fullmatch(text) is not None


def draw(seed: bytes, round_number: int, key: bytes) -> int:
    """A 64-bit number from (seed, round, key), the same on every peer, unrelated from round to round."""
    digest = hashlib.sha256(b"shoal-gather\0" + seed + b"\0" + round_number.to_bytes(8, "little") + key)
    return int.from_bytes(digest.digest()[:8], "little")


def choose(seed: bytes, round_number: int, candidates: Collection[bytes], limit: int) -> frozenset[bytes]:
    """The keys among `candidates` whose contributions count in `round_number`: all of them when `limit`
    is 0 or there are no more than `limit`; else `limit` of them, by the rotation of the module
    docstring."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if round_number < 0:
        raise ValueError(f"round_number must be >= 0, got {round_number}")
    keys = sorted(set(candidates))
    if limit == 0 or len(keys) <= limit:
        return frozenset(keys)
    cycle, position = divmod(round_number, len(keys) // math.gcd(len(keys), limit))
    order = sorted(keys, key=lambda key: (draw(seed, cycle, key), key))
    start = position * limit
    return frozenset(order[(start + i) % len(keys)] for i in range(limit))


def majority(states: dict[bytes, tuple[bytes, bool]]) -> bytes | None:
    """The state the round's majority holds, from {owner: (state digest, synced)}.

    Only peers that were in sync last round vote, unless none was (a new swarm, or one restarted from
    checkpoints): fresh joiners cannot outvote the swarm. The most votes win; ties go to the smallest
    digest, so every peer that sees the same announcements picks the same state. None if no one
    announced a state.
    """
    return tallied(Counter(states.values()))


def tallied(votes: Mapping[tuple[bytes, bool], int]) -> bytes | None:
    """`majority` from votes already counted: {(state digest, synced): how many announced it}."""
    cast = {key: count for key, count in votes.items() if key[0] and count > 0}
    if any(synced for _, synced in cast):
        cast = {key: count for key, count in cast.items() if key[1]}
    totals: Counter[bytes] = Counter()
    for (digest, _), count in cast.items():
        totals[digest] += count
    if not totals:
        return None
    return min(totals, key=lambda digest: (-totals[digest], digest))


def weighed(
    states: Mapping[bytes, tuple[bytes, bool]], weights: Mapping[bytes, int]
) -> tuple[bytes | None, bool]:
    """(the state the round's earned weight holds, True), from {owner: (state digest, synced)} and the
    voter's {owner: weight}, the votes earned by counted work (shoal.protocol.work: 1 or 0): a
    headcount is bought by whoever runs the most identities, an earned vote only by counted work. Only
    announcers in sync vote while any with weight is; the most weight wins, ties to the smallest
    digest.

    When no announcer of a state weighs anything (a swarm's first round, a joiner that recorded no
    round): (`majority`, False), the headcount, which a peer in sync never follows off its own state
    but by a replay it can check (shoal.peer.swarm.state.decide)."""
    cast = {owner: vote for owner, vote in states.items() if vote[0] and weights.get(owner, 0) > 0}
    if any(synced for _, synced in cast.values()):  # as in `majority`: a peer out of sync knows it
        cast = {owner: vote for owner, vote in cast.items() if vote[1]}
    totals: Counter[bytes] = Counter()
    for owner, (digest, _) in cast.items():
        totals[digest] += weights[owner]
    if totals:
        return min(totals, key=lambda digest: (-totals[digest], digest)), True
    return majority(dict(states)), False


def overclaims(samples: Sequence[float], ratio: float = BELIEVABLE_RATIO) -> list[bool]:
    """Which sample claims exceed `ratio` times the round's lower-median claim (none with fewer than two
    claims: nothing to compare with)."""
    if len(samples) < 2:
        return [False] * len(samples)
    bound = ratio * max(sorted(samples)[(len(samples) - 1) // 2], 1.0)
    return [s > bound for s in samples]


def eligible(
    states: Mapping[bytes, tuple[bytes, bool]],
    claims: Mapping[bytes, float] | None = None,
    weights: Mapping[bytes, int] | None = None,
    own: bytes = b"",
) -> list[bytes]:
    """The keys among {key: (state digest, synced)} that the fan-in chooses among: those on the
    majority's state (`majority`), all of them when no one announced one, less those whose claim in
    `claims` is beyond belief among them (`overclaims`). Neither contribution could count, so its
    announcer takes no slot from one that can: two of six peers announcing a random digest under
    `--gather 2` could otherwise hold a third of the slots, unstruck, for as long as they liked (an
    honest peer out of sync announces another state too, and is not struck for it). With the voter's
    `weights`, the state is the one earned weight holds (`weighed`), or, where none backs any, the
    voter's `own` when it is in sync (a peer in sync keeps it: shoal.peer.swarm.state.decide)."""
    if weights is None:
        agreed = majority(dict(states))
    else:
        agreed, earned = weighed(states, weights)
        agreed = agreed if earned or not own else own
    keys = sorted(key for key, (state, _) in states.items() if agreed is None or state == agreed)
    if not claims:
        return keys
    beyond = overclaims([claims[key] for key in keys])
    return [key for key, over in zip(keys, beyond, strict=True) if not over]
