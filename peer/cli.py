"""The `shoal` command line.

    shoal --help
    shoal join [--initial-peers MADDR ...] [--config FILE] [--model NAME|module:factory|DIR] ...
    shoal demo [--peers N] [--rounds R] [--algorithm demo|demo-overlap|diloco] [--keep-logs DIR] [--json] ...
    shoal status [--initial-peers MADDR ...] [--run NAME] [--json]
    shoal check [--initial-peers MADDR ...] [--json]
    shoal keygen PATH
    shoal coordinator [--listen ADDR] [--state PATH] [--round-quantile Q] [--token-file F] ...
    shoal bench codec [--json] [--repeat N]
    shoal bench converge [--json] [--quick] [--methods M,...]
    shoal bench hostile [--json] [--workers N] [--attackers A] [--methods M,...] [--attacks A,...]
    shoal bench swarm-local [--json] [--peers N ...] [--model tiny|10m] [--rounds R] [--round-seconds S]

Subcommands appear here as they are built; there are no placeholders.
"""

import argparse
import os
import sys
from importlib.metadata import version

from shoal.coordinator import cli as coordinator_cli
from shoal.peer import settings as settings_module


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shoal",
        description="Decentralized peer-to-peer training: DeMo and DiLoCo over a hivemind swarm.",
    )
    parser.add_argument("--version", action="version", version=f"shoal {version('shoal')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    join = commands.add_parser(
        "join",
        help="join a swarm (or start one) and train",
        description="Join a swarm and train until stopped (Ctrl-C: checkpoint and leave at the round's end). "
        "Without --initial-peers, start a new swarm and print the command others run to join it. "
        "Each setting comes from its flag, else the SHOAL_<NAME> environment variable (SHOAL_MODEL, ...), "
        'else the TOML file of --config (model = "small"), else its default.',
    )
    join.add_argument("--config", help="TOML file of settings (also SHOAL_CONFIG)")
    for name, (metavar, text) in JOIN_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        default = getattr(settings_module.JoinSettings(), name)
        shown = "" if default in (None, "", ()) else f" (default: {default})"
        nargs = "+" if name == "initial_peers" else None
        join.add_argument(flag, dest=name, metavar=metavar, nargs=nargs, help=text + shown)

    demo = commands.add_parser(
        "demo",
        help="a local swarm of peer processes training the embedded model, no download",
        description="Start a swarm of `shoal join` processes on 127.0.0.1 that train the embedded byte-level "
        "GPT on the Python standard library's sources; show their rounds live and end with a summary.",
    )
    demo.add_argument("--peers", type=_positive_int, default=4, help="peer processes (default: 4)")
    demo.add_argument("--rounds", type=_positive_int, default=20, help="rounds to train (default: 20)")
    demo.add_argument(
        "--algorithm", choices=list(settings_module.ALGORITHMS), default="demo", help="default: demo"
    )
    demo.add_argument(
        "--averaging",
        choices=["gather", "butterfly"],
        default="gather",
        help="DiLoCo: how rounds are averaged (see shoal join --help; default: gather)",
    )
    demo.add_argument("--round-seconds", type=float, default=3.0, help="length of a round (default: 3)")
    demo.add_argument("--model", choices=["tiny", "small", "base"], default="tiny", help="default: tiny")
    demo.add_argument(
        "--no-coordinator",
        dest="coordinator",
        action="store_false",
        help="no coordinator process: rounds follow the clock alone (uncoordinated mode)",
    )
    demo.add_argument(
        "--slow-peer",
        type=int,
        metavar="I",
        help="peer I sleeps in every compute phase: the coordinator leaves it out as a straggler",
    )
    demo.add_argument(
        "--metrics-targets",
        metavar="PATH",
        help="write the Prometheus file_sd target file of the peers' and coordinator's metrics endpoints "
        "here, e.g. deploy/prometheus/targets/demo.json (default: in the demo's log folder)",
    )
    demo.add_argument(
        "--keep-logs",
        metavar="DIR",
        help="keep the peers' and the coordinator's logs, the checkpoints and the coordinator's state in DIR "
        "(default: a temporary folder, removed at the end unless the demo fails)",
    )
    demo.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end (the live view goes to stderr): peers, rounds, initial_loss, "
        "final_loss, param_hash_agree, bytes_sent_per_peer_per_round, wall_s",
    )

    status = commands.add_parser(
        "status",
        help="the swarm's peers, from the DHT",
        description="A table of the run's peers as their signed DHT records describe them: id, version, "
        "device, throughput, round, last seen, samples contributed.",
    )
    _swarm_flags(status)
    status.add_argument(
        "--json", action="store_true", help='print {"run", "peers": [...], "malformed_records"}'
    )

    check = commands.add_parser(
        "check",
        help="pre-flight: device, versions, reachability, bandwidth to the swarm",
        description="What this machine brings to a swarm: the device and its memory, torch and CUDA "
        "versions, "
        "the addresses it listens on and whether outside peers can reach them (and what to open if not), "
        "and with --initial-peers the DHT round trip and the bandwidth from the run's peers.",
    )
    _swarm_flags(check)
    check.add_argument("--port", type=int, default=0, help="TCP port a peer would listen on (default: any)")
    check.add_argument("--json", action="store_true", help='print {"device": {...}, "network": {...}}')

    keygen = commands.add_parser(
        "keygen",
        help="create a persistent peer identity",
        description="Write a new peer identity (an RSA key in hivemind's libp2p format: it fixes "
        "the peer id and signs this peer's records) to PATH.",
    )
    keygen.add_argument("path", metavar="PATH")

    coordinator = commands.add_parser(
        "coordinator",
        help="run a swarm's coordinator (gRPC): round deadlines, participant sets, stragglers",
        description="Serve the optional coordinator of a swarm: it announces each round's deadlines, fixes "
        "its exact participant set, leaves stragglers out and evicts repeated ones. Peers follow it with "
        "shoal join --coordinator HOST:PORT and train on without it while it is unreachable. Its state is "
        "kept in SQLite, so a restart continues the rounds. Needs no torch.",
    )
    coordinator_cli.add_arguments(coordinator)

    bench = commands.add_parser("bench", help="benchmarks that print a table or JSON")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    codec = benchmarks.add_parser(
        "codec", help="payload size and encode/decode throughput of the codecs on transformer shapes"
    )
    codec.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    codec.add_argument("--repeat", type=_positive_int, default=5, help="timed runs per measurement (median)")
    hostile = benchmarks.add_parser(
        "hostile",
        help="how far workers sending poisoned, well-formed payloads move DeMo and DiLoCo (screening alone)",
    )
    hostile.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    hostile.add_argument("--workers", type=_positive_int, default=8, help="workers in all (default 8)")
    hostile.add_argument(
        "--attackers", type=_positive_int, default=2, help="hostile ones among them (default 2)"
    )
    hostile.add_argument(
        "--methods", default="demo_compact,diloco_eager", help="comma-separated, of demo_compact,diloco_eager"
    )
    hostile.add_argument(
        "--attacks",
        default="sign_flip,sample_lie,random",
        help="comma-separated, of sign_flip,sample_lie,random (a clean run always comes first)",
    )
    converge = benchmarks.add_parser(
        "converge",
        help="DeMo, DiLoCo and data-parallel AdamW on one model, data and token budget",
    )
    converge.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    converge.add_argument(
        "--quick", action="store_true", help="the tiny model for 300 steps (~3 minutes on 2 cores)"
    )
    converge.add_argument(
        "--methods",
        help="comma-separated, of adamw_dp,demo_reference,demo_compact,diloco_standard,diloco_delayed,"
        "diloco_eager (the default: all six) and demo_compact_overlap,demo_compact_lookahead",
    )
    wan = benchmarks.add_parser(
        "wan",
        help="training over shaped links (network namespaces, tc tbf; needs root): shoal vs gloo all-reduce",
        description="For each bandwidth and method, one network namespace per peer plus one for the "
        "coordinator, on a bridge, every link shaped with tc tbf both ways; the same model, data and "
        "optimizer steps under compute_only, ddp (gloo all-reduce of fp32 gradients), demo_compact (top-4, "
        "1-bit), demo_overlap (the same, exchanged while the next step computes), diloco_standard and "
        "diloco_eager. Reports tokens/s, compute utilization, bytes on the wire "
        "per peer (interface counters) and the final validation loss. Needs root on Linux.",
    )
    wan.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    wan.add_argument(
        "--bandwidth", default="10mbit,100mbit", help="rates, comma-separated (default: %(default)s)"
    )
    wan.add_argument("--peers", type=_positive_int, help="peer namespaces (default: 4; --quick: 2)")
    wan.add_argument(
        "--steps", type=_positive_int, help="optimizer steps per method (default: 48; --quick: 8)"
    )
    wan.add_argument("--inner-steps", type=_positive_int, help="DiLoCo's H (default: 4; --quick: 4)")
    wan.add_argument(
        "--batch-size", type=_positive_int, help="sequences per step and peer (default: 32; --quick: 32)"
    )
    wan.add_argument(
        "--methods",
        help="comma-separated subset of compute_only,ddp,demo_compact,demo_overlap,diloco_standard,"
        "diloco_eager,diloco_standard_butterfly,diloco_eager_butterfly (default: all; --quick: all but "
        "the butterfly ones)",
    )
    wan.add_argument("--plot", metavar="PNG", help="also plot tokens/s against bandwidth (needs matplotlib)")
    wan.add_argument(
        "--pcap",
        metavar="DIR",
        help="capture peer 0's packets of each run into DIR (headers only; needs tcpdump), for "
        "tests/benchmarks/wire_breakdown.py",
    )
    wan.add_argument(
        "--quick", action="store_true", help="2 peers, 8 steps, 10mbit only: within 10 minutes on 2 cores"
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


JOIN_FLAGS = {
    "initial_peers": ("MADDR", "multiaddresses of peers in the swarm (none: start a new swarm)"),
    "coordinator": ("HOST:PORT", "the swarm's coordinator, if it has one (see shoal coordinator)"),
    "coordinator_token_file": ("F", "file holding this peer's token for the coordinator"),
    "coordinator_ca": ("PEM", "talk TLS to the coordinator, trusting this CA file (or: system)"),
    "run": ("NAME", "the run's name; peers of one run train one model"),
    "model": (
        "NAME",
        "tiny, small or base (the embedded GPT), a module:factory, or a Hugging Face directory",
    ),
    "data": (
        "SOURCE",
        "stdlib (the Python standard library's sources), a text directory, or a uint16 token file",
    ),
    "algorithm": (
        "ALGO",
        "demo, demo-overlap (exchanges while the next step computes), diloco (eager), diloco-standard, "
        "diloco-delayed",
    ),
    "device": ("DEVICE", "auto, cpu, cuda, cuda:N or mps"),
    "identity": ("PATH", "peer identity file (created if missing; see shoal keygen)"),
    "checkpoint_dir": ("DIR", "keep checkpoints here and resume from the newest"),
    "checkpoint_every": ("N", "rounds between checkpoints"),
    "max_rounds": ("N", "leave after N rounds (0: never)"),
    "until_round": ("R", "leave after the swarm's round R"),
    "host": ("IP", "IPv4 address to listen on"),
    "port": ("PORT", "TCP port to listen on (0: any free one)"),
    "metrics_port": ("N", "serve Prometheus metrics on --host:N/metrics (0: any free port, logged)"),
    "address_file": ("PATH", "write the address other peers join through to PATH once listening"),
    "round_seconds": ("S", "length of a round, when starting a new swarm"),
    "start_time": ("T", "unix time of round 0, when starting a new swarm (0: now)"),
    "compute_fraction": ("F", "share of a round spent computing; the rest is for the exchange"),
    "lr": ("LR", "learning rate (0: 2e-3 for DeMo, 1e-3 for DiLoCo's inner AdamW)"),
    "topk": ("K", "DeMo: DCT coefficients sent per chunk"),
    "inner_steps": ("H", "DiLoCo: inner steps per round"),
    "outer_lr": ("LR", "DiLoCo: outer learning rate"),
    "outer_momentum": ("M", "DiLoCo: outer Nesterov momentum (default: 0.9 standard, 0 delayed and eager)"),
    "averaging": (
        "HOW",
        "DiLoCo: gather (every peer pulls every payload) or butterfly (with a coordinator and 3+ peers: "
        "each peer averages one piece; 2 (N-1)/N payloads up and down per round instead of N-1)",
    ),
    "batch_size": ("B", "samples per micro-batch to start with (halved if the device runs out of memory)"),
    "max_micro_batches": ("N", "most micro-batches accumulated per step"),
    "seed": ("N", "seed of the initial weights and of the data order"),
    "log_format": ("FORMAT", "human (a live table) or json (one object per line)"),
    "compute_delay": ("S", "testing: sleep this long in every round's compute phase (a slow peer)"),
}


def _swarm_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--initial-peers",
        nargs="+",
        metavar="MADDR",
        help="peers of the swarm (default: SHOAL_INITIAL_PEERS)",
    )
    parser.add_argument("--run", help="the run's name (default: SHOAL_RUN, else shoal)")


