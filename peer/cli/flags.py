"""Flags and argument types that several `shoal` commands share."""

import argparse
import os

from shoal.peer.config import settings as settings_module


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_swarm_flags(parser: argparse.ArgumentParser) -> None:
    """--initial-peers and --run, for the commands that read a swarm without joining it."""
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="peers of the swarm (default: SHOAL_INITIAL_PEERS)",
    )
    parser.add_argument("--run", help="the run's name (default: SHOAL_RUN, else shoal)")


def swarm_settings(args: argparse.Namespace, required: bool = True) -> tuple[list[str], str]:
    """--initial-peers and --run, else their SHOAL_* variables; SettingsError if unusable."""
    peers = args.initial_peers or os.environ.get("SHOAL_INITIAL_PEERS", "").split()
    run = args.run or os.environ.get("SHOAL_RUN") or "shoal"
    if required and not peers:
        raise settings_module.SettingsError(
            f"shoal {args.command} needs --initial-peers (or SHOAL_INITIAL_PEERS): a peer of the swarm"
        )
    try:
        return list(settings_module.PARSERS["initial_peers"](peers)), settings_module.PARSERS["run"](run)
    except ValueError as error:
        raise settings_module.SettingsError(f"--run: {error}") from None
