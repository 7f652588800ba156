"""`shoal check`: what this machine brings to a swarm, before joining it
(peer/cli/check_report.py measures and prints it)."""

import argparse
import sys

from shoal.peer.cli.flags import add_swarm_flags, swarm_settings
from shoal.peer.cli.join import JOIN_FLAGS
from shoal.peer.config import settings as settings_module

HELP = "pre-flight: device, versions, reachability, bandwidth to the swarm, whether a model fits"
DESCRIPTION = (
    "What this machine brings to a swarm: the device and its memory, torch and CUDA versions, "
    "the addresses it listens on and whether outside peers can reach them (and what to open if not), "
    "with --initial-peers the DHT round trip and the bandwidth from the run's peers, and with --model "
    "whether the model fits this device's memory and the round's compute window with --algorithm "
    "(estimated, then measured by a dry run), at which micro-batch; exit 2 if it cannot fit."
)


FIT_FLAGS = (
    "model",
    "algorithm",
    "compression",
    "inner_steps",
    "device",
    "batch_size",
    "seq_len",
    "precision",
    "activation_checkpointing",
    "max_memory",
    "round_seconds",
    "compute_fraction",
)
"""`shoal join`'s flags that say whether a model fits (shoal.peer.train.fit); with --model, check tells."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_swarm_flags(parser)
    parser.add_argument("--port", type=int, default=0, help="TCP port a peer would listen on (default: any)")
    parser.add_argument(
        "--json", action="store_true", help='print {"device": {...}, "network": {...}, "fit": {...}}'
    )
    for name in FIT_FLAGS:
        metavar, text = JOIN_FLAGS[name]
        more = " (with --model: whether it fits this device, as shoal join would run it)" * (name == "model")
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar=metavar, help=text + more)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        print("shoal check: error: --port must be in [0, 65535]", file=sys.stderr)
        return 2
    try:
        initial_peers, run_name = swarm_settings(args, required=False)
        given = {name: getattr(args, name) for name in FIT_FLAGS}
        spec = settings_module.resolve(given, {}) if args.model is not None else None
        if spec is not None:
            from shoal.peer.config import preflight

            preflight.check_inputs(spec)  # the model's files as shoal join reads them, before torch
    except settings_module.SettingsError as error:
        print(f"shoal check: error: {error}", file=sys.stderr)
        return 2
    from shoal.peer.cli import check_report  # imports torch and hivemind: only now

    return check_report.main(initial_peers, run_name, args.port, as_json=args.json, spec=spec)
