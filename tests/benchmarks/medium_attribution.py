"""Where the 5.8M-parameter gaps come from (issue 51): chosen points of `shoal bench converge --scale
medium`, each a change of one setting from a swept best, recorded in the sweep's record (resumed from
it) and printed with their curves.

    python -m tests.benchmarks.medium_attribution [--record docs/converge-medium.jsonl] [--only NAME,...]

- eager against standard DiLoCo: the sweep runs each mode at its own outer momentum (`OUTER`:
  standard Nesterov 0.5, eager none); here eager with standard's momentum, the paper's 0.9, and
  standard without momentum;
- DeMo against AdamW-DP, in compression: the reference at its best learning rate sending 4x and 16x
  the coefficients (k = 128, 512 of every 64 x 64 chunk's 4,096); and the sign-descent family DeMo's
  update belongs to, data-parallel Lion, is swept in the medium sweep itself (`lion_dp`);
- the noise of one seed: the best points of AdamW-DP, DeMo reference, standard and sparse DiLoCo
  again with other seeds (the initialization and the batches);
- DeMo against AdamW-DP, in length: both at their best learning rates for twice and four times the
  steps (500 and 1,000; 2.05M and 4.1M tokens), the warmup scaled alike (50 and 100 steps);
- eager against standard DiLoCo, in length: both at their best settings for twice the steps (50
  outer steps instead of 25: whether a round's lateness weighs less over more rounds).
"""

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from shoal.peer.bench import scale

INNER = replace(scale.MEDIUM, adamw_lr=1e-3)
"""DiLoCo's inner AdamW at AdamW-DP's best learning rate, as in the sweep."""
LONG = replace(scale.MEDIUM, steps=500, warmup=50, eval_every=100)
LONGER = replace(scale.MEDIUM, steps=1000, warmup=100, eval_every=100)
INNER_LONG = replace(LONG, adamw_lr=1e-3)
POINTS = {
    "eager_momentum_0.5": ("diloco_eager", INNER, {"outer_lr": 0.7, "outer_momentum": 0.5}),
    "eager_momentum_0.9": ("diloco_eager", INNER, {"outer_lr": 0.4, "outer_momentum": 0.9}),
    "eager_lr0.4_momentum_0.5": ("diloco_eager", INNER, {"outer_lr": 0.4, "outer_momentum": 0.5}),
    "standard_momentum_0": ("diloco_standard", INNER, {"outer_lr": 0.7, "outer_momentum": 0.0}),
    "demo_reference_k128": ("demo_reference", scale.MEDIUM, {"demo_lr": 4e-3, "demo_topk": 128}),
    "demo_reference_k512": ("demo_reference", scale.MEDIUM, {"demo_lr": 4e-3, "demo_topk": 512}),
    "adamw_seed1": ("adamw_dp", scale.MEDIUM, {"adamw_lr": 1e-3, "seed": 1}),
    "demo_reference_seed1": ("demo_reference", scale.MEDIUM, {"demo_lr": 4e-3, "seed": 1}),
    "adamw_seed2": ("adamw_dp", scale.MEDIUM, {"adamw_lr": 1e-3, "seed": 2}),
    "demo_reference_seed2": ("demo_reference", scale.MEDIUM, {"demo_lr": 4e-3, "seed": 2}),
    "standard_seed1": ("diloco_standard", INNER, {"outer_lr": 0.7, "seed": 1}),
    "sparse_seed1": ("diloco_sparse", INNER, {"outer_lr": 2.0, "seed": 1}),
    "adamw_500": ("adamw_dp", LONG, {"adamw_lr": 1e-3}),
    "demo_reference_500": ("demo_reference", LONG, {"demo_lr": 4e-3}),
    "standard_500": ("diloco_standard", INNER_LONG, {"outer_lr": 0.7}),
    "eager_500": ("diloco_eager", INNER_LONG, {"outer_lr": 0.4, "outer_momentum": 0.5}),
    "adamw_1000": ("adamw_dp", LONGER, {"adamw_lr": 1e-3}),
    "demo_reference_1000": ("demo_reference", LONGER, {"demo_lr": 4e-3}),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, default=Path("docs/converge-medium.jsonl"))
    parser.add_argument("--only", help="comma-separated point names (default: all, in order)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(POINTS)
    unknown = set(names) - set(POINTS)
    if unknown:
        parser.error(f"--only: unknown {', '.join(sorted(unknown))} (choose of {', '.join(POINTS)})")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // scale.MEDIUM.workers))
    streams = scale.medium_corpus()
    done = scale.load_record(args.record)
    rows = []
    for name in names:
        method, base, change = POINTS[name]
        config = replace(base, **change)
        key = scale.run_key(method, config, streams.digest)
        run = done.get(key) or scale._record(args.record, key, method, config, scale.MEDIUM, streams)
        done[key] = run
        rows.append(
            {
                "point": name,
                "method": method,
                "steps": config.steps,
                **change,
                "val_loss": run.final_val_loss,
                "curve": [round(c[2], 4) for c in run.curve],
            }
        )
        print(
            f"{name:<26} {method:<16} steps {config.steps:>5}  val loss {run.final_val_loss:.4f}  "
            f"curve {' '.join(f'{c[2]:.3f}' for c in run.curve)}",
            flush=True,
        )
    print(json.dumps({"points": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
