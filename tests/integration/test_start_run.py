"""A run started through a stock `hivemind-dht` bootstrap node, with no shoal peer to start it: two `shoal
join --initial-peers <the node> --discover-seconds 0` started at the same moment each find no peer of
the run, each start it on its own round clock, and converge on one clock (the earlier: both are
followed by one peer) and one model (real processes on 127.0.0.1)."""

import signal
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from shoal.peer.swarm.exchange import SwarmExchange
from shoal.peer.swarm.records import RoundSchedule
from tests.integration.harness import (
    HIVEMIND_DHT,
    bootstrap_address,
    events,
    kill,
    shoal,
    spawn,
    start,
    swarm,
    wait_for,
)


@pytest.mark.timeout(240)
def test_two_peers_start_a_run_through_a_stock_dht_node_at_once_and_end_on_one_clock(tmp_path):
    node = spawn(
        [str(HIVEMIND_DHT), "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], stderr=subprocess.PIPE, text=True
    )
    peers = []
    try:
        address = bootstrap_address(node)
        flags = ["join", "--initial-peers", address, "--run", "fresh", "--host", "127.0.0.1"]
        flags += [
            "--discover-seconds",
            "0",
            "--round-seconds",
            "2",
            "--until-round",
            "14",
            "--log-format",
            "json",
        ]
        outs = [tmp_path / f"peer{i}.jsonl" for i in range(2)]
        for i, out in enumerate(outs):
            peers.append(start(*flags, stdout=out.open("w"), stderr=(tmp_path / f"peer{i}.err").open("w")))
        for peer in peers:
            assert peer.wait(timeout=200) == 0
        said = [(tmp_path / f"peer{i}.err").read_text() + out.read_text() for i, out in enumerate(outs)]
        assert any("no peer of run 'fresh' found within 0 s: starting the run" in text for text in said), said
        summaries = [wait_for(out, lambda e: e.get("event") == "summary", 1) for out in outs]
        first, second = summaries
        # both started it, and the later clock yielded once; or one found the other's clock first
        assert first["round_clock"] == second["round_clock"]
        assert sum(s["clocks_adopted"] for s in summaries) <= 1
        assert first["param_hash"] == second["param_hash"]
        assert all(s["final_loss"] < s["initial_loss"] for s in summaries)
        assert all(s["rounds"] >= 10 for s in summaries)  # trained together, not one waiting for the other
    finally:
        for process in [node, *peers]:
            kill(process)


@pytest.mark.timeout(120)
def test_peers_that_started_a_run_on_two_clocks_converge_on_the_earlier_one():
    """The rule itself, deterministically: two exchanges of one run, each on its own clock (real DHTs
    and libp2p in this process); after a round apart, the one on the later clock takes the other's and
    from then on they share every round."""
    now = time.time()
    earlier = RoundSchedule(start_time=now + 3, round_seconds=2)
    later = RoundSchedule(start_time=now + 3.7, round_seconds=2)

    def send(exchange: SwarmExchange, r: int) -> list:
        return exchange.gather(bytes([exchanges.index(exchange), r]) * 1000, samples=1)

    with swarm([SwarmExchange] * 2, schedules=[later, earlier]) as (exchanges, _):
        time.sleep(max(0.0, later.start_time + 0.1 - time.time()))  # both clocks' round 0 has begun
        rounds = []
        with ThreadPoolExecutor(2) as pool:
            for r in range(4):
                rounds.append(list(pool.map(send, exchanges, [r, r])))
        assert [len(c) for c in rounds[0]] == [1, 1]  # apart: neither takes the other's announcement
        assert exchanges[0].counts.clocks_adopted == 1 and exchanges[1].counts.clocks_adopted == 0
        assert exchanges[0].schedule == earlier and exchanges[0].record.start_time == earlier.start_time
        assert all(len(contributions) == 2 for pair in rounds[2:] for contributions in pair)
        assert exchanges[0].last_round == exchanges[1].last_round
        assert not exchanges[0].refused and not exchanges[1].refused  # another clock is not another run


@pytest.mark.timeout(240)
def test_a_run_starts_through_shoal_bootstrap_which_counts_its_connections_and_stops_on_sigterm(tmp_path):
    address_file = tmp_path / "bootstrap.address"
    node = start(
        "bootstrap", "--host", "127.0.0.1", "--metrics-port", "0", "--address-file", str(address_file),
        "--run", "fresh", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    peers = []
    try:
        said = [node.stdout.readline() for _ in range(3)]
        address = address_file.read_text().strip()
        assert said[0].startswith(f"Bootstrap node at {address}.") and address.startswith(
            "/ip4/127.0.0.1/tcp/"
        )
        assert said[1].strip() == f"shoal join --initial-peers {address} --run fresh"
        metrics = said[2].strip().rpartition(" ")[2]
        flags = [*said[1].split()[1:], "--host", "127.0.0.1", "--discover-seconds", "0"]
        flags += ["--round-seconds", "2", "--until-round", "8", "--log-format", "json"]
        outs = [tmp_path / f"peer{i}.jsonl" for i in range(2)]
        for i, out in enumerate(outs):
            peers.append(start(*flags, stdout=out.open("w"), stderr=(tmp_path / f"peer{i}.err").open("w")))
        wait_for(outs[0], lambda e: e.get("event") == "round" and e["participants"] == 2, 90)
        exposition = urllib.request.urlopen(metrics, timeout=10).read().decode()
        connected = next(
            line for line in exposition.splitlines() if line.startswith("shoal_bootstrap_connections ")
        )
        assert float(connected.split()[1]) >= 2, exposition
        for peer in peers:
            assert peer.wait(timeout=120) == 0
        summaries = [wait_for(out, lambda e: e.get("event") == "summary", 1) for out in outs]
        assert summaries[0]["param_hash"] == summaries[1]["param_hash"]
        assert summaries[0]["round_clock"] == summaries[1]["round_clock"]
        # a peer that found nobody started the run (one or both: they start at once), and prints the join
        # command again with its run key, which it did not know when it printed its first one
        begun = [e for out in outs for e in events(out) if e.get("event") == "run_started"]
        assert begun, [out.read_text()[-2000:] for out in outs]
        for out in outs:
            started = wait_for(out, lambda e: e.get("event") == "started", 1)
            assert "--trust-key" not in started["join_command"]
            for event in (e for e in events(out) if e.get("event") == "run_started"):
                assert event["join_command"] == f"{started['join_command']} --trust-key {event['run_key']}"
        node.send_signal(signal.SIGTERM)
        assert node.wait(timeout=30) == 0
    finally:
        for process in [node, *peers]:
            kill(process)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--port", "70000"], "--port 70000"),
        (["--run", "no spaces"], "--run"),
        (["--metrics-port", "-1"], "--metrics-port"),
        (["--announce-maddrs", "garbage"], "--announce-maddrs 'garbage' is not a multiaddress"),
        (["--initial-peers", "/ip4/1.2.3.4/tcp/x"], "--initial-peers"),
        (["--identity", "IDENTITY"], "--identity: "),
    ],
)
def test_shoal_bootstrap_refuses_a_bad_flag_with_exit_2_naming_it(tmp_path, flags, said):
    (tmp_path / "identity").write_bytes(b"not a key")  # an identity file that is none
    flags = [str(tmp_path / "identity") if flag == "IDENTITY" else flag for flag in flags]
    result = shoal("bootstrap", "--host", "127.0.0.1", *flags, timeout=50)
    assert result.returncode == 2 and said in result.stderr, result.stderr


