"""What the canonical shared-state step costs (shoal.peer.algorithms.canonical, issue 76), on the
parameters of the embedded GPT's presets, canonical against torch's own kernels (fused multiply-adds,
BLAS reductions, float matrix products):
- DiLoCo: one round's aggregation (screened weighted mean of N contributions, the Gram matrix
  included) and its outer Nesterov step;
- DeMo: one round's direction from N decoded contributions (the weighted mean of the coefficients, the
  inverse DCT, its sign), the exact integer inverse against the float one.
Prints a table and a JSON line.

    python -m tests.benchmarks.canonical_cost [--presets small,base] [--contributions 4] [--device cpu]
"""

import argparse
import json
import statistics
import time

import torch

from shoal.peer.algorithms import canonical, robust
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import Contribution, LoopbackExchange
from shoal.peer.models.loading import load_model
from shoal.protocol import Payload


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
    demo = {flag: demo_round(model, contributions, flag, repeat) for flag in (False, True)}
    return {
        "preset": preset,
        "parameters": sum(p.numel() for p in params),
        "contributions": contributions,
        "device": str(device),
        "torch_s": round(fused, 4),
        "canonical_s": round(ours, 4),
        "extra_s": round(ours - fused, 4),
        "demo_torch_s": round(demo[False], 4),
        "demo_canonical_s": round(demo[True], 4),
    }


def demo_round(model: torch.nn.Module, contributions: int, exact: bool, repeat: int) -> float:
    """DeMo's direction for one round of `contributions` payloads of the reference's top-32 (decoded
    and screened once, outside the time), with `canonical=exact`."""
    exchange = LoopbackExchange.group(1, trusted=False)[0]
    demo = DeMo(model.parameters(), lr=1e-3, exchange=exchange, canonical=exact)
    slices, device = demo._slices(), next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(2)
    payloads = []
    for rank in range(contributions):
        tensors = []
        for piece in slices:
            noise = torch.randn(piece.plan.shape, generator=generator, device=device)
            tensors.append(demo.codec.pack(demo.codec.select(noise, piece.plan), torch.float32))
        data = Payload(tensors=tensors).SerializeToString()
        payloads.append(Contribution(rank, data, 16, sender=bytes([rank + 1])))
    accepted = demo._screened(payloads, slices, None, demo.suspicion).accepted

    def step(*_: object) -> None:
        for _piece, signs in demo._signs(accepted, slices):
            signs.sum()  # each slice's direction is computed before the next overwrites it

    return timed(step, None, None, None, device, repeat)


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
            f"{row['device']}): DiLoCo: torch's kernels {row['torch_s']:.3f} s, canonical "
            f"{row['canonical_s']:.3f} s a round (+{row['extra_s']:.3f} s); DeMo: float inverse "
            f"{row['demo_torch_s']:.3f} s, exact {row['demo_canonical_s']:.3f} s",
            flush=True,
        )
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
