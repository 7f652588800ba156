"""The cost of `--outer-state cpu` on a GPU: DiLoCo rounds of the embedded `base` GPT (25M parameters)
over a loopback exchange of one, the outer state on the GPU against in pinned host memory; seconds a
round (its outer step apart) and the GPU's peak memory. Prints a table and a JSON line. Needs a CUDA GPU.

    python -m tests.benchmarks.outer_state [--model base] [--inner-steps 10] [--rounds 5]
"""

import argparse
import dataclasses
import json
import sys
import time

import torch

from shoal.peer.algorithms.configs import DEFAULTS
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.algorithms.feedback import codec_for
from shoal.peer.models.loading import load_model
from shoal.peer.train.hardware import autocast_for
from shoal.peer.train.trainer import Trainer


def rounds(model_name: str, inner_steps: int, count: int, outer_device: str | None) -> dict:
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    loaded = load_model(model_name)
    module = loaded.module.to(device)
    algorithm = dataclasses.replace(DEFAULTS["diloco-standard"], inner_steps=inner_steps)

    def batches(step, micro, size, plan):
        rows = torch.randint(0, loaded.vocab_size, (size, loaded.seq_len + 1), device=device)
        return rows[:, :-1], rows[:, 1:]

    trainer = Trainer(
        module,
        LoopbackExchange.group(1)[0],
        algorithm=algorithm,
        batches=batches,
        codec=codec_for(algorithm),
        loss_fn=loaded.loss_fn,
        batch_size=8,
        max_micro_batches=1,
        autocast=autocast_for(device),
        outer_device=outer_device,
    )
    trainer.round()  # warm-up: the state allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    reports = [trainer.round() for _ in range(count)]
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / count
    outer = sum(r.exchange_s for r in reports) / count
    trainer.close()
    return {
        "outer_state": outer_device or "device",
        "round_s": round(seconds, 4),
        "outer_step_s": round(outer, 4),
        "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="base")
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: the outer state moves between the GPU and the host", file=sys.stderr)
        return 2
    rows = [rounds(args.model, args.inner_steps, args.rounds, where) for where in (None, "cpu")]
    for row in rows:
        print(f"| {row['outer_state']} | {row['round_s']} | {row['outer_step_s']} | {row['peak_mib']} |")
    print(json.dumps({"model": args.model, "inner_steps": args.inner_steps, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
