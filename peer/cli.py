"""The `shoal` command line.

    shoal --help
    shoal bench codec [--json] [--repeat N]
    shoal bench converge [--json] [--quick]
    shoal bench swarm-local [--json] [--peers N ...] [--model tiny|10m] [--rounds R] [--round-seconds S]

Subcommands appear here as they are built; there are no placeholders.
"""

import argparse
import sys
from importlib.metadata import version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Decentralized peer-to-peer training: DeMo and DiLoCo over a hivemind swarm.",
    )
    parser.add_argument("--version", action="version", version=f"shoal {version('shoal')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    bench = commands.add_parser("bench", help="benchmarks that print a table or JSON")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    codec = benchmarks.add_parser(
        "codec", help="payload size and encode/decode throughput of the codecs on transformer shapes"
    )
    codec.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    codec.add_argument("--repeat", type=_positive_int, default=5, help="timed runs per measurement (median)")
    converge = benchmarks.add_parser(
        "converge",
        help="DeMo, DiLoCo and data-parallel AdamW on one model, data and token budget",
    )
    converge.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    converge.add_argument(
        "--quick", action="store_true", help="the tiny model for 300 steps (~3 minutes on 2 cores)"
    )
    swarm = benchmarks.add_parser(
        "swarm-local",
        help="a DeMo swarm of peer processes on loopback: bytes on the wire per peer and round vs the codec",
    )
    swarm.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    swarm.add_argument("--peers", type=_positive_int, nargs="+", default=[2, 4, 8], help="swarm sizes")
    swarm.add_argument("--model", choices=["tiny", "10m"], default="tiny", help="tiny, or ~9.5M parameters")
    swarm.add_argument("--rounds", type=_positive_int, default=10, help="rounds per swarm size")
    swarm.add_argument("--round-seconds", type=float, default=2.0, help="length of a round")
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.benchmark == "codec":
        from shoal.compression import benchmark  # imports torch: only when needed

        return benchmark.main(as_json=args.json, repeat=args.repeat)
    if args.command == "bench" and args.benchmark == "converge":
        from shoal.peer import convergence

        return convergence.main(as_json=args.json, quick=args.quick)
    if args.command == "bench" and args.benchmark == "swarm-local":
        from shoal.peer import swarm_bench

        if not args.round_seconds > 0:
            print("shoal: error: --round-seconds must be > 0", file=sys.stderr)
            return 2
        return swarm_bench.main(
            as_json=args.json,
            sizes=args.peers,
            model=args.model,
            rounds=args.rounds,
            round_seconds=args.round_seconds,
        )
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