def _swarm_settings(args: argparse.Namespace, required: bool = True) -> tuple[list[str], str]:
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


def _empty_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


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
    if args.command == "join":
        return _join(args)
    if args.command == "demo":
        if not 0.5 <= args.round_seconds <= 3600:
            print("shoal demo: error: --round-seconds must be in [0.5, 3600]", file=sys.stderr)
            return 2
        if args.slow_peer is not None and not 0 <= args.slow_peer < args.peers:
            print(f"shoal demo: error: --slow-peer must be in [0, {args.peers - 1}]", file=sys.stderr)
            return 2
        if args.averaging == "butterfly" and args.algorithm.startswith("demo"):
            print("shoal demo: error: --averaging butterfly: DiLoCo only", file=sys.stderr)
            return 2
        if args.keep_logs and os.path.exists(args.keep_logs) and not _empty_folder(args.keep_logs):
            # the peers would resume from the checkpoints there, the coordinator from its state
            print(
                f"shoal demo: error: --keep-logs {args.keep_logs}: not an empty folder (a previous demo's?): "
                "choose a new one",
                file=sys.stderr,
            )
            return 2
        from shoal.peer import local_swarm

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
        )
    if args.command == "status":
        try:
            initial_peers, run = _swarm_settings(args)
        except settings_module.SettingsError as error:
            print(f"shoal status: error: {error}", file=sys.stderr)
            return 2
        from shoal.peer import status
        from shoal.peer.swarm.bootstrap import BootstrapError

        try:
            return status.main(initial_peers, run, as_json=args.json)
        except BootstrapError as error:
            print(f"shoal status: error: {error}", file=sys.stderr)
            return 1
    if args.command == "check":
        if not 0 <= args.port <= 65535:
            print("shoal check: error: --port must be in [0, 65535]", file=sys.stderr)
            return 2
        try:
            initial_peers, run = _swarm_settings(args, required=False)
        except settings_module.SettingsError as error:
            print(f"shoal check: error: {error}", file=sys.stderr)
            return 2
        from shoal.peer import check

        return check.main(initial_peers, run, args.port, as_json=args.json)
    if args.command == "coordinator":
        return coordinator_cli.run(args)
    if args.command == "keygen":
        from shoal.peer.swarm.identity import IdentityError, keygen, peer_id_of

        try:
            keygen(args.path)
        except IdentityError as error:
            print(f"shoal keygen: error: {error}", file=sys.stderr)
            return 1
        print(f"wrote a new identity to {args.path}: peer id {peer_id_of(args.path)}")
        return 0
    if args.command == "bench" and args.benchmark == "codec":
        from shoal.compression import benchmark  # imports torch: only when needed

        return benchmark.main(as_json=args.json, repeat=args.repeat)
    if args.command == "bench" and args.benchmark == "converge":
        from shoal.peer.bench import converge

        methods = tuple(args.methods.split(",")) if args.methods else converge.METHODS
        unknown = set(methods) - set(converge.TRAINERS)
        if unknown:
            print(
                f"shoal bench converge: error: --methods: unknown {', '.join(sorted(unknown))}",
                file=sys.stderr,
            )
            return 2
        return converge.main(as_json=args.json, quick=args.quick, methods=methods)
    if args.command == "bench" and args.benchmark == "hostile":
        return _bench_hostile(args)
    if args.command == "bench" and args.benchmark == "swarm-local":
        from shoal.peer.bench import swarm_local

        if not args.round_seconds > 0:
            print("shoal: error: --round-seconds must be > 0", file=sys.stderr)
            return 2
        return swarm_local.main(
            as_json=args.json,
            sizes=args.peers,
            model=args.model,
            rounds=args.rounds,
            round_seconds=args.round_seconds,
        )
    if args.command == "bench" and args.benchmark == "wan":
        return _bench_wan(args)
    raise AssertionError(f"unhandled command {args.command}")


