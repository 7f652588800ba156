"""Coordinate-wise trimmed mean and median, centered clipping, and a direction-consistency score
kept over rounds, for DiLoCo, in the `shoal bench hostile` setting (8 loopback workers, the last 2
hostile, `converge --quick`).

    python -m tests.benchmarks.robust_alternatives [--workers 8] [--attackers 2] [--attacks ...]

DiLoCo's aggregation (`robust.add_screened_mean`) is replaced for the run: per coordinate, the
contributions' values are sorted and the `attackers` largest and smallest dropped (`trimmed`), or all
but the middle one or two (`median`); or centered clipping (Karimireddy, He and Jaggi, ICML 2021):
from the coordinate-wise median, `CLIP_ITERATIONS` times, move by the mean of each contribution's
offset clipped to the lower-median offset's length (`centered`). Every contribution counts alike (no
sample weights: a sample lie buys nothing and needs no cap). `consistency` keeps shoal's screening and
adds a score over rounds before it (`consistency`); `screening` is shoal's alone, timed alike. Prints
one JSON line per (aggregation, attack) with honest worker 0's final validation loss, its change
against the same aggregation's clean run, the aggregation's mean milliseconds a round and the honest
workers' reports; compare with `shoal bench hostile --methods diloco_eager` (BENCHMARKS.md,
docs/ROBUSTNESS.md).
"""

import argparse
import json
import time

import torch

from shoal.peer.algorithms import diloco, robust
from shoal.peer.bench import hostile
from shoal.peer.data import stdlib_corpus

CLIP_ITERATIONS = 3
CONSISTENCY_RATIO = 1.4
"""consistency's bound, times the round's median score: honest DiLoCo deviations persist across rounds
(median score 0.50 in a clean run, against about 0.35 for independent ones at a window of 8), "a little
is enough" scores 0.91 (`--aggregations consistency --attacks alie`)."""
SECONDS: list[float] = []  # per round, the aggregation's time
SCORES: list[tuple[bytes, float]] = []  # consistency's scores, (sender, score) per judged contribution


def _timed(combine):
    """An `add_screened_mean` that adds `combine(list of flat contributions)` (one flat tensor) to
    `into`, with every contribution weighing alike."""

    def aggregate(into, contributions, policy, suspicion=None, senders=(), reference=None):
        start = time.perf_counter()
        count = len(contributions)
        flat = torch.stack([torch.cat([t.float().reshape(-1) for t in parts]) for parts, _ in contributions])
        combined, offset = combine(flat), 0
        for mean in into:
            mean.add_(combined[offset : offset + mean.numel()].view_as(mean))
            offset += mean.numel()
        SECONDS.append(time.perf_counter() - start)
        median = robust.lower_median([s for _, s in contributions])
        verdict = robust.Screened.of([1.0] * count, [1.0] * count, [None] * count, robust.NONE)
        return float(count * median), verdict  # the weight behind the mean, as if all were the median

    return aggregate


def coordinate_wise(trim: int | None):
    """The mean of each coordinate's values with `trim` dropped from each end (None: the median's
    middle one or two)."""

    def combine(flat: torch.Tensor) -> torch.Tensor:  # (contributions, numel)
        count = flat.shape[0]
        cut = (count - 1) // 2 if trim is None else min(trim, (count - 1) // 2)
        return flat.sort(dim=0).values[cut : count - cut].mean(dim=0)

    return _timed(combine)


def centered_clipping():
    """Centered clipping from the coordinate-wise median, the radius the lower-median offset."""

    def combine(flat: torch.Tensor) -> torch.Tensor:
        center = flat.median(dim=0).values
        for _ in range(CLIP_ITERATIONS):
            offsets = flat - center
            lengths = offsets.norm(dim=1)
            radius = robust.lower_median(lengths.tolist())
            scales = (radius / lengths.clamp(min=1e-30)).clamp(max=1.0)
            center = center + (offsets * scales[:, None]).mean(dim=0)
        return center

    return _timed(combine)


