"""What screening (shoal.peer.algorithms.robust) adds to a DeMo step and to a DiLoCo round, by participants.

    python -m tests.benchmarks.screening_cost [--model small] [--participants 4 8] [--repeat 10]

DeMo, k=4 with 1-bit values: one step of a participant that receives the payloads of n - 1 others
(built from random gradients by DeMo itself), with screening (`JUDGED`: the median norm bound and the
Gram matrix of the n contributions, as `robust.DEMO` computes them, but nothing left out: random
gradients agree with nothing, and leaving them out would make the step cheaper, not show what judging
costs) and without (`robust.NONE`); the gradient is set and no forward pass runs, so the times are the
optimizer's alone. DiLoCo: `robust.screen` of n
float32 pseudo-gradients of the model's size. Prints one JSON object with median milliseconds.
"""

import argparse
import json

import torch

from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import Contribution, Exchange, Gathered
from shoal.peer.algorithms.robust import DILOCO, NONE, Robustness, screen
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from tests.benchmarks.demo_step_overhead import median_ms

JUDGED = Robustness(min_agreement=-1.0, suspect_below=None, suspect_relative=None)
"""Every contribution judged (its Gram row computed), none left out."""
DEMO_SETTINGS = {"lr": 1e-3, "compression_topk": 4, "value_bits": 1, "compression_decay": 0.99}


class _Others(Exchange):
    """This participant's payload plus fixed payloads of n - 1 others."""

    def __init__(self, others: list[bytes]):
        self.others = others

    rank = property(lambda self: 0)
    world_size = property(lambda self: 1 + len(self.others))

    def gather(self, payload, samples, state=None, plan=None):
        mine = [Contribution(0, payload, samples, b"me")]
        others = [Contribution(i + 1, p, samples, bytes([i + 1])) for i, p in enumerate(self.others)]
        return Gathered((*mine, *others))

    def mean(self, tensor, weight=1.0):
        raise NotImplementedError


def payloads(model: TinyGPT, count: int) -> list[bytes]:
    """Real DeMo payloads of `count` participants with random gradients."""
    sent = []

    class Capture(_Others):
        def gather(self, payload, samples, state=None, plan=None):
            sent.append(payload)
            return super().gather(payload, samples, state, plan)

    for _ in range(count):
        params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
        opt = DeMo(params, exchange=Capture([]), robust=NONE, **DEMO_SETTINGS)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny, small or base (default: small)")
    parser.add_argument("--participants", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig.preset(args.model))
    numel = sum(p.numel() for p in model.parameters())
    results = []
    for n in args.participants:
        others = payloads(model, n - 1)
        row = {"participants": n}
        for name, policy in (("demo_unscreened_ms", NONE), ("demo_screened_ms", JUDGED)):
            params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
            opt = DeMo(params, exchange=_Others(others), robust=policy, **DEMO_SETTINGS)
            for p in params:
                p.grad = torch.randn_like(p)
            row[name] = round(median_ms(opt.step, args.repeat), 1)
        pseudo = [[torch.randn(numel)] for _ in range(n)]
        diloco = median_ms(lambda pseudo=pseudo: screen(pseudo, [1] * len(pseudo), DILOCO), args.repeat)
        row["diloco_screen_ms"] = round(diloco, 1)
        results.append(row)
    print(
        json.dumps(
            {"model": args.model, "parameters": numel, "threads": torch.get_num_threads(), "results": results}
        )
    )


if __name__ == "__main__":
    main()
