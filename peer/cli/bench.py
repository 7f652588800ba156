"""`shoal bench`: the benchmarks that print a table or JSON, one module each in peer/bench/ (and
`codec`, the codecs alone, in shoal.compression.benchmark)."""

import argparse
import sys
from pathlib import Path

from shoal.peer.cli.flags import positive_int

HELP = "benchmarks that print a table or JSON"
DESCRIPTION = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    _codec_arguments(benchmarks)
    _hostile_arguments(benchmarks)
    _converge_arguments(benchmarks)
    _wan_arguments(benchmarks)
    _swarm_local_arguments(benchmarks)
    _coordinator_arguments(benchmarks)
    _utilization_arguments(benchmarks)


def _codec_arguments(benchmarks: argparse._SubParsersAction) -> None:
    codec = benchmarks.add_parser(
        "codec", help="payload size and encode/decode throughput of the codecs on transformer shapes"
    )
    codec.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    codec.add_argument("--repeat", type=positive_int, default=5, help="timed runs per measurement (median)")
    codec.add_argument("--device", default="cpu", help="where the tensors live: cpu (default) or cuda")


def _hostile_arguments(benchmarks: argparse._SubParsersAction) -> None:
    hostile = benchmarks.add_parser(
        "hostile",
        help="how far workers sending poisoned, well-formed payloads move DeMo and DiLoCo (screening alone)",
    )
    hostile.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    hostile.add_argument("--workers", type=positive_int, default=8, help="workers in all (default 8)")
    hostile.add_argument(
        "--attackers", type=positive_int, default=2, help="hostile ones among them (default 2)"
    )
    hostile.add_argument(
        "--methods",
        default="demo_compact,diloco_eager",
        help="comma-separated, of demo_compact,diloco_eager,diloco_sparse",
    )
    hostile.add_argument(
        "--attacks",
        default="sign_flip,sample_lie,random",
        help="comma-separated, of sign_flip,sample_lie,random,alie,collude (a clean run comes first)",
    )
    hostile.add_argument(
        "--gather",
        type=int,
        default=0,
        help="bounded fan-in: at most G contributions count a round (default 0: all), as join's --gather",
    )


def _converge_arguments(benchmarks: argparse._SubParsersAction) -> None:
    converge = benchmarks.add_parser(
        "converge",
        help="DeMo, DiLoCo and data-parallel AdamW on one model, data and token budget",
    )
    converge.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    converge.add_argument(
        "--quick", action="store_true", help="the tiny model for 300 steps (~3 minutes on 2 cores)"
    )
    converge.add_argument(
        "--scale",
        choices=("medium", "gpu"),
        help="medium: a 5.8M-parameter GPT on a 4,096-token BPE, every method swept (~2 hours on 2 cores); "
        "gpu: 27M parameters in bf16 on --device cuda, one run per method (<= 8 minutes)",
    )
    converge.add_argument(
        "--record",
        type=Path,
        metavar="FILE",
        help="with --scale: the runs, one JSON line each, resumed from (default converge-SCALE.jsonl)",
    )
    converge.add_argument(
        "--plots", type=Path, metavar="DIR", help="with --scale: write the loss curves there as PNG files"
    )
    converge.add_argument("--steps", type=positive_int, help="with --scale: steps per worker")
    converge.add_argument(
        "--report",
        action="store_true",
        help="with --scale: the table (and --plots) from the record's runs alone, running nothing",
    )
    converge.add_argument("--device", help="with --scale: cpu (medium's default) or cuda (gpu's)")
    converge.add_argument(
        "--methods",
        help="comma-separated, of adamw_dp,demo_reference,demo_reference_unscreened,demo_compact,"
        "diloco_standard,diloco_delayed,diloco_eager (the default: all seven; every one but "
        "demo_reference_unscreened screens its rounds as swarm peers do) and "
        "demo_compact_overlap,demo_compact_lookahead, diloco_int8, "
        "diloco_sparse (top-64 of 4096 at 2 bits), diloco_sparse_eager, diloco_sparse_dct, "
        "diloco_sparse_k{32,64,128}_{1,2,4}bit, lion_dp (data-parallel Lion at the AdamW lr: the "
        "sign-descent reference)",
    )
    converge.add_argument(
        "--inner-steps", type=positive_int, metavar="H", help="DiLoCo's H (default: 25 quick, 50 full)"
    )
    converge.add_argument(
        "--outer-lr", type=float, metavar="LR", help="DiLoCo's outer lr (default: per method)"
    )
    converge.add_argument(
        "--outer-momentum", type=float, metavar="M", help="DiLoCo's outer momentum (default: per method)"
    )
    converge.add_argument("--workers", type=positive_int, metavar="N", help="simulated workers (default: 4)")
    converge.add_argument(
        "--gather",
        type=int,
        metavar="G",
        help="at most G workers' payloads count in a round, in the fan-in's rotation (default: 0, all)",
    )
    converge.add_argument(
        "--carry",
        action="store_true",
        default=None,
        help="with --gather: a worker left out sends its work again with its next round (DeMo: its sent "
        "coefficients back into its momentum; DiLoCo: its pseudo-gradient, averaged over its phases)",
    )
    converge.add_argument(
        "--error-decay",
        type=float,
        metavar="BETA",
        help="DiLoCo's error feedback beta with a lossy codec (1)",
    )
    converge.add_argument(
        "--demo-error-feedback",
        type=float,
        metavar="ALPHA",
        help="DeMo's error feedback: the share of the sent part taken out of its momentum, in [0, 1] (1)",
    )


