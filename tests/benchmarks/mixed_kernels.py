"""Two volunteers' machines on one: two `shoal join` peers of the embedded tiny GPT on 127.0.0.1, the
first on torch's plain CPU kernels (ATEN_CPU_CAPABILITY=default, 1 thread), the joiner on its best
vectorized ones (AVX2 or AVX-512, 2 threads). Counts, per algorithm, the rounds after the joiner's
first two (it computes the first on its own initial state, and takes the swarm's in the second) in
which both peers' payloads counted together (`shared`), the state re-syncs (the joiner's first
included) and the bytes the joiner received, and whether both end on one parameter hash (issue 76).
Prints a table and a JSON line.

With `--freeze N`, a third peer (vectorized kernels, 1 thread) joins once the two train together, and,
once it does too, is frozen (SIGSTOP, every process of it) for N rounds of the first peer's: what it
pulled to catch up, by replay (shoal.peer.swarm.replay) or download, against the state it would
otherwise have downloaded.

    python -m tests.benchmarks.mixed_kernels                                # DiLoCo eager and DeMo
    python -m tests.benchmarks.mixed_kernels --algorithms diloco-standard --rounds 12
    python -m tests.benchmarks.mixed_kernels --algorithms diloco-eager --rounds 16 --freeze 2
    python -m tests.benchmarks.mixed_kernels --algorithms diloco --averaging butterfly

With `--averaging butterfly` the peers run under a `shoal coordinator` (butterfly rounds are
coordinated, of three peers or more): a third peer (vectorized kernels, 1 thread) joins with the
joiner; each owns a piece of the mean, computes it and serves it encoded, and the others decode it.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BEST = torch.backends.cpu.get_cpu_capability().lower()


def _join(
    folder: Path, name: str, capability: str, threads: int, *args: str
) -> tuple[subprocess.Popen, Path]:
    out = folder / f"{name}.jsonl"
    command = [sys.executable, "-m", "shoal.peer.cli", "join", "--model", "tiny", "--host", "127.0.0.1"]
    command += ["--log-format", "json", *args]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": str(threads)}
    with (folder / f"{name}.err").open("w") as err:
        process = subprocess.Popen(command, stdout=out.open("w"), stderr=err, env=env, start_new_session=True)
    return process, out


def _events(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


def _wait_for(path: Path, predicate, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = next((event for event in _events(path) if predicate(event)), None)
        if found is not None:
            return found
        time.sleep(0.2)
    raise TimeoutError(f"nothing in {path} within {timeout_s} s")


def _shared(after: int = -1):
    return lambda e: e.get("event") == "round" and e.get("shared") and e["round"] > after


def _freeze(folder: Path, first_out: Path, common: list[str], address: str, rounds: int) -> subprocess.Popen:
    """The third peer, joined, then frozen for `rounds` of the first peer's once it trained together."""
    frozen, out = _join(folder, "frozen", BEST, 1, *common, "--initial-peers", address)
    shared = _wait_for(out, _shared(), 120)
    _wait_for(out, _shared(shared["round"]), 60)
    os.killpg(frozen.pid, signal.SIGSTOP)
    at = max(e["round"] for e in _events(first_out) if e.get("event") == "round")
    try:
        _wait_for(first_out, lambda e: e.get("event") == "round" and e["round"] >= at + rounds, 30 * rounds)
    finally:
        os.killpg(frozen.pid, signal.SIGCONT)
    return frozen