def consistency(window: int = 8, floor: float = 0.5, ratio: float = CONSISTENCY_RATIO, sketch: int = 4096):
    """shoal's screening, then a direction-consistency score kept over rounds: per sender, the length
    of the mean of its last `window` unit deviations from the round's screened mean (each projected
    to `sketch` numbers by a fixed count sketch, so a sender's record is `window` x `sketch` floats
    whatever the model's size). Deviations that point anywhere average out (about 1 / sqrt(window));
    a sender that pushes one way every round ("a little is enough", colluders) keeps its length. From
    its third round, a sender whose score exceeds both `floor` and `ratio` times the round's median
    score is left out (`inconsistent`), judged on its earlier rounds, before the round's mean."""
    original = robust.add_screened_mean
    history: dict[tuple[int, bytes], list[torch.Tensor]] = {}
    hashing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def sketched(rows: torch.Tensor) -> torch.Tensor:  # (count, numel) -> (count, sketch)
        numel = rows.shape[1]
        if numel not in hashing:
            generator = torch.Generator().manual_seed(numel)
            buckets = torch.randint(sketch, (numel,), generator=generator)
            signs = torch.randint(2, (numel,), generator=generator).float() * 2 - 1
            hashing[numel] = buckets, signs
        buckets, signs = hashing[numel]
        return torch.zeros(rows.shape[0], sketch).index_add_(1, buckets, rows * signs)

    def aggregate(into, contributions, policy, suspicion=None, senders=(), reference=None):
        start = time.perf_counter()
        keys = [(id(suspicion), sender) for sender in senders]
        scores = []
        for key in keys:
            recent = history.get(key, [])
            scores.append(torch.stack(recent).mean(dim=0).norm().item() if len(recent) >= 2 else None)
        SCORES.extend((sender, score) for sender, score in zip(senders, scores, strict=True) if score)
        known = [score for score in scores if score is not None]
        bound = max(floor, ratio * robust.lower_median(known)) if known else None
        left_out = [bound is not None and score is not None and score > bound for score in scores]
        kept = [pair for pair, out in zip(contributions, left_out, strict=True) if not out]
        kept_senders = [sender for sender, out in zip(senders, left_out, strict=True) if not out]
        total, inner = original(into, kept, policy, suspicion, kept_senders, reference)
        mean = torch.cat([m.float().reshape(-1) for m in into])
        flat = torch.stack([torch.cat([t.float().reshape(-1) for t in parts]) for parts, _ in contributions])
        deviations = flat - mean
        units = sketched(deviations / deviations.norm(dim=1, keepdim=True).clamp(min=1e-30))
        for key, unit in zip(keys, units, strict=True):
            history[key] = [*history.get(key, []), unit][-window:]
        SECONDS.append(time.perf_counter() - start)
        verdicts = iter(zip(inner.factors, inner.weights, inner.reasons, inner.cosines, strict=True))
        rows = [(0.0, 0.0, "inconsistent", None) if out else next(verdicts) for out in left_out]
        factors, weights, reasons, cosines = (list(column) for column in zip(*rows, strict=True))
        return total, robust.Screened(factors, weights, inner.clipped, reasons, cosines)

    return aggregate


def screening():
    """shoal's own screening, timed alike: the reference row."""
    original = robust.add_screened_mean

    def aggregate(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        SECONDS.append(time.perf_counter() - start)
        return result

    return aggregate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--attacks", default="sign_flip,sample_lie,random,alie,collude")
    parser.add_argument("--aggregations", default="trimmed,median,centered,consistency,screening")
    args = parser.parse_args()
    streams = stdlib_corpus()
    aggregations = {  # made anew for each run: consistency's record is the run's
        "trimmed": lambda: coordinate_wise(args.attackers),
        "median": lambda: coordinate_wise(None),
        "centered": centered_clipping,
        "consistency": consistency,
        "screening": screening,
    }
    for name in args.aggregations.split(","):
        clean = None
        for attack in ("none", *args.attacks.split(",")):
            diloco.add_screened_mean = aggregations[name]()
            SECONDS.clear()
            SCORES.clear()
            result = hostile.run("diloco_eager", attack, args.workers, args.attackers, streams, clean)
            clean = clean or result.final_val_loss
            row = {"aggregation": name, "attack": attack, "final_val_loss": round(result.final_val_loss, 4)}
            row["vs_clean"] = None if result.vs_clean is None else round(result.vs_clean, 4)
            row["aggregate_ms"] = round(1000 * sum(SECONDS) / max(len(SECONDS), 1), 2)
            row["reports_on_attackers"] = result.reports_on_attackers
            row["reports_on_honest"] = result.reports_on_honest
            if SCORES:  # the median score of honest senders' contributions and of the attackers'
                ranks = range(args.workers - args.attackers, args.workers)
                attackers = {rank.to_bytes(4, "big") for rank in ranks}
                for side, mine in (("honest", False), ("attackers", True)):
                    scores = [score for sender, score in SCORES if (sender in attackers) == mine]
                    if scores:  # each side's lowest, median and highest
                        scores.sort()
                        picks = (scores[0], robust.lower_median(scores), scores[-1])
                        row[f"score_{side}"] = [round(score, 3) for score in picks]
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
