"""`shoal demo`: a local swarm of `shoal join` processes and a coordinator on 127.0.0.1, training the
embedded GPT with no download (peer/cli/local_swarm.py runs it)."""

import argparse
import os
import sys

from shoal.peer.cli.flags import positive_int
from shoal.peer.config import settings as settings_module

HELP = "a local swarm of peer processes training the embedded model, no download"
DESCRIPTION = (
    "Start a swarm of `shoal join` processes on 127.0.0.1 that train the embedded byte-level "
    "GPT on the Python standard library's sources; show their rounds live and end with a summary."
)


RUN_FLAGS = {
    "--compression": "reference or compact (DeMo), int8 or sparse (DiLoCo)",
    "--topk": "values sent per chunk",
    "--value-bits": "bits per sent value",
    "--chunk": "side of the chunks",
    "--gather": "at most G payloads count in a round, each peer pulling only those",
}
"""Run settings the demo passes to its peers as given (each checked by shoal join's rules first)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peers", type=positive_int, default=4, help="peer processes (default: 4)")
    parser.add_argument("--rounds", type=positive_int, default=20, help="rounds to train (default: 20)")
    parser.add_argument(
        "--algorithm", choices=list(settings_module.ALGORITHMS), default="demo", help="default: demo"
    )
    parser.add_argument(
        "--averaging",
        choices=["gather", "butterfly"],
        default="gather",
        help="DiLoCo: how rounds are averaged (see shoal join --help; default: gather)",
    )
    for flag, help_text in RUN_FLAGS.items():
        parser.add_argument(flag, help=help_text + " (as shoal join; default: the algorithm's)")
    parser.add_argument("--round-seconds", type=float, default=3.0, help="length of a round (default: 3)")
    parser.add_argument("--model", choices=["tiny", "small", "base"], default="tiny", help="default: tiny")
    parser.add_argument(
        "--no-coordinator",
        dest="coordinator",
        action="store_false",
        help="no coordinator process: rounds follow the clock alone (uncoordinated mode)",
    )
    parser.add_argument(
        "--slow-peer",
        type=int,
        metavar="I",
        help="peer I sleeps in every compute phase: the coordinator leaves it out as a straggler",
    )
    parser.add_argument(
        "--metrics-targets",
        metavar="PATH",
        help="write the Prometheus file_sd target file of the peers' and coordinator's metrics endpoints "
        "here, e.g. deploy/prometheus/targets/demo.json (default: in the demo's log folder)",
    )
    parser.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="keep the peers' and the coordinator's logs, the checkpoints and the coordinator's state in DIR "
        "(default: a temporary folder, removed at the end unless the demo fails)",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end (the live view goes to stderr): peers, rounds, initial_loss, "
        "final_loss, validation_loss, param_hash_agree, bytes_sent_per_peer_per_round, wall_s",
    )


def _usage_error(args: argparse.Namespace) -> str | None:
    if not 0.5 <= args.round_seconds <= 3600:
        return "--round-seconds must be in [0.5, 3600]"
    if args.slow_peer is not None and not 0 <= args.slow_peer < args.peers:
        return f"--slow-peer must be in [0, {args.peers - 1}]"
    try:  # the peers' own check, before any of them starts
        settings_module.resolve(
            {"algorithm": args.algorithm, "averaging": args.averaging, **_run_flags(args)}, {}
        )
    except settings_module.SettingsError as error:
        return str(error)
    if args.keep_logs and os.path.exists(args.keep_logs) and not _empty_folder(args.keep_logs):
        # the peers would resume from the checkpoints there, the coordinator from its state
        return f"--keep-logs {args.keep_logs}: not an empty folder (a previous demo's?): choose a new one"
    return None


def _run_flags(args: argparse.Namespace) -> dict[str, str]:
    return {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag in RUN_FLAGS}


def _empty_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


def run(args: argparse.Namespace) -> int:
    error = _usage_error(args)
    if error:
        print(f"shoal demo: error: {error}", file=sys.stderr)
        return 2
    from shoal.peer.cli import local_swarm

    return local_swarm.main(
        peers=args.peers,
        rounds=args.rounds,
        algorithm=args.algorithm,
        averaging=args.averaging,
        round_seconds=args.round_seconds,
        model=args.model,
        as_json=args.json,
        coordinator=args.coordinator,
        slow_peer=args.slow_peer,
        metrics_targets=args.metrics_targets,
        keep_logs=args.keep_logs,
        codec=tuple(
            part
            for name, value in _run_flags(args).items()
            if value
            for part in (f"--{name.replace('_', '-')}", value)
        ),
    )
