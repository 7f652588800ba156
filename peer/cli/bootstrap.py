"""`shoal bootstrap`: a long-running node that trains nothing, for volunteers to join through.

It is a hivemind DHT node, as `hivemind-dht` is, with shoal's flags and output: it prints its address
and the `shoal join` command that starts or joins a run through it, writes the address to
`--address-file`, serves Prometheus metrics, and runs until SIGTERM or Ctrl-C. Any run can start
through it: the first `shoal join --initial-peers <this node> --run R` that finds no peer of run R
starts it (`--discover-seconds`).

It relays for peers behind NAT (shoal.peer.swarm.relay: payloads and state pieces forwarded over
the connections they keep to it, payloads cached; `--no-relay`: none) and tells each joining peer
whether it can be dialed. It also offers libp2p's circuit relay (hivemind's `use_relay`); `--public`
tells libp2p that its addresses are reachable from everywhere, for a node whose address libp2p would
not take for a public one (a private range, or the benchmark range the tests use).
"""

import argparse
import sys
import time

HELP = "run a bootstrap node: a DHT node that trains nothing, for peers to join through"
DESCRIPTION = (
    "Run a DHT node that trains nothing, for volunteers to join through: it prints the shoal join "
    "command of a run through it (any run: the first peer of a run starts it) and runs until stopped."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", metavar="IP", help="IPv4 address to listen on")
    parser.add_argument("--port", type=int, default=0, metavar="PORT", help="TCP port (0: any free one)")
    parser.add_argument("--identity", metavar="PATH", help="node identity file, for a fixed address")
    parser.add_argument("--address-file", metavar="PATH", help="write the join address to PATH")
    parser.add_argument(
        "--announce-maddrs", nargs="+", default=[], metavar="MADDR", help="addresses to announce instead"
    )
    parser.add_argument(
        "--initial-peers", nargs="+", default=[], metavar="MADDR", help="other bootstrap nodes"
    )
    parser.add_argument("--metrics-port", type=int, metavar="N", help="serve Prometheus metrics on --host:N")
    parser.add_argument(
        "--run", default="shoal", metavar="NAME", help="the run the printed join command names"
    )
    parser.add_argument(
        "--public", action="store_true", help="tell libp2p this node is reachable from everywhere"
    )
    parser.add_argument(
        "--relay-cache-mb",
        type=float,
        default=256.0,
        metavar="MB",
        help="payloads kept for the peers behind NAT it relays to (default 256)",
    )
    parser.add_argument(
        "--no-relay", action="store_true", help="relay nothing for peers behind NAT (a DHT node only)"
    )


STOP_BUDGET_S = 10.0  # a bootstrap node's stop: its relay and DHT closed


def run(args: argparse.Namespace) -> int:
    """Exit 2 for a flag to fix (checked before anything starts), 1 if the node cannot start."""
    try:
        _check(args)
    except ValueError as error:
        print(f"shoal bootstrap: error: {error}", file=sys.stderr)
        return 2
    from shoal.peer.swarm.bootstrap import BootstrapError, BootstrapNode  # imports hivemind: only now
    from shoal.peer.train.stopping import Watchdog, stop_on_signals

    try:
        node = BootstrapNode.start(
            host=args.host,
            port=args.port,
            identity_path=args.identity,
            announce_maddrs=args.announce_maddrs,
            initial_peers=args.initial_peers,
            public=args.public,
            relay_cache_bytes=None if args.no_relay else int(args.relay_cache_mb * (1 << 20)),
        )
    except BootstrapError as error:
        print(f"shoal bootstrap: error: {error}", file=sys.stderr)
        return 1
    # from here on a stop ends the loop below, which closes the node; one that takes longer than
    # STOP_BUDGET_S is ended by the watchdog, with the DHT's processes
    stop = stop_on_signals(grace_s=STOP_BUDGET_S)
    Watchdog(stop, before_exit=getattr(node.dht, "kill_group", None))
    with node:
        address = node.address
        if args.address_file:
            from shoal.peer.files import replace_text

            replace_text(args.address_file, address + "\n")
        print(f"Bootstrap node at {address}. Start or join a run through it with:", flush=True)
        print(f"  shoal join --initial-peers {address} --run {args.run}", flush=True)
        if args.metrics_port is not None:
            port = node.serve_metrics(args.host, args.metrics_port)
            print(f"Prometheus metrics on http://{args.host}:{port}/metrics", flush=True)
        while not stop.is_set():
            time.sleep(1.0)
    return 0


def _check(args: argparse.Namespace) -> None:
    """ValueError (a SettingsError) naming the first flag this machine cannot use."""
    from pathlib import Path

    from shoal.peer.config import preflight
    from shoal.peer.config.settings import PARSERS
    from shoal.peer.swarm.bootstrap import check_multiaddrs
    from shoal.peer.swarm.names import check_run_name

    try:
        check_run_name(args.run)
    except ValueError as error:
        raise ValueError(f"--run: {error}") from None
    if not 0 <= args.relay_cache_mb <= 1 << 20:
        raise ValueError(f"--relay-cache-mb {args.relay_cache_mb}: expected a size in [0, 1048576] MB")
    for flag, port in (("--port", args.port), ("--metrics-port", args.metrics_port)):
        if port is not None:
            try:
                PARSERS["port"](port)
            except ValueError as error:
                raise ValueError(f"{flag} {port}: {error}") from None
        if port:
            preflight.check_port(args.host, port, flag)
    if args.address_file:
        preflight.check_writable_folder(Path(args.address_file).parent, "--address-file")
    if args.identity and Path(args.identity).exists():
        from shoal.peer.swarm.identity import IdentityError, load_identity

        try:
            load_identity(args.identity)
        except IdentityError as error:
            raise ValueError(f"--identity: {error}") from None
    check_multiaddrs("--announce-maddrs", args.announce_maddrs, dialable=False)
    check_multiaddrs("--initial-peers", args.initial_peers, dialable=True)
