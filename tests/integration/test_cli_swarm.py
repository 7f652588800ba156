"""The CLI end to end, as a volunteer runs it: `shoal demo`, two `shoal join` against each other,
`shoal status`, an unreachable bootstrap peer, SIGTERM leaving a loadable checkpoint (real
processes on 127.0.0.1, OS-chosen ports)."""

import json
import os
import signal
import urllib.request

import pytest

from shoal.peer.checkpoint import CheckpointStore
from tests.integration.harness import free_port, kill, shoal, start, wait_for


@pytest.mark.timeout(240)
def test_demo_json_summary():
    result = shoal("demo", "--peers", "3", "--rounds", "10", "--round-seconds", "2", "--json", timeout=220)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["peers"] == 3 and summary["rounds"] == 10
    assert summary["param_hash_agree"] is True
    assert summary["final_loss"] < summary["initial_loss"] - 0.3
    assert summary["validation_loss"] < summary["initial_loss"] - 0.3  # held-out data, the final model
    assert 1000 < summary["bytes_sent_per_peer_per_round"] < 1 << 20
    assert 5 < summary["wall_s"] < 200
    assert summary["coordinator"] is True and summary["coordinated_rounds"] >= 3 * 10 - 3
    # coordinated rounds are announced to the coordinator, not the DHT, and the records are only
    # kept alive (two writes per peer per round before)
    assert summary["dht_stores_per_peer_per_round"] <= 0.3
    assert "round 9" in result.stderr  # the live view went to stderr


@pytest.mark.timeout(240)
def test_demo_with_sparse_diloco_trains_one_model_at_a_fraction_of_int8s_bytes():
    """`--compression sparse` reaches every peer (they refuse each other otherwise) and shrinks what
    they send; a preset of the other algorithm exits 2 before anything starts."""
    common = [
        "demo",
        "--peers",
        "3",
        "--rounds",
        "6",
        "--round-seconds",
        "3",
        "--algorithm",
        "diloco",
        "--json",
    ]
    runs = {}
    for compression in ("sparse", "int8"):
        result = shoal(*common, "--compression", compression, timeout=220)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[compression] = json.loads(result.stdout)
    sparse, dense = runs["sparse"], runs["int8"]
    assert sparse["param_hash_agree"] is True
    assert sparse["validation_loss"] < sparse["initial_loss"] - 0.2  # 4.49 from 4.96 (int8: 4.04)
    # the tiny model: 478k parameters, 20 tensors (12 of them 64 values, a header each)
    assert dense["bytes_sent_per_peer_per_round"] > 30 * sparse["bytes_sent_per_peer_per_round"]
    refused = shoal("demo", "--algorithm", "demo", "--compression", "sparse", timeout=60)
    assert refused.returncode == 2 and "--compression: compression sparse is not for demo" in refused.stderr


@pytest.mark.timeout(240)
def test_demo_with_a_bounded_fan_in_under_the_coordinator_halves_the_bytes_and_trains_one_model():
    """`--gather 2` of 4 DiLoCo peers under the demo's coordinator (started with `--gather 2`): its
    results list the 2 it chose of the participants, with the tally of all their states; each peer
    pulls only those (1.5 payloads a peer instead of 3) and ends on one model."""
    common = ["demo", "--peers", "4", "--rounds", "6", "--round-seconds", "3", "--algorithm", "diloco"]
    runs = {}
    for gather in ("2", "0"):
        result = shoal(*common, "--gather", gather, "--json", timeout=220)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[gather] = json.loads(result.stdout)
    bounded, everyone = runs["2"], runs["0"]
    assert bounded["param_hash_agree"] is True and bounded["coordinator"] is True
    assert bounded["validation_loss"] < bounded["initial_loss"] - 0.3
    assert bounded["bytes_sent_per_peer_per_round"] < 0.6 * everyone["bytes_sent_per_peer_per_round"]
    refused = shoal(*common, "--gather", "2", "--averaging", "butterfly", timeout=60)
    assert refused.returncode == 2 and "--gather: not with --averaging butterfly" in refused.stderr


