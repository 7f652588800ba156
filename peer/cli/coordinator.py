"""`shoal coordinator`: the swarm's optional gRPC coordinator; its flags and its start are
shoal.coordinator.cli's, which needs no torch."""

import argparse

from shoal.coordinator import cli as coordinator_cli

HELP = "run a swarm's coordinator (gRPC): round deadlines, participant sets, stragglers"
DESCRIPTION = (
    "Serve the optional coordinator of a swarm: it announces each round's deadlines, fixes "
    "its exact participant set, leaves stragglers out and evicts repeated ones. Peers follow it with "
    "shoal join --coordinator HOST:PORT and train on without it while it is unreachable. Its state is "
    "kept in SQLite, so a restart continues the rounds. Needs no torch."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    coordinator_cli.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return coordinator_cli.run(args)
