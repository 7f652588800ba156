"""`shoal status`: the run's peers as their signed DHT records describe them
(peer/cli/status_report.py reads and prints them)."""

import argparse
import sys

from shoal.peer.cli.flags import add_swarm_flags, swarm_settings
from shoal.peer.config import settings as settings_module

HELP = "the swarm's peers, from the DHT"
DESCRIPTION = (
    "A table of the run's peers as their signed DHT records describe them: id, version, "
    "device, throughput, round, last seen, samples contributed, the swarm's data epoch and tokens consumed."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_swarm_flags(parser)
    parser.add_argument(
        "--json", action="store_true", help='print {"run", "peers": [...], "malformed_records"}'
    )


def run(args: argparse.Namespace) -> int:
    try:
        initial_peers, run_name = swarm_settings(args)
    except settings_module.SettingsError as error:
        print(f"shoal status: error: {error}", file=sys.stderr)
        return 2
    from shoal.peer.cli import status_report  # imports hivemind: only now
    from shoal.peer.swarm.bootstrap import BootstrapError

    try:
        return status_report.main(initial_peers, run_name, as_json=args.json)
    except BootstrapError as error:
        print(f"shoal status: error: {error}", file=sys.stderr)
        return 1
