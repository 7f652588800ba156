"""Coordinate-wise trimmed mean and median in place of shoal's screening, for DiLoCo, in the
`shoal bench hostile` setting (8 loopback workers, the last 2 hostile, `converge --quick`).

    python -m tests.benchmarks.robust_alternatives [--workers 8] [--attackers 2]

DiLoCo's aggregation (`robust.add_screened_mean`) is replaced for the run: per coordinate, the
contributions' values are sorted and the `attackers` largest and smallest dropped (`trimmed`), or all
but the middle one or two (`median`); every contribution counts alike (no sample weights: a sample
lie buys nothing and needs no cap). Prints one JSON line per (aggregation, attack) with honest worker
0's final validation loss and its change against the same aggregation's clean run; compare with
`shoal bench hostile --methods diloco_eager` (BENCHMARKS.md, docs/ROBUSTNESS.md).
"""

import argparse
import json

import torch

from shoal.peer.algorithms import diloco, robust
from shoal.peer.bench import hostile
from shoal.peer.data import stdlib_corpus


def coordinate_wise(trim: int | None):
    """An `add_screened_mean` that adds the mean of each coordinate's values with `trim` dropped from
    each end (None: the median's middle one or two)."""

    def aggregate(into, contributions, policy, suspicion=None, senders=()):
        count = len(contributions)
        cut = (count - 1) // 2 if trim is None else min(trim, (count - 1) // 2)
        for k, mean in enumerate(into):
            values = torch.stack([tensors[k].float() for tensors, _ in contributions]).sort(dim=0).values
            mean.add_(values[cut : count - cut].mean(dim=0))
        median = robust.lower_median([s for _, s in contributions])
        verdict = robust.Screened.of([1.0] * count, [1.0] * count, [None] * count, robust.NONE)
        return float(count * median), verdict  # the weight behind the mean, as if all were the median

    return aggregate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--attackers", type=int, default=2)
    args = parser.parse_args()
    streams = stdlib_corpus()
    for name, trim in (("trimmed", args.attackers), ("median", None)):
        diloco.add_screened_mean = coordinate_wise(trim)
        clean = None
        for attack in ("none", "sign_flip", "sample_lie", "random"):
            result = hostile.run("diloco_eager", attack, args.workers, args.attackers, streams, clean)
            clean = clean or result.final_val_loss
            row = {"aggregation": name, "attack": attack, "final_val_loss": round(result.final_val_loss, 4)}
            row["vs_clean"] = None if result.vs_clean is None else round(result.vs_clean, 4)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
