"""The `shoal` command line.

    shoal --help
    shoal bench codec [--json] [--repeat N]
    shoal bench converge [--json] [--quick]

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
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
