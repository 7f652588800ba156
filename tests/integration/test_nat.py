"""Volunteers behind home NATs train through a `shoal bootstrap` node (shoal.peer.swarm.relay).

The topology is real (shoal.peer.bench.netlab): a bridge with addresses in 198.18.0.0/15, the
bootstrap node on it, and each peer in a home network of its own behind a router namespace that
masquerades (iptables MASQUERADE, FORWARD policy DROP but for replies): the peers can dial the
bootstrap and nobody can dial them. Before the relay, such peers each trained alone (a pull between
them failed with "routing: not found") and ended on different models.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.peer.bench import netlab
from shoal.peer.bench.netlab import NetLab
from tests.integration.harness import ROOT, SHOAL, events, listening, metrics, wait_for, wait_until

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}  # as harness.spawn: two torch threads per peer on 2 cores
# oversubscribe them (compute phases of 25 s in a 5 s window were seen)
reason = netlab.available(nat=True)
pytestmark = pytest.mark.skipif(reason is not None, reason=reason or "")


def start_bootstrap(lab: NetLab, tmp_path: Path, *extra: str, name: str = "bootstrap") -> tuple[str, str]:
    """`shoal bootstrap` on node 0 (public); returns its address and its metrics URL."""
    address_file = tmp_path / f"{name}.address"
    out = tmp_path / f"{name}.out"
    host = lab.address(0)
    argv = [*SHOAL, "bootstrap", "--host", host, "--public", "--metrics-port", "0"]
    node = lab.popen(
        0,
        [*argv, "--address-file", str(address_file), *extra],
        stdout=out.open("w"),
        stderr=subprocess.STDOUT,
        env=ENV,
    )

    def started() -> tuple[str, str] | None:
        found = re.search(r"(http://\S+/metrics)", out.read_text()) if out.exists() else None
        if found and address_file.exists() and address_file.read_text().strip():
            return address_file.read_text().strip(), found.group(1)
        return None

    return wait_until(
        started, 60, "the bootstrap node's address and metrics", processes=[node], logs=[out], interval_s=0.3
    )


def join(lab: NetLab, node: int, tmp_path: Path, address: str, *flags: str) -> Path:
    """`shoal join --initial-peers <bootstrap>` in node `node`'s home, with no network flags."""
    out = tmp_path / f"peer{node}.jsonl"
    argv = [*SHOAL, "join", "--initial-peers", address, "--run", "home", "--model", "tiny", *flags]
    lab.popen(
        node,
        [*argv, "--log-format", "json"],
        stdout=out.open("w"),
        stderr=(tmp_path / f"peer{node}.err").open("w"),
        env=ENV,
    )
    return out


def summaries(outs: list[Path], timeout_s: float) -> list[dict]:
    return [wait_for(out, lambda e: e.get("event") == "summary", timeout_s) for out in outs]


def check_swarm(outs: list[Path], until_round: int) -> list[dict]:
    """Every peer ends on one model, knew it was behind NAT, and its payload reached the others in at
    least 90% of the rounds once the swarm was whole (participants = all of them)."""
    done = summaries(outs, 30)
    assert len({s["param_hash"] for s in done}) == 1, done
    started = [next(e for e in events(out) if e.get("event") == "started") for out in outs]
    for event in started:
        assert event["reachable"] is False and len(event["relays"]) == 1, event
        assert event["observed"].startswith("/ip4/198.18.0."), event
    rounds = [[e for e in events(out) if e.get("event") == "round"] for out in outs]
    # a joiner first takes the swarm's state (its contributions before are stale): for each peer the
    # swarm is whole from the first round it counted every peer, at most 4 rounds after the last one's
    # first (a peer alone reads the announcements once a round, early, and may find a newcomer only on
    # its next read of the peer list: the two see each other a round or two apart)
    last_first = max(peer_rounds[0]["round"] for peer_rounds in rounds)
    for peer_rounds in rounds:
        whole = min(e["round"] for e in peer_rounds if e["participants"] == len(outs))
        assert whole <= last_first + 4, rounds
        later = [e for e in peer_rounds if e["round"] >= whole]
        assert len(later) >= until_round - whole, peer_rounds
        full = sum(e["participants"] == len(outs) for e in later)
        assert full >= 0.9 * len(later), [(e["round"], e["participants"]) for e in peer_rounds]
    assert all(s["via_relay"].get("payload", 0) > 0 for s in done), done
    return done


