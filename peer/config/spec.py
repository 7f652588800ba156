"""What a peer runs with, as one typed, nested specification: `PeerSpec`, made of one frozen config
per component (network, coordinator, run, algorithm, model, data, checkpoint, logging).

    spec = PeerSpec.of(model="small", algorithm="diloco", inner_steps=20)   # from flag names
    spec.model.name, spec.algorithm.config().inner_steps                  # "small", 20
    spec.changed(port=4001)                                               # another spec, one flag moved

`shoal join` reads its flags, `SHOAL_*` variables and TOML sections into it (shoal.peer.config.settings);
`build_peer` and the integration tests' peers start from one and override fields. Each field is named
by one flag (`FLAGS`: `--checkpoint-every` is `checkpoint.every`), and every check, whether of a
flag's text or of a value set in code, raises a `ValueError` naming the flag. The run configuration
that peers of one run must share (and so its hash) comes from here alone (`run_config`).

No torch here, so that a bad setting is told before torch loads (tests/unit/test_layers.py).
"""

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, cast

from shoal.peer.algorithms.configs import (
    AVERAGING,
    COMPRESSION,
    DEFAULT_COMPRESSION,
    DEFAULTS,
    SPARSE_OUTER,
    VALUE_BITS,
    AlgorithmConfig,
    DeMoConfig,
    DiLoCoConfig,
    run_config,
)
from shoal.peer.algorithms.schedule import KINDS, Schedule
from shoal.peer.swarm.names import check_run_name, parse_trust_key

ALGORITHMS = {
    "demo": "demo",
    "demo-overlap": "demo-overlap",
    "diloco": "diloco-eager",
    "diloco-standard": "diloco-standard",
    "diloco-delayed": "diloco-delayed",
    "diloco-eager": "diloco-eager",
}
"""What --algorithm accepts, and the algorithm (shoal.peer.algorithms.configs.DEFAULTS) each names."""
DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d{1,3})?)$")
DEFAULT_ROUND_S = 10.0
"""The shortest round a first peer chooses (shoal.peer.job.window.round_seconds_for)."""
FIRST_FRACTION = 0.5
"""The share of a round kept for the exchange before one was measured, and at most."""


# --- the checks of single values: each parses a flag's text (or a value set in code) or raises -------


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("expected a non-empty string")
    return value


def _int(low: int, high: int = 2**62) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError("expected an integer")
        number = int(value) if isinstance(value, int) else int(value.strip())
        if not low <= number <= high:
            raise ValueError(f"expected an integer in [{low}, {high}], got {number}")
        return number

    return parse


def _float(low: float, high: float, *, open_low: bool = False) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError("expected a number")
        number = float(value)
        if not math.isfinite(number) or number > high or number < low or (open_low and number == low):
            bound = "(" if open_low else "["
            raise ValueError(f"expected a number in {bound}{low}, {high}], got {value!r}")
        return number

    return parse


def _choice_int(options: tuple[int, ...]) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        number = _int(min(options), max(options))(value)
        if number not in options:
            raise ValueError(f"expected one of {', '.join(map(str, options))}, got {number}")
        return number

    return parse


