"""How much consecutive DiLoCo rounds agree: the cosine between one round's mean pseudo-gradient and
the next's, and their norms, in a standard run of `shoal bench converge`'s setting. The eager outer
update stands the last round's mean in for the other workers' current one, so it is only as good as
this agreement (BENCHMARKS.md, issue 3).

    python -m tests.benchmarks.outer_agreement [--full] [--outer-lr 0.4] [--outer-momentum 0.9]
        [--batch-size 64]

Prints one JSON object: the final validation loss, the cosines and the norms (worker 0).
"""

import argparse
import dataclasses
import itertools
import json

import torch

from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.hooks import NO_HOOKS, Hooks
from shoal.peer.bench import converge
from shoal.peer.data import stdlib_corpus


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--full", action="store_true", help="the full setting (default: --quick's)")
    parser.add_argument("--outer-lr", type=float, default=0.4)  # as measured in BENCHMARKS.md
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument(
        "--batch-size", type=int, help="sequences per worker and step (default: the setting's)"
    )
    args = parser.parse_args()
    config = converge.FULL if args.full else converge.QUICK
    config = dataclasses.replace(config, outer_lr=args.outer_lr, outer_momentum=args.outer_momentum)
    if args.batch_size:
        config = dataclasses.replace(config, batch_size=args.batch_size)
    directions: list[torch.Tensor] = []

    class Recording(Hooks):  # shoal.peer.algorithms.hooks
        def outer_direction(self, optimizer, direction, global_step):
            if global_step and optimizer.exchange.rank == 0:  # the mean each standard outer step applies
                directions.append(torch.cat([d.detach().flatten().float().cpu() for d in direction]))

    DiLoCo.hooks = Recording()
    try:
        result = converge.run_method("diloco_standard", config, stdlib_corpus())
    finally:
        DiLoCo.hooks = NO_HOOKS
    cosines = [
        torch.nn.functional.cosine_similarity(a, b, dim=0).item() for a, b in itertools.pairwise(directions)
    ]
    print(
        json.dumps(
            {
                "final_val_loss": result.final_val_loss,
                "cosine": [round(c, 3) for c in cosines],
                "norm": [round(d.norm().item(), 3) for d in directions],
            }
        )
    )


if __name__ == "__main__":
    main()
