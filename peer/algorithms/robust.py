"""Bounding what one participant can do to a round (docs/ROBUSTNESS.md has the threat model).

Four rules, applied in this order to a round's decoded contributions, all pure functions of numbers
that every participant computes alike from the same contributions in the same order (so replicas
stay identical):

1. **Weights are capped**: a contribution's weight is its claimed sample count, at most
   `sample_ratio` times the round's lower-median count. A peer cannot buy the round by lying.
2. **Norms are bounded**: a contribution whose norm exceeds `norm_ratio` times the round's lower
   median norm is scaled down to it. At the default ratio 1, no contribution is larger than the
   median one: an attacker has at most one honest peer's weight and length.
3. **Opposed directions are dropped**: each contribution's agreement is the median of its cosines
   with each other contribution (`agreements`); one below `min_agreement` (default 0: pointing away
   from most of the round) is left out of the round and reported as `opposed`, which strikes its
   sender in the swarm. Judged only with at least `min_screened` contributions.
4. **Persistent outliers are left out**: `Suspicion` keeps each sender's recent agreements; a sender
   whose mean over the last `suspect_window` rounds is below `suspect_below`, or below
   `suspect_relative` times the round's lower-median mean (of the senders judged that round), is
   left out and reported as an `outlier` every round until it is not, so the swarm strikes and then
   bans it. The first bound catches an opposed sender, the second one that sends noise: random
   directions agree with nothing (a mean near 0), while honest peers agree with each other. Outliers
   do not vote on the others: neither in this round's median nor, read again, in the rounds each
   record keeps (`Suspicion`), so attackers chosen together with honest peers cannot make them look
   opposed.

Rule 3 suits DiLoCo's dense pseudo-gradients, which agree strongly. Top-k payloads overlap little:
DeMo's momenta, and DiLoCo's pseudo-gradients under `--compression sparse` (median cosine 0.10
against 0.58 dense, in `shoal bench converge --quick`; below 0 for every peer on random data). Their
cosines are small, so a single round cannot tell a sign-flipper from an honest peer: these drop
nothing per round by default, and rule 4 tells them apart over a few rounds (docs/ROBUSTNESS.md has
the figures).

The cosines come from the round's Gram matrix (every pair's dot product: N^2 / 2 of them, sparse ones
for DeMo), read with one host sync per round.
"""

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from shoal.peer.algorithms import canonical
from shoal.protocol.rules import overclaims

if TYPE_CHECKING:
    from shoal.compression.dct_topk import TopKCoefficients
    from shoal.peer.algorithms.exchange import Contribution, Exchange

DEFAULT_CLIP_RATIO = 1.0
DEFAULT_SAMPLE_RATIO = 2.0
DEFAULT_MIN_AGREEMENT = 0.0
SHARED_MEDIAN_FROM = 3
"""Fewest contributions whose median of each other's cosines judges a round (with two, each opposes
the other, or two attackers agree); below, only each participant's own update does (`Reference`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Robustness:
    """How a round bounds each contribution; `Robustness()` is the swarm's default."""

    norm_ratio: float | None = DEFAULT_CLIP_RATIO
    """Norms above this times the round's median are scaled down to it (>= 1); None: unbounded."""
    sample_ratio: float | None = DEFAULT_SAMPLE_RATIO
    """Sample weights above this times the round's median are capped to it (>= 1); None: uncapped."""
    min_agreement: float | None = DEFAULT_MIN_AGREEMENT
    """Contributions whose leave-one-out cosine is below this (in [-1, 1)) are dropped; None: never."""
    min_screened: int = 3
    """Fewest contributions in a round for agreement to be judged (with two, each opposes the other)."""
    suspect_below: float | None = 0.0
    """A sender whose mean cosine over its last `suspect_window` rounds is below this is reported as
    an `outlier`; None: never."""
    suspect_relative: float | None = 0.15
    """A sender whose mean cosine is below this fraction of the round's lower-median mean is reported
    as an `outlier` too (in [0, 1)); None: never."""
    suspect_window: int = 8
    """Rounds of a sender's cosines that `suspect_below` and `suspect_relative` average."""
    suspect_after: int = 3
    """Fewest rounds of a sender seen before it can be reported."""

    def __post_init__(self) -> None:
        if self.norm_ratio is not None and not self.norm_ratio >= 1:
            raise ValueError(f"norm_ratio must be >= 1, got {self.norm_ratio}")
        if self.sample_ratio is not None and not self.sample_ratio >= 1:
            raise ValueError(f"sample_ratio must be >= 1, got {self.sample_ratio}")
        if self.min_agreement is not None and not -1 <= self.min_agreement < 1:
            raise ValueError(f"min_agreement must be in [-1, 1), got {self.min_agreement}")
        if self.min_screened < 3:
            raise ValueError(
                f"min_screened must be >= 3 (with two, each opposes the other), got {self.min_screened}"
            )
        if self.suspect_relative is not None and not 0 <= self.suspect_relative < 1:
            raise ValueError(f"suspect_relative must be in [0, 1), got {self.suspect_relative}")
        if not 1 <= self.suspect_after <= self.suspect_window:
            raise ValueError(
                f"suspect_after ({self.suspect_after}) must be in [1, suspect_window ({self.suspect_window})]"
            )

    @property
    def suspects(self) -> bool:
        """Whether senders are judged over their recent rounds (rule 4)."""
        return self.suspect_below is not None or self.suspect_relative is not None

    @property
    def judges(self) -> bool:
        """Whether contributions' directions are computed at all."""
        return self.min_agreement is not None or self.suspects