@pytest.mark.timeout(180)
def test_join_twice_status_and_sigterm_checkpoint(tmp_path):
    first_out, second_out = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    common = ["--host", "127.0.0.1", "--run", "twice", "--log-format", "json", "--round-seconds", "2"]
    served = ["--metrics-port", "0", "--address-file", str(tmp_path / "first.address")]
    # the first peer as a container runs it: a fixed port and identity, checkpoints (and its clock) kept
    kept = ["--port", str(free_port()), "--identity", str(tmp_path / "first.key")]
    kept += ["--checkpoint-dir", str(tmp_path / "first-checkpoints")]
    first = start(
        "join", *common, *served, *kept, stdout=first_out.open("w"), stderr=(tmp_path / "first.err").open("w")
    )
    second = None
    try:
        started = wait_for(first_out, lambda e: e.get("event") == "started", 60)
        assert started["join_command"].startswith("shoal join --initial-peers /ip4/127.0.0.1/")
        assert "--run twice" in started["join_command"]
        address = started["initial_peers"][0]
        # --address-file holds the address of the join command, for scripts and containers
        assert started["join_command"].split()[3] == (tmp_path / "first.address").read_text().strip()
        second = start(
            "join",
            *common,
            "--initial-peers",
            address,
            "--checkpoint-dir",
            str(tmp_path / "checkpoints"),
            stdout=second_out.open("w"),
            stderr=(tmp_path / "second.err").open("w"),
        )
        wait_for(second_out, lambda e: e.get("event") == "round" and e["participants"] == 2, 90)
        wait_for(first_out, lambda e: e.get("event") == "round" and e["participants"] == 2, 30)
        ids = [started["peer_id"], wait_for(second_out, lambda e: e.get("event") == "started", 1)["peer_id"]]
        metrics = wait_for(first_out, lambda e: e.get("event") == "metrics", 1)["address"]
        _seen_from_outside(common, address, metrics, ids)

        # the first peer restarted (a container's restart policy): it keeps the swarm's round clock, so
        # that the second still takes it for one of its run's peers, and the two train together again
        os.kill(first.pid, signal.SIGTERM)
        assert first.wait(timeout=20) == 0
        again_out = tmp_path / "again.jsonl"
        first = start(
            "join", *common, *kept, stdout=again_out.open("w"), stderr=(tmp_path / "again.err").open("w")
        )
        wait_for(again_out, lambda e: e.get("event") == "round" and e["participants"] == 2, 90)
        assert "continuing the round clock" in (tmp_path / "again.err").read_text() + again_out.read_text()

        os.kill(second.pid, signal.SIGTERM)  # Ctrl-C's path: leave at the round's end, with a checkpoint
        assert second.wait(timeout=20) == 0
        summary = wait_for(second_out, lambda e: e.get("event") == "summary", 1)
        assert summary["stopped"] is True and summary["rounds"] >= 1
        state = CheckpointStore(tmp_path / "checkpoints").load_latest()  # weights_only
        assert state is not None and state["algorithm"] == "demo" and state["steps"] >= 1
    finally:
        for process in (first, second):
            if process is not None:
                kill(process)


def _seen_from_outside(common: list[str], address: str, metrics: str, peer_ids: list[str]) -> None:
    """Two peers of run `twice` train together: what Prometheus (the first peer's `metrics`), `shoal
    status`, `shoal check` and a peer with another configuration see of them."""
    ids = set(peer_ids)
    exposition = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    assert f'peer_id="{peer_ids[0]}"' in exposition  # shoal_build_info
    assert "\nshoal_round_participants 2.0\n" in exposition
    in_use = shoal("join", *common, "--metrics-port", metrics.rpartition(":")[2], timeout=60)
    assert in_use.returncode == 2 and "in use" in in_use.stderr and "--metrics-port" in in_use.stderr
    status = shoal("status", "--initial-peers", address, "--run", "twice", "--json", timeout=60)
    assert status.returncode == 0, status.stderr[-2000:]
    peers = json.loads(status.stdout)["peers"]
    assert {p["peer_id"] for p in peers} == ids
    assert all(p["samples"] > 0 and p["throughput"] > 0 and p["version"] for p in peers)
    wide = {**os.environ, "COLUMNS": "200"}
    table = shoal("status", "--initial-peers", address, "--run", "twice", timeout=60, env=wide)
    assert all(peer_id in table.stdout for peer_id in ids), table.stdout

    check = shoal("check", "--initial-peers", address, "--run", "twice", "--json", timeout=90)
    assert check.returncode == 0, check.stderr[-2000:]
    network = json.loads(check.stdout)["network"]
    assert network["bootstrap"] == "ok" and network["run_peers"] == 2
    assert set(network["bandwidth_mbit_s"]) == ids
    assert all(isinstance(v, float) and v > 1 for v in network["bandwidth_mbit_s"].values()), network

    other = shoal("join", *common, "--initial-peers", address, "--topk", "4", timeout=90)
    assert other.returncode == 2  # a setting to fix
    assert "every peer of this run has another configuration" in other.stderr
    assert "--topk 32 in the run, 4 here" in other.stderr


@pytest.mark.timeout(120)
def test_unreachable_bootstrap_exits_1_saying_what_was_tried():
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWAWh5yFSnH2mTeaEXarpiTHz6NtC5BLTA3wBDS8pD1tn7"
    result = shoal("join", "--host", "127.0.0.1", "--initial-peers", nobody, timeout=110)
    assert result.returncode == 1
    assert "could not join the swarm" in result.stderr
    assert "TCP 127.0.0.1:9 refused the connection" in result.stderr
    assert "Traceback" not in result.stderr