@pytest.mark.timeout(300)
def test_three_peers_behind_nat_train_demo_through_a_bootstrap_relay_to_one_model(tmp_path):
    with NetLab(4, None, homes=[1, 2, 3]) as lab:
        address, url = start_bootstrap(lab, tmp_path)
        flags = ["--round-seconds", "3", "--until-round", "17"]
        outs = [join(lab, 1, tmp_path, address, *flags, "--discover-seconds", "0")]
        first = wait_for(outs[0], lambda e: e.get("event") == "started", 60)
        # a NAT'd first peer's join command names the relay, not its private address
        assert first["join_command"].startswith(f"shoal join --initial-peers {address} --run home")
        wait_for(outs[0], lambda e: e.get("event") == "round", 60)
        outs += [join(lab, node, tmp_path, address, *flags) for node in (2, 3)]
        wait_for(outs[0], lambda e: e.get("event") == "round" and e["participants"] == 3, 120)
        assert metrics(lab, url)["shoal_bootstrap_connections"] >= 3
        summaries(outs, 180)
        check_swarm(outs, 17)
        seen = metrics(lab, url)
        assert seen['shoal_relay_sent_bytes_total{kind="payload"}'] > 0, seen
        # each payload is fetched from its author once and served from the cache to the other asking peer
        assert seen['shoal_relay_streams_total{kind="cached"}'] > 0, seen
        fetched = seen['shoal_relay_fetched_bytes_total{kind="payload"}']
        assert seen['shoal_relay_sent_bytes_total{kind="payload"}'] >= 1.5 * fetched, seen


