"""Tokens/s and peak memory of the embedded `base` GPT (25M parameters, 256 tokens a sample), a
forward and backward pass per step, with and without activation checkpointing
(`--activation-checkpointing on`). Each setting runs in its own process, so that the peak resident
memory (VmHWM) is its own. Prints a table and a JSON line.

    python -m tests.benchmarks.activation_checkpointing [--batch 8] [--steps 5]
"""

import argparse
import json
import subprocess
import sys
import time

WORKER = """
import json, sys, time, torch
from shoal.peer.job.assembly import checkpoint_activations
from shoal.peer.models.loading import load_model
batch, steps, on = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "on"
torch.manual_seed(0)
model = load_model("base").module
if on:
    checkpoint_activations(model, "base")
tokens = torch.randint(0, 256, (batch, 257))
model(tokens[:, :-1], targets=tokens[:, 1:]).backward()  # warm-up
start = time.perf_counter()
for _ in range(steps):
    model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
seconds = (time.perf_counter() - start) / steps
peak = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
print(json.dumps({"checkpointing": on, "tokens_per_s": batch * 256 / seconds, "peak_rss": peak}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for setting in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-c", WORKER, str(args.batch), str(args.steps), setting],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        rows.append(json.loads(out.splitlines()[-1]))
    print(f"| activation checkpointing | tokens/s (batch {args.batch} x 256) | peak RSS |")
    print("|---|---:|---:|")
    for row in rows:
        on = "on" if row["checkpointing"] else "off"
        print(f"| {on} | {row['tokens_per_s']:,.0f} | {row['peak_rss'] / 2**20:,.0f} MiB |")
    print(json.dumps({"results": rows, "measured_at": time.strftime("%Y-%m-%d")}))


if __name__ == "__main__":
    main()