def _wan_arguments(benchmarks: argparse._SubParsersAction) -> None:
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
    wan.add_argument("--peers", type=positive_int, help="peer namespaces (default: 4; --quick: 2)")
    wan.add_argument(
        "--steps", type=positive_int, help="optimizer steps per method (default: 48; --quick: 8)"
    )
    wan.add_argument("--inner-steps", type=positive_int, help="DiLoCo's H (default: 4; --quick: 4)")
    wan.add_argument(
        "--batch-size", type=positive_int, help="sequences per step and peer (default: 32; --quick: 32)"
    )
    wan.add_argument(
        "--methods",
        help="comma-separated subset of compute_only,ddp,demo_compact,demo_overlap,diloco_standard,"
        "diloco_eager,diloco_standard_butterfly,diloco_eager_butterfly (default: all; --quick: all but "
        "the butterfly ones); on request diloco_int8 and diloco_sparse (--compression int8, sparse)",
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


def _swarm_local_arguments(benchmarks: argparse._SubParsersAction) -> None:
    swarm = benchmarks.add_parser(
        "swarm-local",
        help="a DeMo swarm of peer processes on loopback: bytes on the wire per peer and round vs the codec",
    )
    swarm.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    swarm.add_argument("--peers", type=positive_int, nargs="+", default=[2, 4, 8], help="swarm sizes")
    swarm.add_argument("--model", choices=["tiny", "10m"], default="tiny", help="tiny, or ~9.5M parameters")
    swarm.add_argument("--rounds", type=positive_int, default=10, help="rounds per swarm size")
    swarm.add_argument("--round-seconds", type=float, default=2.0, help="length of a round")
    swarm.add_argument(
        "--gather", type=int, default=0, metavar="G", help="at most G payloads count in a round (0: all)"
    )
    swarm.add_argument(
        "--coordinator",
        action="store_true",
        help="under a `shoal coordinator` started here (with the same --gather; its traffic is measured too)",
    )


def _coordinator_arguments(benchmarks: argparse._SubParsersAction) -> None:
    coordinator = benchmarks.add_parser(
        "coordinator",
        help="a real `shoal coordinator` under N simulated peers: call latency, rounds on time, its CPU "
        "and memory",
    )
    coordinator.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    coordinator.add_argument(
        "--peers", type=positive_int, nargs="+", default=[100, 1000], help="swarm sizes (default: 100 1000)"
    )
    coordinator.add_argument(
        "--rounds",
        type=positive_int,
        default=5,
        help="rounds measured per size, after the first (default: 5)",
    )
    coordinator.add_argument(
        "--compute-s", type=float, default=5.0, help="the coordinator's shortest compute window (default: 5)"
    )
    coordinator.add_argument(
        "--abusive",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="this fraction of the clients abuse instead (join floods, oversized reports, 100x heartbeats)",
    )
    coordinator.add_argument(
        "--gather",
        type=int,
        default=0,
        metavar="G",
        help="the coordinator's bounded fan-in: each result lists G payloads and a tally (0: all)",
    )


def run(args: argparse.Namespace) -> int:
    return {
        "codec": _codec,
        "coordinator": _coordinator,
        "converge": _converge,
        "hostile": _hostile,
        "swarm-local": _swarm_local,
        "utilization": _utilization,
        "wan": _wan,
    }[args.benchmark](args)


def _utilization_arguments(benchmarks: argparse._SubParsersAction) -> None:
    bench = benchmarks.add_parser(
        "utilization",
        help="tokens/s of a default swarm's `shoal join` peers on loopback against plain torch's, same run",
    )
    bench.add_argument("--json", action="store_true", help='print one JSON object {"results": [...]}')
    bench.add_argument("--peers", type=positive_int, default=4, help="peer processes (default 4)")
    bench.add_argument("--model", choices=["tiny", "small", "base"], default="small", help="default: small")
    bench.add_argument("--algorithms", default="demo,diloco", help="comma-separated (default demo,diloco)")
    bench.add_argument("--rounds", type=positive_int, default=10, help="rounds per swarm (default 10)")
    bench.add_argument(
        "--round-seconds", type=float, help="round length (default: the one shoal join chooses)"
    )
    bench.add_argument("--batch-size", type=positive_int, default=8, help="sequences a micro-batch (8)")
    bench.add_argument(
        "--rate-mbit",
        type=float,
        metavar="R",
        help="also run each peer in a namespace behind a link of R Mbit/s each way (needs root)",
    )


def _utilization(args: argparse.Namespace) -> int:
    from shoal.peer.bench import utilization
    from shoal.peer.config.settings import ALGORITHMS

    algorithms = tuple(args.algorithms.split(","))
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    too_short = args.round_seconds is not None and not args.round_seconds > 0
    if unknown or too_short or args.rounds <= utilization.WARMUP_ROUNDS:
        print(
            f"shoal bench utilization: error: unknown --algorithms {', '.join(unknown)}, or --round-seconds "
            f"<= 0, or --rounds <= {utilization.WARMUP_ROUNDS}",
            file=sys.stderr,
        )
        return 2
    return utilization.main(
        as_json=args.json,
        peers=args.peers,
        model=args.model,
        algorithms=algorithms,
        rounds=args.rounds,
        round_seconds=args.round_seconds,
        batch_size=args.batch_size,
        rates=(None,) if args.rate_mbit is None else (None, args.rate_mbit),
    )


def _codec(args: argparse.Namespace) -> int:
    from shoal.compression import benchmark  # imports torch: only when needed

    return benchmark.main(as_json=args.json, repeat=args.repeat, device=args.device)


def _coordinator(args: argparse.Namespace) -> int:
    from shoal.peer.bench import coordinator

    if not 0 <= args.abusive < 1:
        print("shoal bench coordinator: error: --abusive must be in [0, 1)", file=sys.stderr)
        return 2
    if args.gather < 0:
        print("shoal bench coordinator: error: --gather must be >= 0", file=sys.stderr)
        return 2
    return coordinator.main(
        peers=args.peers,
        rounds=args.rounds,
        compute_s=args.compute_s,
        abusive=args.abusive,
        gather=args.gather,
        as_json=args.json,
    )


def _converge(args: argparse.Namespace) -> int:
    from shoal.peer.bench import converge

    if args.scale:
        return _converge_scale(args)
    methods = tuple(args.methods.split(",")) if args.methods else converge.METHODS
    unknown = set(methods) - set(converge.TRAINERS)
    if unknown:
        print(
            f"shoal bench converge: error: --methods: unknown {', '.join(sorted(unknown))}", file=sys.stderr
        )
        return 2
    if args.gather is not None and args.gather < 0:
        print("shoal bench converge: error: --gather must be >= 0", file=sys.stderr)
        return 2
    if args.demo_error_feedback is not None and not 0 <= args.demo_error_feedback <= 1:
        print("shoal bench converge: error: --demo-error-feedback must be in [0, 1]", file=sys.stderr)
        return 2
    names: tuple[str, ...] = (
        "inner_steps",
        "outer_lr",
        "outer_momentum",
        "error_decay",
        "demo_error_feedback",
        "workers",
    )
    names += ("gather", "carry")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return converge.main(as_json=args.json, quick=args.quick, methods=methods, **overrides)


def _converge_scale(args: argparse.Namespace) -> int:
    from shoal.peer.bench import scale

    methods = tuple(args.methods.split(",")) if args.methods else tuple(scale.SWEEPS)
    unknown = set(methods) - set(scale.SWEEPS)
    if unknown or args.quick:
        what = f"--methods: {', '.join(sorted(unknown))} not swept (choose of {', '.join(scale.SWEEPS)})"
        what = "--quick and --scale" if args.quick else what
        print(f"shoal bench converge: error: {what}", file=sys.stderr)
        return 2
    names = ("steps", "device", "workers", "inner_steps")
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return scale.main(
        scale=args.scale,
        as_json=args.json,
        methods=methods,
        record=args.record,
        plots=args.plots,
        report_only=args.report,
        **overrides,
    )


def _swarm_local(args: argparse.Namespace) -> int:
    from shoal.peer.bench import swarm_local

    if not args.round_seconds > 0:
        print("shoal: error: --round-seconds must be > 0", file=sys.stderr)
        return 2
    if args.gather < 0:
        print("shoal: error: --gather must be >= 0", file=sys.stderr)
        return 2
    return swarm_local.main(
        as_json=args.json,
        sizes=args.peers,
        model=args.model,
        rounds=args.rounds,
        round_seconds=args.round_seconds,
        gather=args.gather,
        coordinated=args.coordinator,
    )


def _hostile(args: argparse.Namespace) -> int:
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
    if args.gather < 0:
        print(f"shoal bench hostile: error: --gather must be >= 0, got {args.gather}", file=sys.stderr)
        return 2
    return hostile.main(
        as_json=args.json,
        workers=args.workers,
        attackers=args.attackers,
        methods=methods,
        attacks=attacks,
        gather=args.gather,
    )


def _wan(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from shoal.peer.bench import wan

    config = wan.QUICK if args.quick else wan.WanConfig()
    try:
        bandwidths = wan.parse_bandwidths(
            "10mbit" if args.quick and args.bandwidth == "10mbit,100mbit" else args.bandwidth
        )
        methods = tuple(args.methods.split(",")) if args.methods else config.methods
        unknown = set(methods) - {*wan.METHODS, *wan.SWARM_METHODS}
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