@pytest.mark.timeout(180)
def test_an_initial_peer_of_another_run_is_named_counted_and_left_training(tmp_path):
    """`shoal join --initial-peers <a peer of run 'alpha'> --run beta`: no peer of beta shows up, the
    initial peer says it trains alpha. The joiner exits 1 naming alpha (most likely --run was mistyped),
    or with --discover-seconds 0 warns and starts beta; the alpha peer counts both questions
    (`other_run`) and trains on."""
    first = tmp_path / "alpha.jsonl"
    common = ["--host", "127.0.0.1", "--round-seconds", "2", "--log-format", "json"]
    alpha = start("join", "--run", "alpha", *common, "--metrics-port", "0", stdout=first.open("w"))
    beta = None
    try:
        address = wait_for(first, lambda e: e.get("event") == "started", 60)["address"]
        port = wait_for(first, lambda e: e.get("event") == "metrics", 60)["port"]
        before = wait_for(first, lambda e: e.get("event") == "round", 60)["round"]
        joined = shoal(
            "join",
            "--initial-peers",
            address,
            "--run",
            "beta",
            *common,
            "--discover-seconds",
            "2",
            timeout=90,
        )
        assert joined.returncode == 1, joined.stderr
        said = joined.stderr
        assert "no peer of run 'beta' showed up" in said and "trains run 'alpha'" in said, said
        assert "--run alpha" in said and "--discover-seconds 0" in said, said
        out = tmp_path / "beta.jsonl"
        beta = start(
            "join", "--initial-peers", address, "--run", "beta", *common, "--discover-seconds", "0",
            stdout=out.open("w"),
        )  # fmt: skip
        assert wait_for(out, lambda e: e.get("event") == "other_run", 60)["runs"]
        wait_for(out, lambda e: e.get("event") == "round", 60)
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        asked = next(line for line in exposition.splitlines() if 'reason="other_run"' in line)
        assert float(asked.split()[-1]) >= 2, asked
        # alpha trained on, alone: the questions cost it nothing
        later = wait_for(first, lambda e: e.get("event") == "round" and e["round"] >= before + 3, 30)
        assert later["participants"] == 1
    finally:
        for process in (alpha, beta):
            if process is not None:
                kill(process)
