"""Estimated against measured memory of one round (shoal.peer.train.fit): the embedded presets and three
Hugging Face configurations built here (GPT-2, Llama, Qwen2; about 5M parameters, vocabulary 4,096,
256 tokens a sample), under DeMo and DiLoCo, at micro-batches of 1 and 8, with and without activation
checkpointing. The measured peak is a dry run's (two rounds and one timed over a loopback exchange:
torch's live tensors on the CPU, the allocator's peak on a GPU). Prints a table and a JSON line.

    python -m tests.benchmarks.fit_memory [--models tiny,small,base,gpt2,llama,qwen2] [--device cpu]
        [--precision fp32|bf16|fp16]
"""

import argparse
import json
import tempfile

import torch

from shoal.peer.algorithms.configs import DEFAULTS
from shoal.peer.models.loading import load_model
from shoal.peer.train import fit
from shoal.peer.train.hardware import autocast_for

MIB = 1 << 20


def hugging_face(kind: str, folder: str) -> str:
    import transformers

    shared = {"vocab_size": 4096, "max_position_embeddings": 256}
    decoder = shared | {
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    configs = {
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=4096, n_positions=256, n_embd=256, n_layer=4, n_head=4
        ),
        "llama": lambda: transformers.LlamaConfig(**decoder),
        "qwen2": lambda: transformers.Qwen2Config(**decoder),
    }
    configs[kind]().save_pretrained(folder)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,small,base,gpt2,llama,qwen2")
    parser.add_argument("--algorithms", default="demo,diloco-standard")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    args = parser.parse_args()
    device = torch.device(args.device)
    autocast = autocast_for(device, args.precision)
    torch.set_num_threads(2)
    rows = []
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as folder:
            loaded = load_model(hugging_face(name, folder) if name in ("gpt2", "llama", "qwen2") else name)
            numel = sum(p.numel() for p in loaded.module.parameters())
            for algorithm in args.algorithms.split(","):
                for batch, recompute in [(1, False), (8, False), (8, True)]:
                    trial = fit.measure(
                        loaded, DEFAULTS[algorithm], device, batch, checkpointing=recompute, autocast=autocast
                    )
                    row = {
                        "model": name,
                        "parameters": numel,
                        "algorithm": algorithm,
                        "batch": batch,
                        "checkpointing": recompute,
                        "estimated_mib": round(trial.estimate.total / MIB, 1),
                        "measured_mib": round(trial.measured / MIB, 1),
                        "ratio": round(trial.estimate.total / trial.measured, 3),
                    }
                    rows.append(row)
                    print(
                        f"| {name} ({numel / 1e6:.1f}M) | {algorithm} | {batch} | {recompute} | "
                        f"{row['estimated_mib']:,} | {row['measured_mib']:,} | {row['ratio']:.3f} |",
                        flush=True,
                    )
    worst = max(abs(1 - row["ratio"]) for row in rows)
    summary = {
        "device": str(device),
        "precision": args.precision,
        "rows": rows,
        "worst_error": round(worst, 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