def run(
    algorithm: str,
    rounds: int,
    round_seconds: float,
    extra: list[str],
    *,
    same: bool,
    keep: str | None,
    freeze: int = 0,
    coordinated: bool = False,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="shoal-mixed-kernels-") as name:
        folder = Path(keep or name) / algorithm
        folder.mkdir(parents=True, exist_ok=True)
        common = ["--run", "mixed", "--algorithm", algorithm, "--until-round", str(rounds - 1), *extra]
        coordinator = None
        if coordinated:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                listen = f"127.0.0.1:{probe.getsockname()[1]}"
            server = [sys.executable, "-m", "shoal.peer.cli", "coordinator", "--listen", listen]
            server += ["--state", str(folder / "coordinator.db"), "--min-peers", "3"]
            with (folder / "coordinator.log").open("w") as log:
                coordinator = subprocess.Popen(server, stdout=log, stderr=log, start_new_session=True)
            common += ["--coordinator", listen]
        first, first_out = _join(
            folder, "first", "default", 1, *common, "--round-seconds", str(round_seconds)
        )
        processes = [first]
        try:
            address = _wait_for(first_out, lambda e: e.get("event") == "started", 120)["initial_peers"][0]
            kernels = ("default", 1) if same else (BEST, 2)
            joiner, joiner_out = _join(folder, "joiner", *kernels, *common, "--initial-peers", address)
            processes.append(joiner)
            if coordinated:  # a butterfly round needs three
                processes.append(_join(folder, "third", BEST, 1, *common, "--initial-peers", address)[0])
            if freeze:
                _wait_for(joiner_out, _shared(), 120)
                processes.append(_freeze(folder, first_out, common, address, freeze))
            deadline = time.monotonic() + 180 + 2 * rounds * round_seconds
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            for process in processes + ([coordinator] if coordinator else []):
                if process.poll() is None:
                    process.kill()
        logs = {"first": _events(first_out), "joiner": _events(joiner_out)}
        frozen = _events(folder / "frozen.jsonl") if freeze else []
        third = _events(folder / "third.jsonl") if coordinated else []
    summaries = {who: next(e for e in events if e.get("event") == "summary") for who, events in logs.items()}
    joined = [e["round"] for e in logs["joiner"] if e.get("event") == "round"]
    # its first round computes on its own initial state, its second takes the swarm's (a re-sync)
    after = set(joined[2:])
    together = {
        who: sum(1 for e in events if e.get("event") == "round" and e["round"] in after and e.get("shared"))
        for who, events in logs.items()
    }
    thawed = next((e for e in frozen if e.get("event") == "summary"), {})
    return {
        "frozen": {
            k: thawed.get(k)
            for k in ("resyncs", "resync_bytes", "replays", "replay_bytes", "replayed_state_bytes")
        },
        "algorithm": algorithm + (f" {' '.join(extra[2:])}" if extra[2:] else ""),
        "butterfly_rounds": summaries["joiner"].get("butterfly_rounds", 0),
        "kernels": "default/1 thread, both" if same else f"default/1 thread + {BEST}/2 threads",
        "rounds_after_join": len(after),
        "together_first": together["first"],
        "together_joiner": together["joiner"],
        "resyncs_first": summaries["first"]["resyncs"],
        "resyncs_joiner": summaries["joiner"]["resyncs"],
        "bytes_received_joiner": summaries["joiner"]["bytes_received"],
        # caught up by replay instead (shoal.peer.swarm.replay): bytes pulled, and the state bytes saved
        "replays": summaries["first"]["replays"] + summaries["joiner"]["replays"],
        "replay_bytes": summaries["first"]["replay_bytes"] + summaries["joiner"]["replay_bytes"],
        "replayed_state_bytes": sum(s["replayed_state_bytes"] for s in summaries.values()),
        "same_hash": len(
            {
                s["param_hash"]
                for s in [*summaries.values(), *(e for e in third if e.get("event") == "summary")]
            }
        )
        == 1,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="diloco-eager,demo")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--round-seconds", type=float, default=8.0)
    parser.add_argument("--inner-steps", type=int, default=4, help="DiLoCo's (the issue's setting)")
    parser.add_argument("--compression", default=None, help="DiLoCo's --compression (int8, sparse)")
    parser.add_argument("--averaging", default=None, help="DiLoCo's --averaging (butterfly: coordinated)")
    parser.add_argument("--same-kernels", action="store_true", help="the control: both peers on default")
    parser.add_argument("--keep", default=None, help="keep the peers' logs in this folder")
    parser.add_argument("--freeze", type=int, default=0, help="rounds a third peer is frozen (SIGSTOP)")
    args = parser.parse_args()
    results = []
    for algorithm in args.algorithms.split(","):
        extra = ["--inner-steps", str(args.inner_steps)] if algorithm.startswith("diloco") else []
        if args.compression and algorithm.startswith("diloco"):
            extra += ["--compression", args.compression]
        if args.averaging and algorithm.startswith("diloco"):
            extra += ["--averaging", args.averaging]
        results.append(
            run(
                algorithm,
                args.rounds,
                args.round_seconds,
                extra,
                same=args.same_kernels,
                keep=args.keep,
                freeze=args.freeze,
                coordinated=args.averaging == "butterfly" and algorithm.startswith("diloco"),
            )
        )
        row = results[-1]
        print(
            f"{algorithm:>16}: together {row['together_first']}/{row['rounds_after_join']} (first), "
            f"{row['together_joiner']}/{row['rounds_after_join']} (joiner); re-syncs {row['resyncs_first']} "
            f"+ {row['resyncs_joiner']}; replays {row['replays']} ({row['replay_bytes']:,} B for "
            f"{row['replayed_state_bytes']:,} B of state); "
            f"joiner received {row['bytes_received_joiner']:,} B; butterfly {row['butterfly_rounds']}; "
            f"one hash: {row['same_hash']}",
            flush=True,
        )
        if args.freeze:
            print(f"{'':>16}  frozen for {args.freeze} rounds: {row['frozen']}", flush=True)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
