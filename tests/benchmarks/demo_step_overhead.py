"""How long a DeMo step takes next to the forward+backward pass it follows (DESIGN.md: <= 4%).

    python -m tests.benchmarks.demo_step_overhead [--model small] [--batch 16] [--repeat 10] [--device cuda]

One worker (LoopbackExchange of 1: encode, gather, screen, decode and apply all run; no network), the
embedded GPT on random bytes. Also times the same step written the way the paper's reference code
is (tests/demo_reference.py: per tensor, einsum bases, scatter_reduce). Prints one JSON object with
median milliseconds.
"""

import argparse
import json
import statistics
import time

import torch

from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.models.gpt import GPTConfig, TinyGPT
from tests.demo_reference import ReferenceDeMo


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, repeat: int) -> float:
    """The median wall time of `fn`, the GPU's queued work included."""
    fn()
    times = []
    for _ in range(repeat):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the model and optimizer run")
    args = parser.parse_args()
    device = torch.device(args.device)
    config = GPTConfig.preset(args.model)
    torch.manual_seed(0)
    model = TinyGPT(config).to(device)
    tokens = torch.randint(0, 256, (args.batch, config.seq_len + 1), device=device)
    results = {
        "model": args.model,
        "params": sum(p.numel() for p in model.parameters()),
        "batch": args.batch,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }

    def forward_backward() -> None:
        model.zero_grad(set_to_none=False)
        model(tokens[:, :-1], targets=tokens[:, 1:]).backward()

    results["forward_backward_ms"] = median_ms(forward_backward, args.repeat)
    reference = ReferenceDeMo([p.detach() for p in model.parameters()], 1, lr=1e-4)
    grads = [[p.grad for p in model.parameters()]]
    results["reference_style_step_ms"] = median_ms(lambda: reference.step(grads), args.repeat)
    for name, settings in {
        "demo_reference": {},
        "demo_compact": {"compression_topk": 4, "value_bits": 1},
    }.items():
        exchange = LoopbackExchange.group(1, trusted=False)[0]  # the swarm's step: screened
        optimizer = DeMo(model.parameters(), lr=1e-4, exchange=exchange, **settings)
        results[f"{name}_step_ms"] = median_ms(optimizer.step, args.repeat)
        results[f"{name}_step_share"] = results[f"{name}_step_ms"] / results["forward_backward_ms"]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
