"""What monitoring a local swarm costs and shows: `shoal demo` (4 peers and a coordinator) scraped by a
real Prometheus with prometheus.yml as it ships, for 90 s after every target is up; prints one JSON
object (the figures of BENCHMARKS.md, "Monitoring"). A benchmark, not a test.

    python deploy/prometheus/measure_demo.py [--peers 4] [--seconds 90]

Needs `prometheus` on PATH (Debian: apt-get install prometheus) and shoal installed.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
QUERIES = {
    "scrape_duration_s_peer_max": 'max(scrape_duration_seconds{role="peer"})',
    "scrape_duration_s_coordinator": 'max(scrape_duration_seconds{role="coordinator"})',
    "samples_per_peer_scrape": 'max(scrape_samples_scraped{role="peer"})',
    "samples_per_coordinator_scrape": 'max(scrape_samples_scraped{role="coordinator"})',
    "round": "max(shoal_round)",
    "tokens_per_s": "sum(rate(shoal_tokens_total[1m]))",
    "compression_ratio": "avg(shoal_compression_ratio)",
    "payload_bytes": "avg(shoal_payload_bytes)",
    "payload_bytes_sent_per_peer_round": 'sum(rate(shoal_sent_bytes_total{kind="payload"}[1m]))'
    " / sum(rate(shoal_rounds_total[1m]))",
    "dht_bytes_sent_per_peer_round": 'sum(rate(shoal_sent_bytes_total{kind="dht"}[1m]))'
    " / sum(rate(shoal_rounds_total[1m]))",
    "memory_bytes_peer_max": "max(shoal_device_memory_used_bytes)",
    "alerts_firing": 'count(ALERTS{alertstate="firing"}) or vector(0)',
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=90)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="shoal-monitoring-"))
    shutil.copytree(HERE, scratch / "prometheus", ignore=shutil.ignore_patterns("*.py"))
    targets = scratch / "prometheus" / "targets" / "demo.json"
    started = time.time()
    command = [sys.executable, "-m", "shoal.peer.cli", "demo", "--peers", str(args.peers)]
    command += ["--rounds", "100000", "--round-seconds", "3", "--json", "--metrics-targets", str(targets)]
    demo = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=(scratch / "demo.log").open("w"),
        start_new_session=True,
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = ["prometheus", f"--config.file={scratch / 'prometheus' / 'prometheus.yml'}"]
    command += [f"--storage.tsdb.path={scratch / 'data'}", f"--web.listen-address=127.0.0.1:{port}"]
    server = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        result = {"peers": args.peers, "targets_up_after_s": _wait_up(base, args.peers + 1, started)}
        time.sleep(args.seconds)
        for name, expr in QUERIES.items():
            answer = _query(base, expr)
            result[name] = float(answer[0]["value"][1]) if answer else None
        endpoint = json.loads(targets.read_text())[0]["targets"][0]
        with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as response:
            result["peer_exposition_bytes"] = len(response.read())
        print(json.dumps(result, indent=1))
        return 0
    finally:
        for process in (demo, server):
            os.killpg(process.pid, signal.SIGTERM)
        for process in (demo, server):
            process.wait(timeout=60)


def _query(base: str, expr: str) -> list:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())["data"]["result"]


def _wait_up(base: str, count: int, started: float, timeout_s: float = 180) -> float:
    """Seconds from the demo's start until Prometheus scrapes `count` targets successfully."""
    while time.time() - started < timeout_s:
        time.sleep(1)
        try:
            up = _query(base, "sum(up)")
        except OSError:
            continue
        if up and float(up[0]["value"][1]) >= count:
            return time.time() - started
    raise SystemExit(f"fewer than {count} targets up after {timeout_s:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
