"""A stop's budget and its watchdog (shoal.peer.stopping), and the deployments' stop timeouts that
rest on it: systemd, compose and Kubernetes must let a peer's stop run to its end (issue 74)."""

import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from shoal.peer.node import DRAIN_MAX_S, stop_budget
from shoal.peer.stopping import WATCHDOG_MARGIN_S, StopRequest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
LONGEST_DOCUMENTED_ROUND_S = 45.0  # the deploy READMEs: raise the timeouts for longer rounds


def test_a_second_signal_spends_the_budget_at_once():
    stop = StopRequest(grace_s=30.0)
    assert not stop.is_set() and stop.remaining() is None and not stop.spent()
    stop.signalled()
    assert stop.is_set() and not stop.urgent and 29.0 < stop.remaining() <= 30.0 and not stop.spent()
    stop.signalled()
    assert stop.urgent and stop.remaining() == 0.0 and stop.spent()


def test_a_stop_without_a_budget_is_never_spent():
    stop = StopRequest()
    stop.set()
    stop.set()  # a second set is not a second signal
    assert stop.is_set() and not stop.urgent and not stop.spent() and stop.remaining() is None


def test_the_budget_covers_a_round_longer_than_the_drain():
    assert stop_budget(4.0) == DRAIN_MAX_S
    assert stop_budget(60.0) == 65.0


def test_the_watchdog_ends_a_stop_that_outlasts_its_budget(tmp_path):
    """A process whose main thread never returns (a wait on a helper that died): the watchdog runs
    its cleanup and exits 0 shortly past the budget; without a stop it does nothing."""
    marker = tmp_path / "cleaned"
    code = textwrap.dedent(f"""
        import time
        from shoal.peer.stopping import StopRequest, Watchdog
        stop = StopRequest(grace_s=0.3)
        Watchdog(stop, before_exit=lambda: open({str(marker)!r}, "w").close(), margin_s=0.4)
        time.sleep(1.0)
        print("not stopped: still running", flush=True)
        stop.set()
        time.sleep(60)
    """)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "still running" in result.stdout and "exiting now" in result.stderr
    assert marker.exists()
    assert time.monotonic() - started < 20


def _seconds(text: str) -> float:
    found = re.fullmatch(r"(\d+)(s?)", text.strip())
    assert found, text
    return float(found.group(1))


def test_every_deployment_lets_a_stop_run_to_its_end():
    """The longest stop a documented round allows, and the watchdog's margin, fit in each
    deployment's stop timeout; systemd signals the main process (mixed) or all (control-group)."""
    longest = stop_budget(LONGEST_DOCUMENTED_ROUND_S) + WATCHDOG_MARGIN_S
    unit = (DEPLOY / "systemd" / "shoal-peer.service").read_text()
    settings = dict(re.findall(r"^(\w+)=(.*)$", unit, re.MULTILINE))
    assert settings["KillSignal"] == "SIGTERM"
    assert settings.get("KillMode", "control-group") in ("mixed", "control-group")
    assert _seconds(settings["TimeoutStopSec"]) > longest
    compose = (DEPLOY / "docker" / "compose.yml").read_text()
    graces = re.findall(r"stop_grace_period: (\w+)", compose)
    assert len(graces) >= 2 and all(_seconds(g) > longest for g in graces)
    assert "init: true" in compose  # a PID 1 that passes SIGTERM to the peer
    peers = (DEPLOY / "kubernetes" / "peers.yaml").read_text()
    (grace,) = re.findall(r"terminationGracePeriodSeconds: (\d+)", peers)
    assert _seconds(grace) > longest


def test_a_checkpoint_folder_held_by_a_live_peer_is_refused_and_freed_when_it_dies(tmp_path):
    """Two peers on one --checkpoint-dir: the second is refused, naming the first's pid; once the first
    is killed (no chance to clean up), the folder is free again."""
    from shoal.peer.preflight import lock_folder, unlock_folder
    from shoal.peer.settings import SettingsError

    code = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from shoal.peer.preflight import lock_folder
        lock_folder(Path({str(tmp_path)!r}), "--checkpoint-dir")
        print("held", flush=True)
        time.sleep(60)
    """)
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        try:
            lock_folder(tmp_path, "--checkpoint-dir")
        except SettingsError as error:
            assert f"pid {holder.pid}" in str(error) and "--checkpoint-dir" in str(error)
        else:
            raise AssertionError("a folder held by a live peer was taken")
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / "shoal.lock").exists()  # left behind by the killed peer: it claims nothing
    lock_folder(tmp_path, "--checkpoint-dir")
    try:
        assert (tmp_path / "shoal.lock").read_text().strip() == str(__import__("os").getpid())
    finally:
        unlock_folder(tmp_path)
