"""The `shoal` command line: one module per command, each with `add_arguments(parser)` and `run(args)`.

    shoal --help
    shoal join [--initial-peers MADDR ...] [--config FILE] [--model NAME|module:factory|DIR] ...
    shoal demo [--peers N] [--rounds R] [--algorithm demo|demo-overlap|diloco] [--keep-logs DIR] [--json] ...
    shoal status [--initial-peers MADDR ...] [--run NAME] [--json]
    shoal check [--initial-peers MADDR ...] [--json]
    shoal keygen PATH
    shoal health [URL ...]
    shoal export --checkpoint-dir DIR OUT [--model MODEL]
    shoal data prepare SOURCE OUT [--tokenizer PATH|bytes] [--text-field NAME] [--shard-tokens N]
    shoal bootstrap [--host IP] [--port N] [--identity PATH] [--address-file PATH] [--metrics-port N] ...
    shoal coordinator [--listen ADDR] [--state PATH] [--round-quantile Q] [--token-file F] ...
    shoal bench codec [--json] [--repeat N]
    shoal bench converge [--json] [--quick] [--methods M,...]
    shoal bench hostile [--json] [--workers N] [--attackers A] [--methods M,...] [--attacks A,...]
    shoal bench swarm-local [--json] [--peers N ...] [--model tiny|10m] [--rounds R] [--round-seconds S]
    shoal bench wan [--json] [--quick] [--bandwidth R,...] [--methods M,...]

Building the parser imports no torch and no hivemind (each command imports what it runs only in
`run`), so `shoal join` can refuse a port in use at once and `shoal coordinator` runs on a small box.
"""

import argparse
from importlib.metadata import version

from shoal.peer.cli import (
    bench,
    bootstrap,
    check,
    coordinator,
    data,
    demo,
    export,
    health,
    join,
    keygen,
    status,
)

COMMANDS = {
    "join": join,
    "bootstrap": bootstrap,
    "demo": demo,
    "status": status,
    "check": check,
    "keygen": keygen,
    "export": export,
    "data": data,
    "coordinator": coordinator,
    "health": health,
    "bench": bench,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Decentralized peer-to-peer training: DeMo and DiLoCo over a hivemind swarm.",
    )
    parser.add_argument("--version", action="version", version=f"shoal {version('shoal')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        command.add_arguments(commands.add_parser(name, help=command.HELP, description=command.DESCRIPTION))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command].run(args)
