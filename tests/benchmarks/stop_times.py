"""How long each way of stopping a `shoal join` takes (issue 74), and what it leaves: a first peer and a
joiner of the embedded tiny GPT on 127.0.0.1; once they train together, the joiner is stopped one way,
at a random point of its round, and timed from the signal to its exit. Each way runs on a fresh pair.
Prints a table and a JSON line.

    python -m tests.benchmarks.stop_times                       # rounds of 8 s, each way 3 times
    python -m tests.benchmarks.stop_times --round-seconds 30 --repeat 1

Ways: `main` (SIGTERM to the main process: docker/podman stop, Kubernetes, systemd KillMode=mixed),
`group` (SIGINT to its process group: Ctrl-C), `every` (SIGTERM to every process: systemd's
control-group, pkill), `twice` (SIGTERM, then another 0.5 s later).
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.peer.job.node import stop_budget
from tests.integration.harness import wait_for
from tests.integration.test_stops import _descendants, _gone, _running

WAYS = ("main", "group", "every", "twice")
ABORTS = ("terminate called", "Traceback", "exiting now")


def _join(folder: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    out = folder / f"{name}.jsonl"
    command = [sys.executable, "-m", "shoal.peer.cli", "join", "--model", "tiny", "--run", "stop-times"]
    command += ["--host", "127.0.0.1", "--log-format", "json", "--checkpoint-dir", str(folder / name), *args]
    process = subprocess.Popen(
        command, stdout=out.open("w"), stderr=(folder / f"{name}.err").open("w"), start_new_session=True
    )
    return process, out


def one(way: str, round_seconds: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="shoal-stop-times-") as name:
        folder = Path(name)
        first, first_out = _join(folder, "first", "--round-seconds", str(round_seconds), "--port", "0")
        joiner = None
        try:
            started = wait_for(first_out, lambda e: e.get("event") == "started", 120, processes=[first])
            address = started["initial_peers"][0]
            joiner, out = _join(folder, "joiner", "--initial-peers", address)
            shared = wait_for(
                out,
                lambda e: e.get("event") == "round" and e.get("shared"),
                10 * round_seconds,
                processes=[first, joiner],
            )
            time.sleep(random.uniform(0, round_seconds))  # anywhere in its next round
            tree = _descendants(joiner.pid)
            signalled = time.monotonic()
            if way == "main":
                joiner.send_signal(signal.SIGTERM)
            elif way == "group":
                os.killpg(joiner.pid, signal.SIGINT)
            elif way == "every":
                for pid in tree:
                    os.kill(pid, signal.SIGTERM)
            else:
                joiner.send_signal(signal.SIGTERM)
                time.sleep(0.5)
                joiner.send_signal(signal.SIGTERM)
            code = joiner.wait(timeout=stop_budget(round_seconds) + 60)
            seconds = time.monotonic() - signalled
            left = _gone(tree, 10)
            err = (folder / "joiner.err").read_text()
            checkpoints = sorted((folder / "joiner").glob("round-*.safetensors"))
            return {
                "way": way,
                "round_seconds": round_seconds,
                "exit_code": code,
                "seconds": round(seconds, 2),
                "processes_left": len(_running(left)),
                "aborted": any(abort in err for abort in ABORTS),
                "checkpoint_round": int(checkpoints[-1].stem.split("-")[1]) if checkpoints else None,
                "last_shared_round": shared["round"],
            }
        finally:
            for process in (first, joiner):
                if process is not None and process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--round-seconds", type=float, default=8.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ways", default=",".join(WAYS))
    args = parser.parse_args()
    results = [one(way, args.round_seconds) for way in args.ways.split(",") for _ in range(args.repeat)]
    budget = stop_budget(args.round_seconds)
    print(f"rounds of {args.round_seconds:g} s, stop budget {budget:g} s")
    print(f"{'way':<7} {'exit':>4} {'seconds':>8} {'left':>4} {'aborted':>7} {'checkpoint':>10}")
    for r in results:
        print(
            f"{r['way']:<7} {r['exit_code']:>4} {r['seconds']:>8.2f} {r['processes_left']:>4} "
            f"{r['aborted']!s:>7} {r['checkpoint_round']!s:>10}"
        )
    print(json.dumps({"round_seconds": args.round_seconds, "budget_s": budget, "results": results}))


if __name__ == "__main__":
    main()