def _bench_hostile(args: argparse.Namespace) -> int:
    from shoal.peer.bench import hostile

    methods, attacks = args.methods.split(","), args.attacks.split(",")
    for flag, given, known in (
        ("--methods", methods, hostile.METHODS),
        ("--attacks", attacks, hostile.ATTACKS),
    ):
        unknown = set(given) - set(known)
        if unknown:
            print(
                f"shoal bench hostile: error: {flag}: unknown {', '.join(sorted(unknown))}", file=sys.stderr
            )
            return 2
    if not args.attackers < args.workers / 2:
        print("shoal bench hostile: error: --attackers must be fewer than half of --workers", file=sys.stderr)
        return 2
    return hostile.main(
        as_json=args.json, workers=args.workers, attackers=args.attackers, methods=methods, attacks=attacks
    )


def _bench_wan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from shoal.peer.bench import wan

    config = wan.QUICK if args.quick else wan.WanConfig()
    try:
        bandwidths = wan.parse_bandwidths(
            "10mbit" if args.quick and args.bandwidth == "10mbit,100mbit" else args.bandwidth
        )
        methods = tuple(args.methods.split(",")) if args.methods else config.methods
        unknown = set(methods) - set(wan.METHODS)
        if unknown:
            raise ValueError(f"--methods: unknown {', '.join(sorted(unknown))}")
    except ValueError as error:
        print(f"shoal bench wan: error: {error}", file=sys.stderr)
        return 2
    config = replace(
        config,
        peers=args.peers or config.peers,
        steps=args.steps or config.steps,
        inner_steps=args.inner_steps or config.inner_steps,
        batch_size=args.batch_size or config.batch_size,
        methods=methods,
    )
    return wan.main(
        as_json=args.json, bandwidths=bandwidths, config=config, plot=args.plot, pcap_dir=args.pcap
    )


def _join(args: argparse.Namespace) -> int:
    """Exit 2 for a setting to fix (checked before anything starts), 1 for another failure."""
    from shoal.peer import preflight

    try:
        chosen = settings_module.resolve(vars(args), os.environ, args.config)
        preflight.check(chosen)  # before the seconds torch's import takes: a port in use is told at once
    except settings_module.SettingsError as error:
        print(f"shoal join: error: {error}", file=sys.stderr)
        return 2
    from shoal.peer.node import JoinError, join  # imports torch and hivemind: only now

    try:
        join(chosen)
    except settings_module.SettingsError as error:
        print(f"shoal join: error: {error}", file=sys.stderr)
        return 2
    except JoinError as error:
        print(f"shoal join: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the round loop, where Ctrl-C is handled
        print("shoal join: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