def _choice(options: Mapping[str, str] | tuple[str, ...]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return options[value] if isinstance(options, Mapping) else value

    return parse


def _trust_key(value: Any) -> str:
    return parse_trust_key(value).hex()


def _device(value: Any) -> str:
    if not isinstance(value, str) or not DEVICE.match(value):
        raise ValueError(f"expected auto, cpu, cuda, cuda:N or mps, got {value!r}")
    return value


def _peers(value: Any) -> tuple[str, ...]:
    items = value.split() if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not all(isinstance(p, str) and p for p in items):
        raise ValueError("expected a list of peer multiaddresses")
    return tuple(items)


def _address(value: Any) -> str:
    host, _, port = _text(value).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    return cast(str, value)  # a str: _text checked it


def _run(value: Any) -> str:
    return check_run_name(_text(value))


def _flag(name: str, parse: Callable[[Any], Any]) -> Any:
    """A field named by flag `--name`, checked by `parse`: `field(metadata=...)` for `_checked`."""
    return {"flag": name, "parse": parse}


def _checked(config: Any) -> None:
    """Parses and checks every field of a component config that is set (not None), in place; a
    ValueError names the field's flag."""
    for item in fields(config):
        value = getattr(config, item.name)
        if value is None:
            continue
        try:
            object.__setattr__(config, item.name, item.metadata["parse"](value))
        except ValueError as error:
            raise ValueError(f"--{item.metadata['flag'].replace('_', '-')}: {error}") from None


def _setting(flag: str, parse: Callable[[Any], Any], default: Any) -> Any:
    return field(default=default, metadata=_flag(flag, parse))


# --- the components -------------------------------------------------------------------------------


class _Section:
    """A component config: every field checked by its flag's parser when it is made."""

    __slots__ = ()

    def __post_init__(self) -> None:
        _checked(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class NetworkSpec(_Section):
    """How the peer reaches the swarm and is reached."""

    initial_peers: tuple[str, ...] = _setting("initial_peers", _peers, ())
    """Multiaddresses of peers in the swarm (none: start a new swarm)."""
    host: str = _setting("host", _text, "0.0.0.0")
    """IPv4 address to listen on."""
    port: int = _setting("port", _int(0, 65535), 0)
    """TCP port to listen on (0: any free one)."""
    announce_maddrs: tuple[str, ...] = _setting("announce_maddrs", _peers, ())
    """Addresses given to other peers instead of those it listens on (a forwarded port)."""
    relay: str = _setting("relay", _choice(("on", "off")), "on")
    """on: behind NAT, reach the others through the bootstrap nodes' relays; off: direct only."""
    identity: str | None = _setting("identity", _text, None)
    """The peer's identity file (created if missing)."""
    address_file: str | None = _setting("address_file", _text, None)
    """Where to write the address others join through, once listening."""
    trust_key: str | None = _setting("trust_key", _trust_key, None)
    """The run key (64 hex digits): out of sync, take only the shared state it signed
    (shoal.peer.swarm.anchor)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CoordinatorSpec(_Section):
    """The swarm's coordinator, if it has one."""

    address: str | None = _setting("coordinator", _address, None)
    """HOST:PORT of the coordinator (None: uncoordinated rounds)."""
    token_file: str | None = _setting("coordinator_token_file", _text, None)
    """The file holding this peer's token for it."""
    ca: str | None = _setting("coordinator_ca", _text, None)
    """Talk TLS to it, trusting this CA file (or "system")."""
    wait: float = _setting("coordinator_wait", _float(1, 86400), 120.0)
    """Seconds a peer trains uncoordinated while its coordinator has never answered, before it stops
    (exit 2): a wrong address is told, not trained around forever. Once answered, an outage is ridden out."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSpec(_Section):
    """The run this peer trains in, and how long it stays."""

    name: str = _setting("run", _run, "shoal")
    """The run's name: peers of one run train one model."""
    round_seconds: float | None = _setting("round_seconds", _float(0.5, 86400), None)
    """Length of a round, when starting a new swarm. None: one that the exchange of this peer's payload
    fits (shoal.peer.job.window.round_seconds_for); a peer that joins a swarm takes the swarm's."""
    start_time: float = _setting("start_time", _float(0.0, 1e11), 0.0)
    """Unix time of round 0, when starting a new swarm (0: now)."""
    discover_seconds: float = _setting("discover_seconds", _float(0.0, 86400), 60.0)
    """With initial peers: how long to wait for a peer of the run before starting it."""
    compute_fraction: float | None = _setting("compute_fraction", _float(0.0, 0.95, open_low=True), None)
    """Share of a round spent computing; the rest is for the exchange. None: until the round's deadline
    less the exchange time measured (shoal.peer.job.window), half a round until measured."""
    max_rounds: int = _setting("max_rounds", _int(0), 0)
    """Leave after this many rounds (0: never)."""
    until_round: int | None = _setting("until_round", _int(0), None)
    """Leave after the swarm's round R."""
    gather: int = _setting("gather", _int(0, 100_000), 0)
    """At most this many payloads count in a round (0: all): a bounded fan-in."""
    seed: int = _setting("seed", _int(0), 0)
    """Seed of the initial weights and of the data order."""

    @property
    def window_s(self) -> float:
        """The compute window of a round as first planned: --compute-fraction's, else half a round
        (shoal.peer.job.window adapts it from there)."""
        return (self.round_seconds or DEFAULT_ROUND_S) * (self.compute_fraction or FIRST_FRACTION)


@dataclass(frozen=True, slots=True, kw_only=True)
class AlgorithmSpec(_Section):
    """The algorithm and its hyperparameters, as chosen; `config()` is what runs."""

    name: str = _setting("algorithm", _choice(ALGORITHMS), "demo")
    """demo, demo-overlap, diloco (eager), diloco-standard, diloco-delayed or diloco-eager."""
    lr: float = _setting("lr", _float(0.0, 10.0), 0.0)
    """The learning rate (0: the algorithm's default)."""
    compression: str | None = _setting("compression", _choice(tuple(COMPRESSION)), None)
    """The codec preset (None: the algorithm's default; configs.COMPRESSION)."""
    topk: int | None = _setting("topk", _int(1, 4096), None)
    """Values sent per chunk (None: the preset's)."""
    value_bits: int | None = _setting("value_bits", _choice_int(VALUE_BITS), None)
    """Bits per sent value (None: the preset's)."""
    chunk: int | None = _setting("chunk", _int(1, 256), None)
    """Side of the chunks (None: the preset's)."""
    inner_steps: int = _setting("inner_steps", _int(1, 100_000), 10)
    """DiLoCo: inner steps per round."""
    outer_lr: float | None = _setting("outer_lr", _float(0.0, 10.0, open_low=True), None)
    """DiLoCo: the outer learning rate (None: the mode's, or the sparse codec's)."""
    outer_momentum: float | None = _setting("outer_momentum", _float(0.0, 0.999), None)
    """DiLoCo: the outer Nesterov momentum (None: the mode's, or the sparse codec's)."""
    averaging: str = _setting("averaging", _choice(AVERAGING), "gather")
    """DiLoCo: gather, or butterfly (piece by piece, with a coordinator)."""
    lr_schedule: str = _setting("lr_schedule", _choice(KINDS), "constant")
    """How the learning rate follows the swarm's round (shoal.peer.algorithms.schedule)."""
    warmup_rounds: int = _setting("warmup_rounds", _int(0, 10**9), 0)
    """Rounds of linear warmup."""
    decay_rounds: int | None = _setting("decay_rounds", _int(1, 10**9), None)
    """cosine, linear: rounds of decay after the warmup (None: to the run's end, --until-round); wsd:
    rounds of the final decay (None: the run's last fifth)."""
    min_lr: float = _setting("min_lr", _float(0.0, 10.0), 0.0)
    """Where the decay ends."""
    grad_clip: float = _setting("grad_clip", _float(0.0, 1e6), 0.0)
    """Clip each step's gradient to this norm (0: no clipping)."""
    weight_decay: float | None = _setting("weight_decay", _float(0.0, 10.0), None)
    """Decoupled weight decay: DeMo's, DiLoCo's inner AdamW's (None: the algorithm's, 0 and 0.1)."""

    def __post_init__(self) -> None:
        _Section.__post_init__(self)
        self.config()  # the values that each check but do not fit together, named

    def config(self) -> AlgorithmConfig:
        """The algorithm this peer runs, typed, with its hyperparameters (the other algorithm's are
        ignored; `lr` 0 is the algorithm's default). ValueError naming the flag for values that do not
        fit together."""
        named = DEFAULTS[self.name]
        family = "demo" if isinstance(named, DeMoConfig) else "diloco"
        preset = self.compression or DEFAULT_COMPRESSION[family]
        fits, codec = COMPRESSION[preset]
        if fits != family:
            takes = ", ".join(name for name, (f, _) in COMPRESSION.items() if f == family)
            raise ValueError(
                f"--compression: compression {preset} is not for {self.name}, which takes {takes}"
            )
        if preset == "int8" and self.topk is not None:
            raise ValueError(
                "--topk: topk does not apply to compression int8, which sends every value (sparse: the top-k)"
            )
        if self.averaging == "butterfly" and family == "demo":
            raise ValueError("--averaging butterfly: DiLoCo only (DeMo's payloads are sparse)")
        overrides = {"topk": self.topk, "value_bits": self.value_bits, "chunk": self.chunk}
        codec = codec | {name: value for name, value in overrides.items() if value is not None}
        try:
            if family == "demo":
                return replace(cast(DeMoConfig, named), lr=self.lr or named.lr, **cast(dict[str, Any], codec))
            diloco = cast(DiLoCoConfig, named)  # family "diloco": not a DeMoConfig
            sparse = preset == "sparse"  # the sparse codec's own outer step where none is given
            return replace(
                diloco,
                lr=self.lr or named.lr,
                inner_steps=self.inner_steps,
                outer_lr=_first(self.outer_lr, SPARSE_OUTER[0] if sparse else diloco.outer_lr),
                outer_momentum=_first(self.outer_momentum, SPARSE_OUTER[1] if sparse else None),
                averaging=self.averaging,
                compression=preset,
                **cast(dict[str, Any], codec),  # topk, value_bits, chunk: int fields of both
            )
        except ValueError as error:  # the config's own check names its field, which is the flag
            name = str(error).split()[0]
            raise ValueError(f"--{name.replace('_', '-')}: {error}") from None


MOST_MICRO_BATCHES = 4096
"""The most micro-batches a step any peer of a run accumulates (`--max-micro-batches` is at most this):
the token ledger's bound on a peer's claim derives from it, the same for every peer of a run, so that a
peer may lower its own (`shoal demo` and the compose stack do, their peers sharing one machine) and
still join the others."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec(_Section):
    """The model, the device it trains on, and its micro-batches."""

    name: str = _setting("model", _text, "tiny")
    """tiny, small or base (the embedded GPT), a module:factory, or a Hugging Face directory."""
    device: str = _setting("device", _device, "auto")
    """auto, cpu, cuda, cuda:N or mps."""
    batch_size: int = _setting("batch_size", _int(1, 65536), 8)
    """Samples per micro-batch to start with (halved if the device runs out of memory)."""
    max_micro_batches: int = _setting("max_micro_batches", _int(1, MOST_MICRO_BATCHES), MOST_MICRO_BATCHES)
    """Most micro-batches this peer accumulates per step: by default enough that a fast device fills
    its compute window. This peer's own: not part of the run's configuration."""
    precision: str = _setting("precision", _choice(("auto", "fp32", "bf16", "fp16")), "auto")
    """auto (bf16 autocast on GPUs that have it, fp32 elsewhere), fp32, bf16 autocast anywhere, or fp16
    autocast with dynamic loss scaling (shoal.peer.train.hardware.LossScale)."""
    activation_checkpointing: str = _setting("activation_checkpointing", _choice(("on", "off")), "off")
    """on: keep only each block's input and recompute its activations in the backward pass."""
    nproc_per_node: int = _setting("nproc_per_node", _int(1, 1024), 1)
    """Data-parallel ranks of this peer on this machine, one per GPU (or CPU process):
    shoal.peer.train.ranks."""
    outer_state: str = _setting("outer_state", _choice(("device", "cpu")), "device")
    """Where DiLoCo keeps its outer copy, momentum and error feedback: with the model, or in (pinned)
    host memory, copied to and from the device once a round."""
    fit: str = _setting("fit", _choice(("auto", "off")), "auto")
    """auto: before joining, estimate and measure (a dry run) the memory and time a round takes here,
    choose the micro-batch and activation checkpointing that fit, refuse what cannot
    (shoal.peer.train.fit)."""
    max_memory: float = _setting("max_memory", _float(0.0, 1 << 20), 0.0)
    """GiB this peer may use on its device (0: 90% of what is free)."""
    seq_len: int | None = _setting("seq_len", _int(1, 1 << 20), None)
    """Tokens a sample, up to the model's maximum (None: the embedded presets' own; a Hugging Face
    model's maximum, at most 1,024; a factory module's `seq_len`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DataSpec(_Section):
    """What the peer trains on."""

    source: str = _setting("data", _text, "stdlib")
    """stdlib, a text corpus (jsonl, parquet, csv, arrow folder, text files), a prepared corpus
    (shoal data prepare), or token files (.npy, .bin): shoal.peer.data.sources."""
    tokenizer: str | None = _setting("tokenizer", _text, None)
    """A tokenizer.json, a folder holding one, or bytes (None: the model directory's own, else bytes)."""
    text_field: str = _setting("text_field", _text, "text")
    """The field of a dataset's rows that holds the text."""
    cache: str | None = _setting("data_cache", _text, None)
    """Where text corpora are prepared (None: ~/.cache/shoal/data)."""
    validate_every: int = _setting("validate_every", _int(0), 10)
    """Rounds between two validation losses on the held-out batches (0: only at the end)."""
    audit: str = _setting("audit_data", _choice(("on", "off")), "off")
    """on: log, each round, the indices of the windows this peer trained (a `trained` event)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointSpec(_Section):
    """Where and how often the peer keeps its state."""

    dir: str | None = _setting("checkpoint_dir", _text, None)
    """Keep checkpoints here and resume from the newest (None: none)."""
    every: int = _setting("checkpoint_every", _int(0), 10)
    """Rounds between checkpoints."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoggingSpec(_Section):
    """What the peer tells, and where."""

    format: str = _setting("log_format", _choice(("human", "json")), "human")
    """human (a live table) or json (one object per line)."""
    metrics_port: int | None = _setting("metrics_port", _int(0, 65535), None)
    """Serve Prometheus metrics on host:N/metrics (0: any free port; None: none)."""


SECTIONS: dict[str, type] = {
    "network": NetworkSpec,
    "coordinator": CoordinatorSpec,
    "run": RunSpec,
    "algorithm": AlgorithmSpec,
    "model": ModelSpec,
    "data": DataSpec,
    "checkpoint": CheckpointSpec,
    "logging": LoggingSpec,
}
"""The components, as the TOML file's sections name them."""

FLAGS: dict[str, tuple[str, str]] = {
    item.metadata["flag"]: (section, item.name) for section, kind in SECTIONS.items() for item in fields(kind)
}
"""Each flag's name (`checkpoint_every`, as `--checkpoint-every` and `SHOAL_CHECKPOINT_EVERY` spell
it) and the (section, field) it sets."""

PARSERS: dict[str, Callable[[Any], Any]] = {
    item.metadata["flag"]: item.metadata["parse"] for kind in SECTIONS.values() for item in fields(kind)
}
"""Each flag's check, by flag name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSpec:
    """Everything a peer runs with (`shoal join --help` describes each flag)."""

    network: NetworkSpec = field(default_factory=NetworkSpec)
    coordinator: CoordinatorSpec = field(default_factory=CoordinatorSpec)
    run: RunSpec = field(default_factory=RunSpec)
    algorithm: AlgorithmSpec = field(default_factory=AlgorithmSpec)
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    logging: LoggingSpec = field(default_factory=LoggingSpec)

    def __post_init__(self) -> None:
        self.schedule()  # a schedule that does not fit the run, named
        if self.algorithm.averaging == "butterfly" and self.run.gather:
            raise ValueError(
                "--gather: not with --averaging butterfly, which averages every peer's payload piece by piece"
            )

    @staticmethod
    def of(**flags: Any) -> "PeerSpec":
        """The spec with these flags set (by flag name: `checkpoint_every=5`), the rest at defaults."""
        return PeerSpec().changed(**flags)

    def changed(self, **flags: Any) -> "PeerSpec":
        """This spec with these flags set to other values."""
        unknown = sorted(set(flags) - FLAGS.keys())
        if unknown:
            raise ValueError(f"unknown setting {', '.join(map(repr, unknown))}")
        by_section: dict[str, dict[str, Any]] = {}
        for flag, value in flags.items():
            section, name = FLAGS[flag]
            by_section.setdefault(section, {})[name] = value
        return replace(
            self,
            **{section: replace(getattr(self, section), **values) for section, values in by_section.items()},
        )

    def flag(self, name: str) -> Any:
        """The value of flag `name` (`checkpoint_every`)."""
        section, field_name = FLAGS[name]
        return getattr(getattr(self, section), field_name)

    def algorithm_config(self) -> AlgorithmConfig:
        """The algorithm this peer runs (AlgorithmSpec.config)."""
        return self.algorithm.config()

    def schedule(self) -> Schedule:
        """The learning-rate schedule: `--decay-rounds` given, or taken from the run's length
        (`--until-round`). ValueError naming the flag when it does not fit."""
        algorithm, total = self.algorithm, 0 if self.run.until_round is None else self.run.until_round + 1
        decay = algorithm.decay_rounds
        if decay is None and total:
            decay = max(total // 5, 1) if algorithm.lr_schedule == "wsd" else total - algorithm.warmup_rounds
        try:
            return Schedule(
                kind=algorithm.lr_schedule,
                warmup=algorithm.warmup_rounds,
                decay=max(decay or 0, 0),
                total=total,
                min_lr=algorithm.min_lr,
            )
        except ValueError as error:  # "field: why", the field being the flag's name
            name, _, why = str(error).partition(": ")
            raise ValueError(f"--{name.replace('_', '-')}: {why}") from None

    def run_config(self, data: Any = None) -> dict[str, str]:
        """What every peer of a run must share (shoal.peer.algorithms.configs.run_config); with the
        loaded `data` (TokenStreams), the digest it pins and the tokenizer that made it."""
        config = run_config(
            self.model.name, self.algorithm_config(), seed=self.run.seed, gather=self.run.gather
        )
        if data is not None and data.digest is not None:  # the standard library pins nothing, as before
            config |= {"data": data.digest, "tokenizer": data.tokenizer}
        if self.model.seq_len is not None:
            config["seq_len"] = str(self.model.seq_len)
        config |= self.schedule().run_config()
        algorithm = self.algorithm
        config |= {"grad_clip": repr(algorithm.grad_clip)} if algorithm.grad_clip else {}
        config |= {} if algorithm.weight_decay is None else {"weight_decay": repr(algorithm.weight_decay)}
        return config


def _first(value: Any, default: Any) -> Any:
    return default if value is None else value