DILOCO = Robustness()
"""DiLoCo's default among untrusted participants (the swarm)."""
DEMO = Robustness(min_agreement=None)
"""DeMo's default among untrusted participants (the swarm), no per-round drop (see the module docstring)."""
DILOCO_SPARSE = DEMO
"""DiLoCo's default among untrusted participants with a top-k codec: as DeMo's, for the same reason (see
the module docstring)."""
NONE = Robustness(
    suspect_below=None, suspect_relative=None, norm_ratio=None, sample_ratio=None, min_agreement=None
)
"""No screening: the reference semantics, DeMo's and DiLoCo's default among trusted participants
(loopback, torch.distributed: `default_for`)."""


def default_for(exchange: "Exchange", untrusted: Robustness) -> Robustness:
    """The screening of an optimizer given no `robust=`: `NONE` over an exchange whose participants are
    trusted (`Exchange.trusted`: LoopbackExchange, TorchDistributedExchange), else `untrusted` (the
    swarm: the optimizer's own default)."""
    return NONE if exchange.trusted else untrusted


def lower_median(values: Sequence[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


def clip_scales(norms: Sequence[float], ratio: float | None = DEFAULT_CLIP_RATIO) -> list[float]:
    """Per contribution, the factor that brings its norm down to `ratio` times the round's lower median
    of the non-zero norms (1.0 when it is already below, or when `ratio` is None). Empty contributions
    do not lower the median: sent to pull it to 0, they would cancel every other one."""
    positive = [norm for norm in norms if norm > 0]
    if ratio is None or not positive:
        return [1.0] * len(norms)
    if not ratio >= 1:
        raise ValueError(f"clip ratio must be >= 1, got {ratio}")
    bound = ratio * lower_median(positive)
    return [bound / norm if norm > bound else 1.0 for norm in norms]


def capped_weights(samples: Sequence[float], ratio: float | None = DEFAULT_SAMPLE_RATIO) -> list[float]:
    """Sample weights, each at most `ratio` times the round's lower median (unchanged when None)."""
    if ratio is None or not samples:
        return [float(s) for s in samples]
    bound = ratio * lower_median(samples)
    return [float(min(s, bound)) for s in samples]


MAX_VOTES = 64
"""Most votes of one round kept in a sender's record: a round of more contributions than this plus one
is kept as each one's agreement alone (as without votes)."""

Record = float | tuple[np.ndarray, np.ndarray]
"""One round of a sender's record: its agreement (judged by the own update alone), or each other
sender's vote, (the voters' ids, its cosines with them), read again when the voters' standing
changes: at most `MAX_VOTES` of 16 bytes (4,096 senders' windows of rounds of 65 hold 45 MiB)."""


class Suspicion:
    """Per sender, the cosines of its last `policy.suspect_window` rounds (see rule 4); local to a
    participant, like the swarm's strikes.

    A round judged by the shared median keeps each voter's cosine, not only their median: a sender's
    agreement in a past round is the median of the votes of those not now outliers, read anew each
    round. Two attackers chosen with two honest peers (`--gather 4`, 2 of 8) are two of an honest DeMo
    contribution's three votes, in the rounds before they are known as well as after, and the honest
    contribution's record would carry those rounds for `suspect_window` rounds: 4-5% of honest
    contributions were reported as outliers (`shoal bench hostile`). Once the attackers are outliers,
    the honest record is as if they had never voted."""

    def __init__(self, policy: Robustness, max_senders: int = 4096):
        self.policy, self.max_senders = policy, max_senders
        self._recent: dict[bytes, deque[Record]] = {}
        self._ids: dict[bytes, int] = {}
        """Each sender with a record, by a number never given twice (a forgotten one's votes in other
        records then belong to nobody: trusted, as any voter not an outlier)."""
        self._issued = 0
        self._outlying: set[int] = set()

    def suspected(self, senders: Sequence[bytes]) -> list[bool]:
        """Which senders are outliers by their latest verdict: they do not vote on the others'
        directions this round (`agreements`' `suspects`)."""
        return [self._ids.get(sender, -1) in self._outlying for sender in senders]

    def outliers(
        self,
        senders: Sequence[bytes],
        cosines: Sequence[float | None],
        votes: Sequence[dict[bytes, float] | None] | None = None,
    ) -> list[bool]:
        """Records a round's cosines (with `votes`, each sender's cosine with each voter, which its
        record keeps instead); returns which senders are outliers now."""
        policy = self.policy
        if not policy.suspects:
            return [False] * len(senders)
        for sender in senders:
            if sender not in self._recent:
                if len(self._recent) >= self.max_senders:  # bounded: the oldest sender is forgotten
                    forgotten = next(iter(self._recent))
                    del self._recent[forgotten]
                    self._outlying.discard(self._ids.pop(forgotten))
                self._recent[sender] = deque(maxlen=policy.suspect_window)
                self._ids[sender], self._issued = self._issued, self._issued + 1
        ids: np.ndarray | list[int]
        for index, (sender, cosine) in enumerate(zip(senders, cosines, strict=True)):
            vote = votes[index] if votes is not None else None
            record: Record | None = cosine
            if vote:
                ids = np.array([self._ids.get(voter, -1) for voter in vote], dtype=np.int64)
                record = ids, np.array(list(vote.values()), dtype=np.float64)
            if record is not None:
                self._recent[sender].append(record)
        # who votes changes the means: the round's senders are found out one at a time, the lowest mean
        # first, and each one found no longer votes on the others (an honest record that two attackers
        # pulled below the bound recovers once they are out, before it is judged itself)
        ids = [self._ids[sender] for sender in senders]
        self._outlying.difference_update(ids)
        while True:
            outlying = np.fromiter(self._outlying, dtype=np.int64, count=len(self._outlying))
            means = [self._mean(self._recent[sender], outlying) for sender in senders]
            verdicts = self._beyond(means)
            candidates = [
                (mean, index)
                for index, (mean, out) in enumerate(zip(means, verdicts, strict=True))
                if out and mean is not None and ids[index] not in self._outlying
            ]
            if not candidates:
                return verdicts
            self._outlying.add(ids[min(candidates)[1]])

    @staticmethod
    def _agreement(record: Record, outlying: np.ndarray) -> float:
        if not isinstance(record, tuple):
            return float(record)
        voters, cosines = record
        trusted = cosines[~np.isin(voters, outlying)]
        trusted = np.sort(trusted if len(trusted) else cosines)
        return float(trusted[(len(trusted) - 1) // 2])

    def _mean(self, recent: "deque[Record]", outlying: np.ndarray) -> float | None:
        if len(recent) < self.policy.suspect_after:
            return None
        return sum(self._agreement(record, outlying) for record in recent) / len(recent)

    def _beyond(self, means: Sequence[float | None]) -> list[bool]:
        policy = self.policy
        judged = [mean for mean in means if mean is not None]
        bounds = [] if policy.suspect_below is None else [policy.suspect_below]
        if policy.suspect_relative is not None and judged:
            bounds.append(policy.suspect_relative * lower_median(judged))
        return [mean is not None and any(mean < bound for bound in bounds) for mean in means]


@dataclass(frozen=True, slots=True)
class Screened:
    """A round's verdict, per contribution in round order."""

    factors: list[float]
    """What multiplies each contribution in the round's weighted sum: capped weight times norm scale,
    0 for a left-out one."""
    weights: list[float]
    """Capped sample weights, 0 for a left-out one (a mean divides by their sum)."""
    clipped: int
    """How many of those kept were scaled down."""
    reasons: list[str | None]
    """Why each was left out: `opposed` (this round), `outlier` (its recent rounds), or None (kept)."""
    cosines: list[float | None]
    """Each one's agreement with the others (None: not judged)."""

    @property
    def dropped(self) -> list[bool]:
        return [reason is not None for reason in self.reasons]

    @staticmethod
    def of(
        weights: list[float],
        scales: list[float],
        cosines: list[float | None],
        policy: Robustness,
        outliers: Sequence[bool] | None = None,
        overclaimed: Sequence[bool] = (),
    ) -> "Screened":
        bound = policy.min_agreement
        reasons = [
            "overclaim"
            if over
            else "opposed"
            if bound is not None and c is not None and c < bound
            else "outlier"
            if out
            else None
            for c, out, over in zip(
                cosines,
                outliers or [False] * len(cosines),
                overclaimed or [False] * len(cosines),
                strict=True,
            )
        ]
        kept = [reason is None for reason in reasons]
        return Screened(
            [w * s if k else 0.0 for w, s, k in zip(weights, scales, kept, strict=True)],
            [w if k else 0.0 for w, k in zip(weights, kept, strict=True)],
            sum(s < 1 for s, k in zip(scales, kept, strict=True) if k),
            reasons,
            cosines,
        )


@dataclass(frozen=True, slots=True)
class Reference:
    """This participant's own update of the round: one more vote on every contribution's direction.
    Every honest participant has one, computed on the same model, whether or not its payload counts.

    It lets a round too small for the median of the others (fewer than `min_screened` contributions:
    a bounded fan-in of 2, a swarm of 2) be judged at all, and it breaks the tie of a round that is
    half hostile (2 attackers chosen among 4 under `--gather 4`: every honest contribution then had a
    lower median below 0, and honest peers struck each other as `opposed`). Each participant's
    reference differs, so in a round large enough for the shared median it decides only the round's
    `opposed` (`judged`): suspicion, built on cosines near 0 for DeMo, keeps the shared figures that
    every participant computes alike. The optimizers pass one only under a bounded fan-in, where a
    round is small by the fan-in's choice and an attacker would otherwise be judged by nothing in the
    rounds it is chosen: a swarm of two has no majority to protect, and there two honest DeMo peers,
    whose cosines are near 0, judged each other by their own updates and parted by suspicion."""

    update: "Sequence[torch.Tensor] | Sequence[TopKCoefficients]"
    """The update, as the contributions are (dense tensors, or for DeMo its top-k selections)."""


def pair_cosine(gram: Sequence[Sequence[float]], i: int, j: int) -> float:
    """The cosine of contributions i and j from the round's Gram matrix (both of some length)."""
    return gram[i][j] / math.sqrt(gram[i][i] * gram[j][j])


def agreements(
    gram: Sequence[Sequence[float]], reference: bool = False, suspects: Sequence[bool] = ()
) -> list[float | None]:
    """Per contribution, the median of its cosines with each of the others, from the round's Gram
    matrix (gram[i][j] = <c_i, c_j>). A median, not the cosine with the others' sum: attackers, fewer
    than half of the others, cannot drag an honest contribution's figure below zero, however large or
    many their votes; the lower median of an even count, so that a tie counts against.

    With `reference`, the last row of `gram` is this participant's own update (`Reference`), one more
    vote on every contribution (its own included: their cosine is about 1), and a tie counts for: the
    upper median. An honest contribution then agrees while attackers are at most half of the round,
    and an attacker, opposed by the honest ones and the reference, is below zero. In a round of fewer
    than `SHARED_MEDIAN_FROM` contributions the reference's vote is the only one.

    `suspects` (per contribution: its sender is an outlier by its earlier rounds, `Suspicion.suspected`)
    do not vote on the others while anyone else does: two attackers chosen among 4 under `--gather 4`
    would otherwise be two of an honest DeMo contribution's three votes in every round they share,
    and honest peers were reported as outliers (4-5% of their contributions). A suspect is still
    judged, by the others.

    None for a contribution with no direction, or nothing to judge it by."""
    count = len(gram) - reference
    # a round of two may be all hostile (two attackers chosen together under `--gather 2`): there the
    # reference alone judges, or the attackers would vote for each other and win the tie
    voters = [count] if reference and count < SHARED_MEDIAN_FROM else range(len(gram))
    trusted = [j for j in voters if j >= count or not (suspects and suspects[j])]
    cosines: list[float | None] = []
    for i in range(count):
        judges = [j for j in trusted if j != i and gram[j][j] > 0]
        if not judges:  # nobody but suspects to judge it: all of them, as without suspects
            judges = [j for j in voters if j != i and gram[j][j] > 0]
        pairs = sorted(pair_cosine(gram, i, j) for j in judges if gram[i][i] > 0)
        cosines.append(pairs[len(pairs) // 2 if reference else (len(pairs) - 1) // 2] if pairs else None)
    return cosines


def directions_judged(policy: Robustness, count: int, reference: "Reference | None") -> bool:
    """Whether the directions of a round of `count` contributions are judged: with a reference, from
    one contribution; without, from `policy.min_screened` (with two, each opposes the other)."""
    return policy.judges and count >= (1 if reference is not None else policy.min_screened)


def screen(
    contributions: Sequence[Sequence[torch.Tensor]],
    samples: Sequence[float],
    policy: Robustness,
    suspicion: "Suspicion | None" = None,
    senders: Sequence[bytes] = (),
    reference: Reference | None = None,
) -> Screened:
    """Applies `policy` to dense contributions (each a list of tensors, same shapes in every one);
    with `suspicion`, the persistent outliers among `senders` are left out too; a `reference` votes on
    every direction (`agreements`)."""
    weights = capped_weights(samples, policy.sample_ratio)
    count = len(contributions)
    judging = directions_judged(policy, count, reference)
    if count < 2 and not judging:
        return Screened.of(weights, [1.0] * count, [None] * count, policy, overclaimed=overclaims(samples))
    by_reference = judging and reference is not None
    rows = (
        # with `by_reference`, `reference` is not None, and dense as the contributions are
        [*contributions, cast("Sequence[torch.Tensor]", cast(Reference, reference).update)]
        if by_reference
        else list(contributions)
    )
    # in a fixed order, so that every device decides alike and scales by the same factors
    gram = canonical.gram(rows, diagonal_only=not judging)
    return judged(gram, weights, policy, suspicion, senders, samples, judging, by_reference)


def judged(
    gram: list[list[float]],
    weights: list[float],
    policy: Robustness,
    suspicion: "Suspicion | None" = None,
    senders: Sequence[bytes] = (),
    samples: Sequence[float] = (),
    judging: bool = False,
    by_reference: bool = False,
) -> Screened:
    """The verdict from a round's Gram matrix (only its diagonal, the squared norms, unless `judging`
    directions) and capped weights; `suspicion` records the cosines of `senders`. With `by_reference`,
    the Gram matrix has one more row, the reference's (`agreements`). Contributions with no length (an
    empty update: nothing to add) weigh nothing; `samples`, the raw claims, mark the ones beyond
    belief."""
    count = len(weights)
    norms = [math.sqrt(max(gram[i][i], 0.0)) for i in range(count)]
    scales = clip_scales(norms, policy.norm_ratio)
    weights = [w if norm > 0 else 0.0 for w, norm in zip(weights, norms, strict=True)]
    # the median of the others is the same on every participant; the reference's vote is not (each
    # has its own update), so it decides only this round's `opposed`, where honest directions are far
    # from the border, and the record of suspicion only in a round too small for the shared median
    shared = votes = None
    suspects = suspicion.suspected(senders) if judging and suspicion is not None else ()
    if judging and count >= policy.min_screened:
        shared = agreements([row[:count] for row in gram[:count]], suspects=suspects)
        votes = pair_votes(gram, senders) if suspicion is not None else None
    voted = agreements(gram, reference=True, suspects=suspects) if judging and by_reference else None
    opposing = voted or shared or [None] * count
    outliers = suspicion.outliers(senders, shared or opposing, votes) if suspicion is not None else None
    return Screened.of(weights, scales, opposing, policy, outliers, overclaims(samples) if samples else ())


def pair_votes(gram: Sequence[Sequence[float]], senders: Sequence[bytes]) -> list[dict[bytes, float] | None]:
    """Per contribution of a round, each other sender's cosine with it (from the Gram matrix's first
    `len(senders)` rows), for `Suspicion`'s record; None for one with no direction, or a round past
    `MAX_VOTES` (kept as its median alone)."""
    count = len(senders)
    if count - 1 > MAX_VOTES:
        return [None] * count
    return [
        {senders[j]: pair_cosine(gram, i, j) for j in range(count) if j != i and gram[j][j] > 0} or None
        if gram[i][i] > 0
        else None
        for i in range(count)
    ]


def add_screened_mean(
    into: Sequence[torch.Tensor],
    contributions: Sequence[tuple[Sequence[torch.Tensor], int]],
    policy: Robustness,
    suspicion: "Suspicion | None" = None,
    senders: Sequence[bytes] = (),
    reference: Reference | None = None,
) -> tuple[float, Screened]:
    """Adds to `into` the screened, sample-weighted mean of `contributions`, (tensors, samples) pairs
    in the round's order (the same sums on every participant). Returns (the weight behind it, the
    verdict)."""
    tensors: Sequence[Sequence[torch.Tensor]] | Sequence[torch.Tensor]  # all of them, then one's
    tensors, samples = [t for t, _ in contributions], [s for _, s in contributions]
    verdict = screen(tensors, samples, policy, suspicion, senders, reference)
    total = sum(verdict.weights)
    if total > 0:
        for (tensors, _), factor in zip(contributions, verdict.factors, strict=True):
            if factor:
                for m, t in zip(into, tensors, strict=True):
                    canonical.add_scaled_(m, t, factor / total)  # no fused multiply-add
    return total, verdict


def sender_keys(contributions: Sequence["Contribution"]) -> list[bytes]:
    """Who sent each contribution, as `Suspicion` keys them (an exchange's rank when it has no keys)."""
    return [c.sender or c.rank.to_bytes(4, "big") for c in contributions]


def report(
    exchange: "Exchange", contributions: Sequence["Contribution"], verdict: Screened, counts: Counter[str]
) -> None:
    """Tells the exchange (which strikes senders) of the contributions left out, and counts them."""
    for contribution, reason in zip(contributions, verdict.reasons, strict=True):
        if reason is not None:
            counts[reason] += 1
            exchange.reject(contribution, reason)


def finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every value of `tensors` is finite (none: True), with one host sync.

    NaN propagates through a maximum, and an infinity is one, so each tensor's extremes tell. On a
    GPU its largest magnitude, one multi-tensor kernel for all (`torch._foreach_norm`, inf); on other
    devices its minimum and maximum in one pass each (aminmax: 8x faster there than `isfinite`, whose
    boolean copy of every tensor dominated the DeMo step's checks on the CPU)."""
    floating = [t for t in tensors if t.is_floating_point() and t.numel()]
    if not floating:
        return True
    if floating[0].device.type == "cuda":
        extremes = torch.stack(torch._foreach_norm(floating, float("inf")))
    else:
        extremes = torch.stack([torch.stack(torch.aminmax(t)) for t in floating])
    return bool(torch.isfinite(extremes).all())
