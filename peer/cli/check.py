"""`shoal check`: what this machine brings to a swarm, before joining it
(peer/cli/check_report.py measures and prints it)."""

import argparse
import sys

from shoal.peer import settings as settings_module
from shoal.peer.cli.flags import add_swarm_flags, swarm_settings

HELP = "pre-flight: device, versions, reachability, bandwidth to the swarm"
DESCRIPTION = (
    "What this machine brings to a swarm: the device and its memory, torch and CUDA versions, "
    "the addresses it listens on and whether outside peers can reach them (and what to open if not), "
    "and with --initial-peers the DHT round trip and the bandwidth from the run's peers."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_swarm_flags(parser)
    parser.add_argument("--port", type=int, default=0, help="TCP port a peer would listen on (default: any)")
    parser.add_argument("--json", action="store_true", help='print {"device": {...}, "network": {...}}')


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        print("shoal check: error: --port must be in [0, 65535]", file=sys.stderr)
        return 2
    try:
        initial_peers, run_name = swarm_settings(args, required=False)
    except settings_module.SettingsError as error:
        print(f"shoal check: error: {error}", file=sys.stderr)
        return 2
    from shoal.peer.cli import check_report  # imports torch and hivemind: only now

    return check_report.main(initial_peers, run_name, args.port, as_json=args.json)