@pytest.mark.timeout(420)
def test_under_a_coordinator_peers_that_lose_the_relay_sit_out_without_stretching_the_rounds(tmp_path):
    """The public node also runs `shoal coordinator`: every round is coordinated and every payload
    crosses the relay. Then the bootstrap is killed (relay and DHT gone, the coordinator up), so no
    payload can arrive: the exchange window does not grow (a peer reports only the time until the
    payloads it got: before, it grew by half each round), and each peer is told that it reaches nobody
    and sits the rounds out. Once the bootstrap is back they take part again and end on one model."""
    with NetLab(3, None, homes=[1, 2]) as lab:
        fixed = ["--port", "31337", "--identity", str(tmp_path / "bootstrap.key")]
        address, _ = start_bootstrap(lab, tmp_path, *fixed)
        node = lab._processes[-1]
        listen, log = f"{lab.address(0)}:7733", tmp_path / "coordinator.out"
        state = ["--state", str(tmp_path / "coordinator.db"), "--min-peers", "2", "--min-compute-s", "2"]
        lab.popen(
            0, [*SHOAL, "coordinator", "--listen", listen, *state, "--log-format", "json"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
        flags = ["--coordinator", listen, "--round-seconds", "3", "--until-round", "40"]
        outs = [join(lab, 1, tmp_path, address, *flags, "--discover-seconds", "0")]
        outs.append(join(lab, 2, tmp_path, address, *flags, "--discover-seconds", "30"))
        whole = wait_for(outs[1], lambda e: e.get("event") == "round" and e["participants"] == 2, 120)
        steady = wait_for(
            outs[1], lambda e: e.get("event") == "round" and e["round"] >= whole["round"] + 15, 90
        )
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        for out in outs:
            wait_for(out, lambda e: e.get("event") == "isolated" and e["isolated"], 90)
        lost = max(e["round"] for out in outs for e in events(out) if e.get("event") == "round")
        start_bootstrap(lab, tmp_path, *fixed, name="restarted")
        back = [
            wait_for(out, lambda e: e.get("event") == "isolated" and not e["isolated"], 120) for out in outs
        ]
        done = summaries(outs, 240)
        assert len({s["param_hash"] for s in done}) == 1, done
        assert all(s["isolated_rounds"] >= 1 and s["via_relay"]["payload"] > 0 for s in done), done
        for out in outs:  # while the relay was up, every round had both
            rounds = [e for e in events(out) if e.get("event") == "round"]
            before = [e for e in rounds if whole["round"] <= e["round"] <= steady["round"]]
            assert sum(e["participants"] == 2 for e in before) >= 0.9 * len(before), before
            assert max(e["round_s"] for e in before) < 10, before
        windows = {
            int(number): float(exchange) - float(compute)
            for number, compute, exchange in re.findall(
                r"round (\d+): \d+ peers, compute until \+([\d.]+) s, exchange until \+([\d.]+) s",
                log.read_text(),
            )
        }
        steady_max = max(w for r, w in windows.items() if whole["round"] < r <= steady["round"] + 1)
        apart = [w for r, w in windows.items() if steady["round"] + 1 < r <= max(b["round"] for b in back)]
        assert apart and max(apart) <= steady_max + 0.5, (steady_max, apart, lost)


@pytest.mark.timeout(360)
def test_three_peers_behind_nat_average_diloco_piece_by_piece_through_the_relay(tmp_path):
    """Butterfly averaging under a coordinator, every peer behind NAT: each piece and each owner's mean
    crosses the relay (forwarded, not kept), and no piece has to be averaged again for a lost owner."""
    with NetLab(4, None, homes=[1, 2, 3]) as lab:
        address, url = start_bootstrap(lab, tmp_path)
        listen = f"{lab.address(0)}:7733"
        state = ["--state", str(tmp_path / "coordinator.db"), "--min-peers", "3", "--min-compute-s", "3"]
        lab.popen(
            0, [*SHOAL, "coordinator", "--listen", listen, *state],
            stdout=(tmp_path / "coordinator.out").open("w"), stderr=subprocess.STDOUT, env=ENV,
        )  # fmt: skip
        flags = ["--coordinator", listen, "--algorithm", "diloco", "--averaging", "butterfly"]
        flags += ["--inner-steps", "4", "--round-seconds", "3", "--until-round", "10"]
        outs = [join(lab, 1, tmp_path, address, *flags, "--discover-seconds", "0")]
        outs += [join(lab, node, tmp_path, address, *flags, "--discover-seconds", "30") for node in (2, 3)]
        done = summaries(outs, 300)
        assert len({s["param_hash"] for s in done}) == 1, done
        for summary in done:
            assert summary["butterfly_rounds"] >= 5 and summary["via_relay"]["payload"] > 0, summary
            assert summary["pieces_recomputed"] <= 1, summary
        seen = metrics(lab, url)
        assert seen['shoal_relay_sent_bytes_total{kind="piece"}'] > 0, seen


@pytest.mark.timeout(300)
def test_peers_behind_nat_with_relays_off_are_told_they_reach_nobody_and_sit_out(tmp_path):
    """`shoal join --relay off` behind NAT: the bootstrap still tells each peer it cannot be dialed,
    but they name no relay and pull through none, so they can reach nobody: each one is told so after
    three rounds, and stops announcing what nobody could pull. Each is stopped (SIGTERM) once it has
    sat out three rounds."""
    with NetLab(3, None, homes=[1, 2]) as lab:
        address, url = start_bootstrap(lab, tmp_path)
        flags = ["--round-seconds", "3", "--until-round", "60", "--relay", "off"]
        outs = [join(lab, 1, tmp_path, address, *flags, "--discover-seconds", "0")]
        peers = [lab._processes[-1]]
        wait_for(outs[0], lambda e: e.get("event") == "round", 60)
        outs.append(join(lab, 2, tmp_path, address, *flags))
        peers.append(lab._processes[-1])

        def sat_out(out: Path) -> bool:
            """Told it is isolated, then three more rounds ended (each counted as isolated)."""
            seen = events(out)
            told = next(
                (i for i, e in enumerate(seen) if e.get("event") == "isolated" and e["isolated"]), None
            )
            return told is not None and sum(e.get("event") == "round" for e in seen[told:]) >= 4

        for out, peer in zip(outs, peers, strict=True):
            wait_until(
                lambda out=out: sat_out(out), 150, "three rounds sat out", processes=[peer], logs=[out]
            )
            os.killpg(peer.pid, signal.SIGTERM)
        done = summaries(outs, 60)
        for out, summary in zip(outs, done, strict=True):
            started = next(e for e in events(out) if e.get("event") == "started")
            assert started["reachable"] is False and started["relays"] == [], started
            assert summary["isolated_rounds"] >= 3 and not summary["via_relay"], summary
            text = out.read_text()
            assert "it can reach none of them" in text and "relays off" in text
        seen = metrics(lab, url)
        assert seen.get('shoal_relay_sent_bytes_total{kind="payload"}', 0) == 0, seen


def test_netlab_homes_cannot_be_dialed_but_dial_out(tmp_path):
    """The topology the tests above rely on: a home node reaches the public node, the public node and
    the other home cannot reach it (a listener at home gets no connection)."""
    with NetLab(3, None, homes=[1, 2]) as lab:
        listen = (
            "import socket,sys; s=socket.socket(); s.bind(('0.0.0.0', 7000)); s.listen(); s.settimeout(8)\n"
        )
        listen += "try:\n    s.accept(); print('accepted')\nexcept OSError:\n    print('nothing')\n"
        dial = "import socket,sys\ntry:\n    socket.create_connection((sys.argv[1], 7000), timeout=3)\n"
        dial += "    print('open')\nexcept OSError as e:\n    print('closed')\n"
        server = lab.popen(0, ["python3", "-c", listen], stdout=subprocess.PIPE, text=True)
        home = lab.popen(1, ["python3", "-c", listen], stdout=subprocess.PIPE, text=True)
        wait_until(
            lambda: listening(lab.namespace(0), 7000) and listening(lab.namespace(1), 7000),
            20,
            "the listeners of nodes 0 and 1",
            processes=[server, home],
        )
        outward = subprocess.run(
            ["ip", "netns", "exec", lab.namespace(2), "python3", "-c", dial, lab.address(0)],
            capture_output=True,
            text=True,
            timeout=20,
        )
        inward = [
            subprocess.run(
                ["ip", "netns", "exec", lab.namespace(n), "python3", "-c", dial, target],
                capture_output=True,
                text=True,
                timeout=20,
            )
            for n, target in ((0, lab.address(1)), (2, lab.address(1)), (0, lab.lan_address(1)))
        ]
        assert outward.stdout.strip() == "open"
        assert [r.stdout.strip() for r in inward] == ["closed"] * 3
        assert server.communicate(timeout=20)[0].strip() == "accepted"
        assert home.communicate(timeout=20)[0].strip() == "nothing"


@pytest.mark.timeout(180)
def test_shoal_check_says_public_behind_nat_with_a_relay_or_unreachable(tmp_path):
    with NetLab(3, None, homes=[1]) as lab:
        address, _ = start_bootstrap(lab, tmp_path)

        def check(node: int, *initial: str) -> dict:
            argv = [
                *SHOAL,
                "check",
                "--run",
                "home",
                "--json",
                *(["--initial-peers", *initial] if initial else []),
            ]
            done = subprocess.run(
                ["ip", "netns", "exec", lab.namespace(node), *argv],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            return json.loads(done.stdout)["network"]["reachability"]

        home, public, alone = check(1, address), check(2, address), check(1)
        assert home["case"] == "nat_relayed" and "198.18.0.2" in home["advice"], home
        assert public["case"] == "public" and "dialled this machine back" in public["advice"], public
        assert alone["case"] == "unreachable" and "shoal bootstrap" in alone["advice"], alone


@pytest.mark.timeout(300)
def test_the_bootstrap_killed_and_restarted_mid_run_leaves_no_split(tmp_path):
    """While the only relay is down, the two NAT'd peers train alone; once it is back (same identity and
    port), they find each other again, one re-syncs with the other's state, and they end on one model."""
    with NetLab(3, None, homes=[1, 2]) as lab:
        fixed = ["--port", "31337", "--identity", str(tmp_path / "bootstrap.key")]
        address, _ = start_bootstrap(lab, tmp_path, *fixed)
        node = lab._processes[-1]
        flags = ["--round-seconds", "3", "--until-round", "24"]
        outs = [join(lab, 1, tmp_path, address, *flags, "--discover-seconds", "0")]
        wait_for(outs[0], lambda e: e.get("event") == "round", 60)
        outs.append(join(lab, 2, tmp_path, address, *flags))
        # both have seen each other (one may pull the other's payload a round before it is pulled from)
        pair = lambda e: e.get("event") == "round" and e["participants"] == 2  # noqa: E731
        joined = max((wait_for(out, pair, 90) for out in outs), key=lambda e: e["round"])
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()
        alone = wait_for(
            outs[0],
            lambda e: e.get("event") == "round" and e["participants"] == 1 and e["round"] > joined["round"],
            60,
        )
        again, _ = start_bootstrap(lab, tmp_path, *fixed, name="restarted")
        assert again == address
        back = wait_for(
            outs[0],
            lambda e: e.get("event") == "round" and e["participants"] == 2 and e["round"] > alone["round"],
            90,
        )
        done = summaries(outs, 120)
        assert len({s["param_hash"] for s in done}) == 1, done
        # the two had forked while apart: one took the other's state, by download or by replay
        assert sum(s["resyncs"] + s["replays"] for s in done) >= 1, done
        later = [e for e in events(outs[0]) if e.get("event") == "round" and e["round"] >= back["round"]]
        assert sum(e["participants"] == 2 for e in later) >= 0.9 * len(later), later
        told = [e["alone"] for e in events(outs[0]) if e.get("event") == "alone"]
        assert told[:2] == [True, False], told  # told it lost the swarm, and that it is back
        # said as alone (it sees nobody: it dials its initial peers), or as seeing peers whose payloads
        # no longer count (their records outlive the relay that reached them)
        said = outs[0].read_text()
        dials, sees = "it trains alone and dials its initial peers", "no other peer's payload counted"
        assert dials in said or sees in said, said[-3000:]


@pytest.mark.timeout(180)
def test_a_peer_behind_nat_that_says_it_can_be_dialed_is_counted_and_reached_through_the_relay(tmp_path):
    """A hostile peer's record says it can be dialed; it sits behind NAT. The honest peer's pulls from
    it fail, the relay serves them, and the false claim is counted once (`false_reachable`) and named;
    both train eager DiLoCo on one model, its payloads (every value at 8 bits: about 27 times DeMo's)
    crossing the relay (DeMo's cross it in the three-peer test above)."""
    with NetLab(3, None, homes=[1, 2]) as lab:
        address, _ = start_bootstrap(lab, tmp_path)
        start = time.time() + 12
        reports = [tmp_path / f"peer{node}.json" for node in (1, 2)]
        for node, report in zip((1, 2), reports, strict=True):
            argv = [
                sys.executable, "-m", "tests.integration.swarm_peer", "--initial-peer", address, "--host",
                "0.0.0.0", "--start", str(start), "--round-seconds", "2", "--until-round", "10", "--out",
                str(report), "--algorithm", "diloco-eager", *(["--fault", "claim_reachable@0"] * (node == 2)),
            ]  # fmt: skip
            lab.popen(
                node, argv, cwd=ROOT, env={**ENV, "PYTHONPATH": str(ROOT)},
                stdout=(tmp_path / f"peer{node}.out").open("w"), stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_until(
            lambda: all(report.exists() for report in reports),
            150,
            "both peers' reports",
            logs=[tmp_path / f"peer{node}.out" for node in (1, 2)],
            interval_s=1,
        )
        honest, liar = (json.loads(report.read_text()) for report in reports)
        assert honest["rejected"].get("false_reachable") == 1, honest
        assert "says it can be dialed, but it could not be" in (tmp_path / "peer1.out").read_text()
        assert honest["via_relay"].get("payload", 0) > 0 and liar["via_relay"].get("payload", 0) > 0
        assert "false_reachable" not in liar["rejected"], liar  # the honest peer said it is behind NAT
        assert honest["param_hash"] == liar["param_hash"], (honest, liar)
        assert sum(p == 2 for p in honest["participants"]) >= 0.8 * len(honest["participants"]), honest
