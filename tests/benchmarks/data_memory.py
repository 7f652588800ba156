"""The data path's memory, start and speed (issue 49): a peer's peak RSS does not grow with its corpus,
its first batch comes within seconds, and `shoal data prepare`'s throughput.

    python -m tests.benchmarks.data_memory [--large-gb 2] [--json]

For a small (20 MB) and a large (`--large-gb`) corpus of uint16 token ids, as `.npy` token files and
as a prepared corpus (shards and manifest), a fresh process loads it the way `shoal join` does
(`load_data`, every file scanned or checked against the manifest), draws the first batch, then 200
rounds of 8 micro-batches of 8 windows of 129 tokens (`RoundSlices`), and reports its peak RSS and the
time to its first batch, at its first start (every file read once: the largest id and digest of
token files, the shards' digests of a prepared corpus) and at the next (what the first recorded).
Then `shoal data prepare` tokenizes a jsonl corpus of standard-library
docstrings (about 60 MB) with a 4,096-token BPE trained here, and with bytes.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SMALL_BYTES = 20 << 20
CHUNK = 1 << 26


def write_tokens(path: Path, size_bytes: int, vocab: int = 50_000) -> None:
    """An .npy of size_bytes / 2 uint16 ids, written a chunk at a time."""
    count = size_bytes // 2
    array = np.lib.format.open_memmap(path, mode="w+", dtype="<u2", shape=(count,))
    generator = np.random.default_rng(0)
    for start in range(0, count, CHUNK):
        array[start : start + CHUNK] = generator.integers(
            0, vocab, min(CHUNK, count - start), dtype=np.uint16
        )
    array.flush()
    del array


def measure(spec: str, cache: Path) -> dict:
    """Loads `spec` and trains on it in a fresh process: its peak RSS and time to the first batch."""
    code = f"""
import json, time
started = time.monotonic()
from shoal.peer.data import RoundSlices, load_data
streams = load_data({spec!r})
slices = RoundSlices(seq_len=128, stride=8, seed=0)
slices.batch(streams.train, round_number=0, slot=0, slots=4, micro=0, batch_size=8)
first = time.monotonic() - started
for round_number in range(200):
    for micro in range(8):
        slices.batch(streams.train, round_number=round_number, slot=1, slots=4, micro=micro, batch_size=8)
# VmHWM: this process's own peak (getrusage's maxrss keeps the parent's across fork and exec)
peak_mb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM")) / 1024
tokens = len(streams.train) + len(streams.validation)
print(json.dumps({{"first_batch_s": first, "peak_rss_mb": peak_mb, "tokens": tokens}}))
"""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


def as_prepared(folder: Path) -> None:
    """A manifest for the folder's one shard, as `shoal data prepare` writes it."""
    from shoal.peer.data.shards import Manifest, Shard, file_digest, npy_array
    from shoal.peer.data.tokens import Tokens

    shard = folder / "train-00000.npy"
    largest = Tokens([npy_array(shard)]).max_id()
    entry = Shard(shard.name, "train", npy_array(shard).length, largest, file_digest(shard))
    Manifest("synthetic", "0" * 64, 50_000, [0], "uint16", [entry], {"train": 1, "validation": 0}).write(
        folder
    )


def prepare_rate(folder: Path, tokenizer: str, corpus: Path) -> dict:
    out = folder / f"prepared-{Path(tokenizer).name}"
    started = time.monotonic()
    command = ["data", "prepare", str(corpus), str(out), "--tokenizer", tokenizer]
    subprocess.run([sys.executable, "-m", "shoal.peer.cli", *command], check=True, capture_output=True)
    seconds = time.monotonic() - started
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(shard["tokens"] for shard in manifest["shards"])
    name = tokenizer if tokenizer == "bytes" else "bpe-4096"
    rate = tokens / seconds
    return {
        "tokenizer": name,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": rate,
        "mb": corpus.stat().st_size / 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--large-gb", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from tests import corpora

    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("SHOAL_BENCH_DIR")) as temp:
        folder = Path(temp)
        for name, size in (("20 MB", SMALL_BYTES), (f"{args.large_gb:g} GB", int(args.large_gb * (1 << 30)))):
            prepared = folder / name.replace(" ", "")
            prepared.mkdir()
            write_tokens(prepared / "train-00000.npy", size)
            for kind, spec in (
                (".npy token file", prepared / "train-00000.npy"),
                ("prepared corpus", prepared),
            ):
                if kind == "prepared corpus":
                    as_prepared(prepared)
                for start in ("first start", "next start"):
                    rows.append({"corpus": name, "as": kind, "start": start, **measure(str(spec), folder)})
        texts = corpora.documents(4000)
        corpus = folder / "docs.jsonl"
        with open(corpus, "w") as file:
            while file.tell() < 60e6:
                for text in texts:
                    file.write(json.dumps({"text": text}) + "\n")
        bpe = corpora.train_bpe(folder / "bpe", texts, vocab_size=4096)
        rates = [prepare_rate(folder, "bytes", corpus), prepare_rate(folder, str(bpe), corpus)]
    report = {"memory": rows, "prepare": rates, "cores": os.cpu_count(),
              "self_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for row in rows:
            where = f"{row['corpus']:>8} {row['as']:<18} {row['start']:<11}"
            print(f"{where} first batch {row['first_batch_s']:6.2f} s  peak RSS {row['peak_rss_mb']:7.1f} MB")
        for rate in rates:
            rate_text = f"{rate['tokens_per_s']:,.0f} tokens/s"
            print(f"prepare {rate['mb']:.0f} MB jsonl, {rate['tokenizer']:>8}: {rate_text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
