"""What the canonical shared-state step costs (shoal.peer.algorithms.canonical, issue 76): one round of
DiLoCo's aggregation (screened weighted mean of N contributions, the Gram matrix included) and its outer
Nesterov step, on the parameters of the embedded GPT's presets, canonical against torch's own kernels
(fused multiply-adds, BLAS reductions). Prints a table and a JSON line.

    python -m tests.benchmarks.canonical_cost [--presets small,base] [--contributions 4] [--device cpu]
"""

import argparse
import json
import statistics
import time

import torch

from shoal.peer.algorithms import canonical, robust
from shoal.peer.models.loading import load_model


def torch_round(params, contributions, optimizer) -> None:
    """The step as torch's kernels would do it: a Gram matrix by matmul, fused adds, torch's SGD."""
    rows = len(contributions)
    gram = torch.zeros(rows, rows, device=params[0].device)
    for parts in zip(*(c for c, _ in contributions), strict=True):
        stacked = torch.stack([t.reshape(-1) for t in parts])
        gram += stacked @ stacked.T
    gram.tolist()
    mean = [torch.zeros_like(p) for p in params]
    for tensors, samples in contributions:
        for m, t in zip(mean, tensors, strict=True):
            m.add_(t, alpha=samples / len(contributions))
    for p, m in zip(params, mean, strict=True):
        p.grad = m
    optimizer.step()


def canonical_round(params, contributions, optimizer) -> None:
    mean = [torch.zeros_like(p) for p in params]
    robust.add_screened_mean(mean, contributions, robust.DILOCO)
    for p, m in zip(params, mean, strict=True):
        p.grad = m
    optimizer.step()


def timed(step, params, contributions, optimizer, device: torch.device, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step(params, contributions, optimizer)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])  # the first warms up


def measure(preset: str, contributions: int, device: torch.device, repeat: int) -> dict:
    model = load_model(preset, seed=0).module.to(device)
    params = [p.detach().clone() for p in model.parameters()]
    generator = torch.Generator(device=device).manual_seed(1)
    rounds = [
        ([torch.randn(p.shape, generator=generator, device=device) * 1e-3 for p in params], 16)
        for _ in range(contributions)
    ]
    settings = {"lr": 0.7, "momentum": 0.9, "nesterov": True}
    fused = timed(torch_round, params, rounds, torch.optim.SGD(params, **settings), device, repeat)
    ours = timed(canonical_round, params, rounds, canonical.NesterovSGD(params, **settings), device, repeat)
    return {
        "preset": preset,
        "parameters": sum(p.numel() for p in params),
        "contributions": contributions,
        "device": str(device),
        "torch_s": round(fused, 4),
        "canonical_s": round(ours, 4),
        "extra_s": round(ours - fused, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="small,base")
    parser.add_argument("--contributions", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    results = []
    for preset in args.presets.split(","):
        row = measure(preset, args.contributions, torch.device(args.device), args.repeat)
        results.append(row)
        print(
            f"{preset:>6} ({row['parameters']:,} parameters, {row['contributions']} contributions, "
            f"{row['device']}): torch's kernels {row['torch_s']:.3f} s, canonical {row['canonical_s']:.3f} s "
            f"a round (+{row['extra_s']:.3f} s)",
            flush=True,
        )
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
