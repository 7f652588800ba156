"""Scoring each contribution by the loss change it causes (the idea of Templar's Gauntlet, arXiv
2505.21684) in place of shoal's screening, for DiLoCo, in the `shoal bench hostile` setting (8
loopback workers, the last 2 hostile, `converge --quick`).

    python -m tests.benchmarks.gauntlet [--workers 8] [--attackers 2] [--batch 8]

DiLoCo's aggregation (`robust.add_screened_mean`) is replaced for the run (`DiLoCo.hooks`,
shoal.peer.algorithms.hooks). Each round, every worker
scores every contribution: the loss of one fixed batch (the same on every worker, so that every
worker keeps the same set) at the consensus parameters, minus the loss after an outer SGD step along
that contribution alone. Contributions that lower the loss are kept, with sample weights capped at
twice the round's lower median; if none does, the best one. Prints one JSON line per attack with honest
worker 0's final validation loss, its change against this aggregation's clean run, how many attacker
and honest contributions were dropped, and the scoring's cost per round; compare with `shoal bench
hostile --methods diloco_eager` and tests/benchmarks/robust_alternatives.py (docs/ROBUSTNESS.md).
"""

import argparse
import functools
import json
import threading
import time
from collections import Counter

import torch

from shoal.peer.algorithms import diloco, robust
from shoal.peer.algorithms.hooks import Hooks
from shoal.peer.bench import converge, hostile
from shoal.peer.data import BatchPlan, stdlib_corpus
from shoal.peer.models.gpt import TinyGPT

_worker = threading.local()  # each optimizer thread's scratch model


class ScoredMean(Hooks):
    """DiLoCo's aggregation replaced (shoal.peer.algorithms.hooks) by one that keeps the contributions
    whose outer step alone lowers the loss of `batch`. `dropped` counts what it left out, the
    attackers' apart from the honest ones (attackers are the last ranks, and contributions come in
    rank order); `seconds`, what scoring took."""

    def __init__(
        self, batch: tuple[torch.Tensor, torch.Tensor], attackers: int, dropped: Counter, seconds: list[float]
    ):
        self.batch, self.attackers, self.dropped, self.seconds = batch, attackers, dropped, seconds

    def aggregate(self, optimizer):
        return functools.partial(
            scored_mean, optimizer, self.batch, self.attackers, self.dropped, self.seconds
        )


@torch.no_grad()
def scored_mean(
    optimizer, batch, attackers, dropped, seconds, into, contributions, policy, suspicion=None, senders=(),
    reference=None,
):  # fmt: skip
    inputs, targets = batch
    started = time.perf_counter()
    theta = optimizer.consensus_params
    lr = optimizer.consensus_optimizer.param_groups[0]["lr"]
    if getattr(_worker, "scratch", None) is None:
        _worker.scratch = TinyGPT(converge.QUICK.gpt)
    scratch = [p for p in _worker.scratch.parameters() if p.requires_grad]

    def loss(step: list[torch.Tensor] | None) -> float:
        for p, start, d in zip(scratch, theta, step or [None] * len(theta), strict=True):
            p.copy_(start if d is None else start - lr * d.to(start.dtype))
        return float(_worker.scratch(inputs, targets=targets))

    base = loss(None)
    gains = [base - loss(list(tensors)) for tensors, _ in contributions]
    best = max(range(len(gains)), key=gains.__getitem__)
    keep = [i for i, gain in enumerate(gains) if gain > 0] or [best]
    weights = robust.capped_weights([s for _, s in contributions])
    total = sum(weights[i] for i in keep)
    for i in keep:
        for mean, t in zip(into, contributions[i][0], strict=True):
            mean.add_(t.float(), alpha=weights[i] / total)
    count = len(contributions)
    for i in set(range(count)) - set(keep):
        dropped["attacker" if i >= count - attackers else "honest"] += 1
    seconds.append(time.perf_counter() - started)
    verdict = robust.Screened.of(weights, [1.0] * count, [None] * count, robust.NONE)
    return total, verdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--attackers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences in the scoring batch")
    args = parser.parse_args()
    streams = stdlib_corpus()
    gpt = converge.QUICK.gpt
    plan = BatchPlan(seq_len=gpt.seq_len, batch_size=args.batch, workers=1, seed=12345)
    batch = plan.batch(streams.train, 0, 0)
    clean = None
    for attack in ("none", "sign_flip", "sample_lie", "random"):
        dropped: Counter = Counter()
        seconds: list[float] = []
        attackers = 0 if attack == "none" else args.attackers
        diloco.DiLoCo.hooks = ScoredMean(batch, attackers, dropped, seconds)  # every worker's optimizer
        result = hostile.run("diloco_eager", attack, args.workers, args.attackers, streams, clean)
        clean = clean or result.final_val_loss
        row = {"aggregation": "loss_change", "attack": attack}
        row["final_val_loss"] = round(result.final_val_loss, 4)
        row["vs_clean"] = None if result.vs_clean is None else round(result.vs_clean, 4)
        row["dropped_attacker"], row["dropped_honest"] = dropped["attacker"], dropped["honest"]
        row["scoring_ms_per_round"] = round(1e3 * sum(seconds) / max(len(seconds), 1), 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
