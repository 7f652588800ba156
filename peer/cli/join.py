"""`shoal join`: join a swarm (or start one) and train. Every setting is checked, the ports first and
before torch loads, so that a setting to fix exits 2 at once (peer/config/preflight.py); then peer/job/node.py
assembles the peer and runs its rounds."""

import argparse
import os
import sys

from shoal.peer.config import settings as settings_module

HELP = "join a swarm (or start one) and train"
DESCRIPTION = (
    "Join a swarm and train until stopped (Ctrl-C: checkpoint and leave at the round's end). "
    "Without --initial-peers, start a new swarm and print the command others run to join it. "
    "Each setting comes from its flag, else the SHOAL_<NAME> environment variable (SHOAL_MODEL, ...), "
    'else the TOML file of --config (one section per component: [model] name = "small"), else its default.'
)

JOIN_FLAGS = {
    "initial_peers": ("MADDR", "multiaddresses of peers in the swarm (none: start a new swarm)"),
    "coordinator": ("HOST:PORT", "the swarm's coordinator, if it has one (see shoal coordinator)"),
    "coordinator_token_file": ("F", "file holding this peer's token for the coordinator"),
    "coordinator_ca": ("PEM", "talk TLS to the coordinator, trusting this CA file (or: system)"),
    "coordinator_wait": (
        "S",
        "train uncoordinated at most S seconds while the coordinator has never answered, then exit 2 "
        "(default 120)",
    ),
    "run": ("NAME", "the run's name; peers of one run train one model"),
    "model": (
        "NAME",
        "tiny, small or base (the embedded GPT), a module:factory, or a Hugging Face directory",
    ),
    "data": (
        "SOURCE",
        "stdlib (the Python standard library's sources), a text corpus (a .jsonl, .parquet or .csv file, a "
        "save_to_disk folder, text files; a folder or glob of them; tokenized once into --data-cache), a "
        "folder of shoal data prepare, or token files (.npy, .bin)",
    ),
    "tokenizer": (
        "PATH",
        "a tokenizer.json or a folder holding one, or bytes (default: --model's own, else bytes)",
    ),
    "text_field": ("NAME", "the field of a dataset's rows that holds the text"),
    "data_cache": ("DIR", "where text corpora are tokenized (default: ~/.cache/shoal/data)"),
    "validate_every": (
        "N",
        "rounds between validation losses on the held-out batches, the same on every peer (0: at the end)",
    ),
    "audit_data": (
        "on|off",
        "on: log the indices (and epoch) of the windows this peer trains each round, a `trained` event",
    ),
    "lr_schedule": ("KIND", "constant, cosine, linear or wsd: the learning rate by the swarm's round"),
    "warmup_rounds": ("N", "rounds of linear warmup"),
    "decay_rounds": (
        "N",
        "cosine, linear: rounds of decay after the warmup (default: to --until-round); wsd: rounds of the "
        "final decay (default: the run's last fifth)",
    ),
    "min_lr": ("LR", "the learning rate the decay ends at"),
    "grad_clip": ("NORM", "clip each step's gradient to this norm (0: no clipping)"),
    "weight_decay": ("WD", "decoupled weight decay: DeMo's, DiLoCo's inner AdamW's (default 0 and 0.1)"),
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
    "announce_maddrs": (
        "MADDR",
        "addresses to give other peers instead of the ones this peer listens on (a port forwarded on "
        "your router: /ip4/<your public IP>/tcp/<port>)",
    ),
    "relay": (
        "on|off",
        "on: behind NAT, this peer's updates and state reach the others through the relays of the shoal "
        "bootstrap nodes it joined through, and it pulls through them what it cannot dial (off: direct "
        "connections only, and no libp2p circuit relay)",
    ),
    "metrics_port": ("N", "serve Prometheus metrics on --host:N/metrics (0: any free port, logged)"),
    "address_file": ("PATH", "write the address other peers join through to PATH once listening"),
    "trust_key": (
        "KEY",
        "the run key its starter's join command prints: while this peer holds no verified state (joining, "
        "restarted), it takes only the shared state that key signed, whatever a headcount of peers says",
    ),
    "round_seconds": ("S", "length of a round, when starting a new swarm (default: one its exchange fits)"),
    "start_time": ("T", "unix time of round 0, when starting a new swarm (0: now)"),
    "discover_seconds": (
        "S",
        "with --initial-peers: wait this long for a peer of --run, then start the run (0: at once)",
    ),
    "compute_fraction": (
        "F",
        "share of a round spent computing, the rest left for the exchange (default: until the round's "
        "deadline less the exchange time this peer measured)",
    ),
    "lr": ("LR", "learning rate (0: 2e-3 for DeMo, 1e-3 for DiLoCo's inner AdamW)"),
    "compression": (
        "PRESET",
        "how updates travel: DeMo reference (DCT top-32 per 64x64 chunk, float32: the paper's) or compact "
        "(top-4 at 1 bit, 2,500x smaller); DiLoCo int8 (every value at 8 bits, 3.8x) or sparse (top-64 of "
        "4096 at 2 bits with error feedback, 186x). Default: reference, int8",
    ),
    "topk": ("K", "values (DeMo: DCT coefficients) sent per chunk (default: the preset's)"),
    "value_bits": ("BITS", "bits per sent value: 32, 16, 8, 4, 2 or 1 (default: the preset's)"),
    "chunk": ("N", "side of the chunks top-k chooses in (DiLoCo int8: values per scale; default 64)"),
    "inner_steps": ("H", "DiLoCo: inner steps per round"),
    "outer_lr": ("LR", "DiLoCo: outer learning rate (default: 0.4; 1.5 with --compression sparse)"),
    "outer_momentum": (
        "M",
        "DiLoCo: outer Nesterov momentum (default: 0.9 standard, 0 delayed and eager, 0 with --compression "
        "sparse)",
    ),
    "averaging": (
        "HOW",
        "DiLoCo: gather (every peer pulls every payload) or butterfly (with a coordinator and 3+ peers: "
        "each peer averages one piece; 2 (N-1)/N payloads up and down per round instead of N-1)",
    ),
    "gather": (
        "G",
        "at most G payloads count in a round, the same G on every peer, in a rotation no claim can buy; "
        "each peer pulls only those, so its download stays G payloads a round at any swarm size (0: all)",
    ),
    "batch_size": ("B", "samples per micro-batch to start with (halved if the device runs out of memory)"),
    "max_micro_batches": ("N", "most micro-batches accumulated per step"),
    "precision": (
        "auto|fp32|bf16|fp16",
        "auto: bf16 autocast on GPUs that have it, fp32 elsewhere; fp16: autocast with dynamic loss scaling "
        "(GPUs without bf16)",
    ),
    "activation_checkpointing": (
        "on|off",
        "on: recompute each block's activations in the backward pass (less memory, more compute)",
    ),
    "nproc_per_node": (
        "N",
        "run this peer as N data-parallel ranks, one per GPU from --device's (gloo processes on a CPU): "
        "rank 0 talks to the swarm and steps, the others compute with it (also: shoal join under torchrun)",
    ),
    "outer_state": (
        "device|cpu",
        "DiLoCo: keep the outer copy, momentum and error feedback with the model, or in (pinned) host "
        "memory, copied to and from the device once a round",
    ),
    "fit": (
        "auto|off",
        "auto: before joining, estimate and measure (a dry run) the memory and time a round takes on this "
        "device, choose the micro-batch and activation checkpointing that fit, and refuse (exit 2) a model "
        "that cannot fit; off: skip",
    ),
    "max_memory": ("GIB", "memory this peer may use on its device (0: 90%% of what is free)"),
    "seq_len": (
        "N",
        "tokens a sample, up to the model's maximum (default: the embedded presets' own, a Hugging Face "
        "model's maximum up to 1,024)",
    ),
    "seed": ("N", "seed of the initial weights and of the data order"),
    "log_format": ("FORMAT", "human (a live table) or json (one object per line)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file of settings (also SHOAL_CONFIG)")
    for name, (metavar, text) in JOIN_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        default = settings_module.PeerSpec().flag(name)
        shown = "" if default in (None, "", ()) else f" (default: {default})"
        nargs = "+" if name in ("initial_peers", "announce_maddrs") else None
        parser.add_argument(flag, dest=name, metavar=metavar, nargs=nargs, help=text + shown)


def run(args: argparse.Namespace) -> int:
    """Exit 2 for a setting to fix (checked before anything starts), 1 for another failure."""
    from shoal.peer.config import preflight

    try:
        chosen = settings_module.resolve(vars(args), os.environ, args.config)
        preflight.check(chosen)  # before the seconds torch's import takes: a port in use is told at once
    except settings_module.SettingsError as error:
        print(f"shoal join: error: {error}", file=sys.stderr)
        return 2
    from shoal.peer.job.node import JoinError, join  # imports torch and hivemind: only now

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
