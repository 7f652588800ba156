"""A real Prometheus (Debian's `prometheus` package) scrapes a running `shoal demo` through
deploy/prometheus/prometheus.yml as it ships, and every query of the Grafana dashboard returns data.

Needs `prometheus` and `promtool` on PATH: `.ci/run` installs them; elsewhere the test is skipped
with the reason (under CI=true it fails instead, so that CI cannot pass without running it).
"""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.integration.harness import free_port, wait_until

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RATE_INTERVAL = "30s"  # what Grafana's $__rate_interval is at a 5 s scrape interval, rounded up

pytestmark = pytest.mark.timeout(240)


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed (.ci/run installs Debian's prometheus package)")
        pytest.skip(f"{tool} is not installed (apt-get install prometheus)")
    return path


def _get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def _query(base: str, expr: str) -> list:
    answer = json.loads(_get(f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def dashboard_queries() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "shoal.json").read_text())
    return [
        target["expr"].replace("$__rate_interval", RATE_INTERVAL)
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]


def _kill_leftovers(marker: str) -> None:
    """SIGKILL every process whose command line mentions `marker` (the demo's peers, should it die)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in command:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


@pytest.fixture
def monitored_demo(tmp_path, short_tmp):
    """A `shoal demo` of 2 peers and a coordinator, and Prometheus scraping it with the shipped config
    (copied unchanged into tmp_path, where the demo writes its targets file). Yields (Prometheus' URL,
    the targets file)."""
    prometheus = _require("prometheus")
    config = tmp_path / "prometheus"
    shutil.copytree(DEPLOY / "prometheus", config)
    targets = config / "targets" / "demo.json"
    scratch = short_tmp  # the demo's logs and checkpoints: every peer's command line names it
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONUNBUFFERED": "1"}
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shoal.peer.cli",
            "demo",
            "--peers",
            "2",
            "--rounds",
            "100000",
            "--round-seconds",
            "2",
            "--json",
            "--metrics-targets",
            str(targets),
        ],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "demo.log").open("w"),
        env=env,
        start_new_session=True,
    )
    port = free_port()
    server = subprocess.Popen(
        [
            prometheus,
            f"--config.file={config / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "prometheus.log").open("w"),
        start_new_session=True,
    )
    try:
        yield f"http://127.0.0.1:{port}", targets
    finally:
        for process in (demo, server):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in (demo, server):
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        _kill_leftovers(str(scratch))


def _wait_for(check, timeout_s: float, what: str, interval_s: float = 2.0) -> None:
    """wait_until `check()` returns True; anything else it returns (or raises, while a server is not up)
    is what it still lacks, and the last of it is said on failure."""
    last: list[object] = [None]

    def done() -> bool:
        try:
            last[0] = check()
        except (OSError, ValueError, KeyError) as error:  # not up yet
            last[0] = error
        return last[0] is True

    wait_until(done, timeout_s, what, logs=[lambda: f"last: {last[0]}"], interval_s=interval_s)


def test_prometheus_scrapes_a_demo_every_dashboard_query_returns_data_and_promtool_passes(monitored_demo):
    base, targets = monitored_demo

    def all_targets_up():
        groups = json.loads(targets.read_text())
        endpoints = {t for g in groups for t in g["targets"]}
        if len(endpoints) < 3:  # 2 peers and the coordinator
            return f"targets file lists {sorted(endpoints)}"
        active = json.loads(_get(f"{base}/api/v1/targets"))["data"]["activeTargets"]
        up = {t["labels"]["instance"] for t in active if t["health"] == "up"}
        return up >= endpoints or f"up: {sorted(up)} of {sorted(endpoints)}"

    _wait_for(all_targets_up, 150, "Prometheus scraping both peers and the coordinator")

    queries = dashboard_queries()
    assert len(queries) >= 20

    def every_query_answers():
        empty = [expr for expr in queries if not _query(base, expr)]
        return not empty or f"no series for {empty}"

    # rates need two scrapes inside their window; the checkpoint age a first checkpoint (round 10)
    _wait_for(every_query_answers, 90, "every dashboard query returning a series", interval_s=5)

    # the series the alert rules read are there, and the rules load and evaluate
    rules = json.loads(_get(f"{base}/api/v1/rules"))["data"]["groups"]
    loaded = {rule["name"]: rule["health"] for group in rules for rule in group["rules"]}
    assert set(loaded) == {
        "ShoalNoRoundProgress",
        "ShoalCoordinatorStalled",
        "ShoalManyStragglers",
        "ShoalPayloadRejections",
        "ShoalStateDrift",
        "ShoalRepeatedResyncs",
    }
    assert set(loaded.values()) == {"ok"}, loaded
    # a healthy demo: peers labelled by role, training, in sync, nothing rejected for a bad reason
    peers = _query(base, 'shoal_round{role="peer", swarm="demo"}')
    assert len(peers) == 2
    assert all(float(s["value"][1]) >= 1 for s in peers)
    assert [s["value"][1] for s in _query(base, "min(shoal_state_in_sync)")] == ["1"]
    assert _query(base, 'shoal_coordinator_active_peers{role="coordinator"}')[0]["value"][1] == "2"
    bad = _query(base, 'sum(shoal_rejected_payloads_total{reason!~"missing|stale_state|probe_rate"})')
    assert bad[0]["value"][1] == "0"

    # every endpoint's exposition passes promtool's own lint, with the per-round series in it
    promtool = _require("promtool")
    for group in json.loads(targets.read_text()):
        for endpoint in group["targets"]:
            exposition = _get(f"http://{endpoint}/metrics")
            assert b"shoal_" in exposition
            check = subprocess.run(
                [promtool, "check", "metrics"], input=exposition, capture_output=True, timeout=30
            )
            assert check.returncode == 0 and not check.stdout.strip(), (endpoint, check.stdout, check.stderr)
