"""An uncoordinated swarm that ends with `--until-round` ends on one model (issue 25).

Four `shoal join` processes on 127.0.0.1, no coordinator, DiLoCo with eager outer updates: the
optimizer gathers each round on its own thread while the next round computes, and the training loop
plans the next round meanwhile. Every peer must compute each round once, report rounds 0..R in order,
apply the same means and stop after round R, so that all of them end on the same parameter hash.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import events, kill, spawn, wait_for

ROOT = Path(__file__).resolve().parents[2]
PEERS = 4
UNTIL_ROUND = 4
ROUND_SECONDS = 3.0
# the joiners, forked from the zygote (tests.integration.launcher), start a DHT before round 0; with the
# other xdist worker's swarm on the two cores, a peer took over 8 s to print its address (2026-12-01)
STARTUP_S = 20.0


@pytest.mark.timeout(150)
def test_uncoordinated_eager_diloco_ends_on_one_model_after_the_same_rounds(tmp_path):
    common = ["--host", "127.0.0.1", "--run", "ends", "--log-format", "json", "--algorithm", "diloco"]
    common += ["--round-seconds", str(ROUND_SECONDS), "--until-round", str(UNTIL_ROUND), "--inner-steps", "4"]
    processes: list[subprocess.Popen] = []

    def launch(index: int, *flags: str) -> None:
        with (
            (tmp_path / f"peer{index}.jsonl").open("w") as out,
            (tmp_path / f"peer{index}.err").open("w") as err,
        ):
            command = [sys.executable, "-m", "shoal.peer.cli", "join", *common, *flags]
            processes.append(spawn(command, stdout=out, stderr=err))

    try:
        launch(0, "--start-time", repr(time.time() + STARTUP_S))
        started = wait_for(
            tmp_path / "peer0.jsonl", lambda e: e.get("event") == "started", 60, processes=processes
        )
        address = started["initial_peers"][0]
        for index in range(1, PEERS):
            launch(index, "--initial-peers", address)
        for index, process in enumerate(processes):
            code = process.wait(timeout=STARTUP_S + (UNTIL_ROUND + 1) * ROUND_SECONDS + 60)
            assert code == 0, (tmp_path / f"peer{index}.err").read_text()[-3000:]
    finally:
        for process in processes:
            kill(process)

    expected = list(range(UNTIL_ROUND + 1))
    hashes = set()
    for index in range(PEERS):
        logged = events(tmp_path / f"peer{index}.jsonl")
        rounds = [e["round"] for e in logged if e.get("event") == "round"]
        # each round computed once, none skipped, none past the last: the progress a user reads
        assert rounds == expected, f"peer {index} reported rounds {rounds}"
        summary = next(e for e in logged if e.get("event") == "summary")
        assert summary["rounds"] == UNTIL_ROUND + 1 and summary["last_round"] == UNTIL_ROUND
        assert summary["stopped"] is False
        hashes.add(summary["param_hash"])
    assert len(hashes) == 1, f"the peers ended on {len(hashes)} models"
