"""`shoal health [URL ...]`: whether this machine's shoal process answers, for a container's health check.

A peer started with `--metrics-port` and a coordinator with `--metrics-port` serve Prometheus' /metrics
from a thread of their own: an answer there means the process is up and serving, not that its rounds
advance (the alert rules watch that). With no URL it asks the ports the image and the compose and
Kubernetes files use (9300: a peer, 9400: a coordinator), or those SHOAL_HEALTH_URLS lists
(space-separated), and is healthy when any one answers 200. It never goes through a proxy.
"""

import argparse
import os
import sys
import urllib.error
import urllib.request

HELP = "exit 0 when this machine's peer or coordinator answers on its metrics endpoint"
DESCRIPTION = (
    "Ask each URL (default: SHOAL_HEALTH_URLS, else http://127.0.0.1:9300/metrics and "
    "http://127.0.0.1:9400/metrics) and exit 0 when one answers 200, 1 when none does. "
    "The image's HEALTHCHECK runs it."
)
DEFAULT_URLS = ("http://127.0.0.1:9300/metrics", "http://127.0.0.1:9400/metrics")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("urls", nargs="*", metavar="URL", help="endpoints to ask, in order")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds for each (default 5)")


def urls_to_ask(given: list[str], environment: str | None) -> list[str]:
    if given:
        return given
    if environment and environment.split():
        return environment.split()
    return list(DEFAULT_URLS)


def answers(url: str, timeout: float) -> str | None:
    """None when `url` answers 200, else why not."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # http_proxy must not apply
    try:
        with direct.open(url, timeout=timeout) as response:
            return None if response.status == 200 else f"status {response.status}"
    except (urllib.error.URLError, OSError, ValueError) as error:
        return str(getattr(error, "reason", error))


def run(args: argparse.Namespace) -> int:
    failures = []
    for url in urls_to_ask(args.urls, os.environ.get("SHOAL_HEALTH_URLS")):
        why = answers(url, args.timeout)
        if why is None:
            print(f"healthy: {url} answers")
            return 0
        failures.append(f"{url}: {why}")
    print("unhealthy: " + "; ".join(failures), file=sys.stderr)
    return 1
