"""`shoal coordinator`: runs a swarm's coordinator until SIGTERM or Ctrl-C.

    shoal coordinator --listen 0.0.0.0:7733 --state coordinator.db --token-file tokens.txt \\
        --tls-cert cert.pem --tls-key key.pem --metrics-port 9400

Peers follow it with `shoal join --coordinator HOST:PORT`. Its first line of output says where it
listens (with `--log-format json`, as `{"event": "listening", "address": ...}`). No torch is imported.
"""

import argparse
import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from shoal.coordinator.auth import TokenFileError, Tokens
from shoal.coordinator.policy import Policy
from shoal.coordinator.server import Coordinator, TlsFiles


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen", default="0.0.0.0:7733", metavar="ADDR", help="host:port (default: %(default)s)"
    )
    parser.add_argument(
        "--state",
        default="coordinator.db",
        metavar="PATH",
        help="SQLite file of the swarm's state; a restart continues from it (default: %(default)s)",
    )
    _add_round_arguments(parser)
    parser.add_argument(
        "--token-file", metavar="F", help="accepted tokens: '<token>' (swarm) or '<peer id> <token>' per line"
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain ...")
    parser.add_argument("--tls-key", metavar="PEM", help="... and this private key")
    parser.add_argument("--metrics-port", type=int, metavar="N", help="serve Prometheus metrics on this port")
    parser.add_argument("--log-format", choices=["human", "json"], default="human", help="default: human")


def _add_round_arguments(parser: argparse.ArgumentParser) -> None:
    """How the coordinator plans rounds and treats late peers."""
    parser.add_argument(
        "--round-quantile",
        type=float,
        default=0.9,
        metavar="Q",
        help="fraction of the peers whose smallest contribution the compute window must fit "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--min-compute-s", type=float, default=5.0, metavar="S", help="shortest compute window"
    )
    parser.add_argument(
        "--max-compute-s", type=float, default=600.0, metavar="S", help="longest compute window"
    )
    parser.add_argument(
        "--max-exchange-s", type=float, default=300.0, metavar="S", help="longest exchange window"
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=6.0,
        metavar="S",
        help="silence after which a peer is dropped",
    )
    parser.add_argument(
        "--evict-after", type=int, default=4, metavar="N", help="late rounds (strikes) that evict a peer"
    )
    parser.add_argument(
        "--min-peers", type=int, default=1, metavar="N", help="peers the first round waits for (default: 1)"
    )
    parser.add_argument(
        "--eviction-s", type=float, default=60.0, metavar="S", help="how long an evicted peer stays out"
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="announce a round as soon as a peer reports the previous one, so that peers compute it while "
        "they still exchange the previous one (DiLoCo's eager or delayed outer updates, overlapped DeMo); "
        "two rounds at most are undecided at a time",
    )
    parser.add_argument(
        "--gather",
        type=int,
        default=0,
        metavar="G",
        help="bounded fan-in: each round's result lists at most G payloads to aggregate, in the peers' "
        "rotation, so that every peer counts in turn whatever it claims (peers run with the same "
        "--gather); default 0: all of them",
    )


def run(args: argparse.Namespace) -> int:
    try:
        coordinator = _coordinator(args)
    except (ValueError, TokenFileError) as error:
        print(f"shoal coordinator: error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        asyncio.run(_serve(coordinator, args))
    except OSError as error:
        print(f"shoal coordinator: error: {error}", file=sys.stderr)
        return 1
    return 0


def _coordinator(args: argparse.Namespace) -> Coordinator:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = None
    if args.tls_cert is not None:
        tls = TlsFiles(cert=Path(args.tls_cert), key=Path(args.tls_key))
        for flag, path in (("--tls-cert", tls.cert), ("--tls-key", tls.key)):
            if not path.is_file():
                raise ValueError(f"{flag}: {path} is not a file")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ValueError("--metrics-port must be in [0, 65535]")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen: expected host:port, got {args.listen!r}")
    try:
        policy = Policy(
            quantile=args.round_quantile,
            min_compute_s=args.min_compute_s,
            max_compute_s=args.max_compute_s,
            max_exchange_s=args.max_exchange_s,
            min_exchange_s=min(2.0, args.max_exchange_s),
            initial_exchange_s=min(10.0, args.max_exchange_s),
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            evict_after=args.evict_after,
            shrink_after=min(2, args.evict_after),
            eviction_s=args.eviction_s,
            min_start_members=args.min_peers,
            overlap=args.overlap,
            gather=args.gather,
        )
    except ValueError as error:
        flags = "--round-quantile, --*-s, --evict-after, --min-peers or --gather"
        raise ValueError(f"{flags}: {error}") from None
    return Coordinator(
        listen=args.listen,
        state_path=args.state,
        policy=policy,
        tokens=Tokens.load(args.token_file) if args.token_file else None,
        tls=tls,
        metrics_port=args.metrics_port,
    )


async def _serve(coordinator: Coordinator, args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    port = await coordinator.start()
    address = f"{args.listen.rpartition(':')[0]}:{port}"
    metrics = None
    if coordinator.bound_metrics_port is not None:
        metrics = f"{args.listen.rpartition(':')[0]}:{coordinator.bound_metrics_port}"
    if args.log_format == "json":
        line = {"event": "listening", "address": address, "state": args.state, "metrics": metrics}
        print(json.dumps(line), flush=True)
    else:
        auth = "tokens" if args.token_file else "no authentication"
        print(
            f"coordinator listening on {address} ({'TLS' if args.tls_cert else 'plaintext'}, {auth}); "
            f"state in {args.state}" + (f"; metrics on http://{metrics}/metrics" if metrics else ""),
            flush=True,
        )
    try:
        await stop.wait()
    finally:
        await coordinator.stop()
