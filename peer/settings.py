"""Settings of `shoal join`: from flags, then `SHOAL_*` environment variables, then a TOML file, then
defaults; the first that names a setting wins. Every value is parsed and checked here, and a bad one
raises `SettingsError` naming the setting and where it came from (the CLI exits 2 with it).

    SHOAL_MODEL=small SHOAL_INITIAL_PEERS="/ip4/.../p2p/A /ip4/.../p2p/B" shoal join --config run.toml

The TOML file uses the settings' names (`model = "small"`, `initial_peers = ["/ip4/..."]`); an
unknown key is an error, so that a typo does not silently train with a default.
"""

import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from shoal.peer.algorithms.configs import (
    AVERAGING,
    COMPRESSION,
    DEFAULT_COMPRESSION,
    DEFAULTS,
    SPARSE_OUTER,
    VALUE_BITS,
    AlgorithmConfig,
    DeMoConfig,
    run_config,
)
from shoal.peer.swarm.names import check_run_name

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
MAX_CONFIG_BYTES = 1 << 20


class SettingsError(ValueError):
    """A setting has a bad value; the message names it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JoinSettings:
    """Everything `shoal join` runs with (see `shoal join --help` for each one)."""

    initial_peers: tuple[str, ...] = ()
    coordinator: str | None = None
    coordinator_token_file: str | None = None
    coordinator_ca: str | None = None
    run: str = "shoal"
    model: str = "tiny"
    data: str = "stdlib"
    algorithm: str = "demo"
    device: str = "auto"
    identity: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    max_rounds: int = 0
    until_round: int | None = None
    host: str = "0.0.0.0"
    port: int = 0
    announce_maddrs: tuple[str, ...] = ()
    relay: str = "on"
    metrics_port: int | None = None
    address_file: str | None = None
    round_seconds: float = 10.0
    start_time: float = 0.0
    discover_seconds: float = 60.0
    compute_fraction: float = 0.5
    lr: float = 0.0
    compression: str | None = None
    topk: int | None = None
    value_bits: int | None = None
    chunk: int | None = None
    inner_steps: int = 10
    outer_lr: float | None = None
    outer_momentum: float | None = None
    averaging: str = "gather"
    gather: int = 0
    batch_size: int = 8
    max_micro_batches: int = 64
    seed: int = 0
    log_format: str = "human"
    compute_delay: float = 0.0

    def algorithm_config(self) -> AlgorithmConfig:
        """The algorithm this peer runs, typed, with its hyperparameters from these settings (the other
        algorithm's are ignored; `lr` 0 is the algorithm's default)."""
        if self.algorithm not in DEFAULTS:
            raise ValueError(f"algorithm must be one of {', '.join(DEFAULTS)}; got {self.algorithm!r}")
        named = DEFAULTS[self.algorithm]
        lr = self.lr or named.lr
        family = "demo" if isinstance(named, DeMoConfig) else "diloco"
        preset = self.compression or DEFAULT_COMPRESSION[family]
        fits, codec = COMPRESSION[preset]
        if fits != family:
            takes = ", ".join(name for name, (f, _) in COMPRESSION.items() if f == family)
            raise ValueError(f"compression {preset} is not for {self.algorithm}, which takes {takes}")
        if preset == "int8" and self.topk is not None:
            raise ValueError(
                "topk does not apply to compression int8, which sends every value (sparse: the top-k)"
            )
        overrides = {"topk": self.topk, "value_bits": self.value_bits, "chunk": self.chunk}
        codec = codec | {name: value for name, value in overrides.items() if value is not None}
        if family == "demo":
            return replace(named, lr=lr, **codec)
        return replace(
            named,
            lr=lr,
            inner_steps=self.inner_steps,
            # the sparse codec's own outer step where none is given (configs.SPARSE_OUTER)
            outer_lr=_first(self.outer_lr, SPARSE_OUTER[0] if preset == "sparse" else named.outer_lr),
            outer_momentum=_first(self.outer_momentum, SPARSE_OUTER[1] if preset == "sparse" else None),
            averaging=self.averaging,
            compression=preset,
            **codec,
        )

    def run_config(self) -> dict[str, str]:
        """What every peer of a run must share (shoal.peer.algorithms.configs.run_config)."""
        return run_config(self.model, self.algorithm_config(), seed=self.seed, gather=self.gather)


def _first(value: Any, default: Any) -> Any:
    return default if value is None else value


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
    return value


def _run(value: Any) -> str:
    return check_run_name(_text(value))


PARSERS: dict[str, Callable[[Any], Any]] = {
    "initial_peers": _peers,
    "coordinator": _address,
    "coordinator_token_file": _text,
    "coordinator_ca": _text,
    "run": _run,
    "model": _text,
    "data": _text,
    "algorithm": _choice(ALGORITHMS),
    "device": _device,
    "identity": _text,
    "checkpoint_dir": _text,
    "checkpoint_every": _int(0),
    "max_rounds": _int(0),
    "until_round": _int(0),
    "host": _text,
    "port": _int(0, 65535),
    "announce_maddrs": _peers,
    "relay": _choice(("on", "off")),
    "metrics_port": _int(0, 65535),
    "address_file": _text,
    "round_seconds": _float(0.5, 86400),
    "start_time": _float(0.0, 1e11),
    "discover_seconds": _float(0.0, 86400),
    "compute_fraction": _float(0.0, 0.95, open_low=True),
    "lr": _float(0.0, 10.0),
    "compression": _choice(tuple(COMPRESSION)),
    "topk": _int(1, 4096),
    "value_bits": _choice_int(VALUE_BITS),
    "chunk": _int(1, 256),
    "inner_steps": _int(1, 100_000),
    "outer_lr": _float(0.0, 10.0, open_low=True),
    "outer_momentum": _float(0.0, 0.999),
    "averaging": _choice(AVERAGING),
    "gather": _int(0, 100_000),
    "batch_size": _int(1, 65536),
    "max_micro_batches": _int(1, 4096),
    "seed": _int(0),
    "log_format": _choice(("human", "json")),
    "compute_delay": _float(0.0, 3600.0),
}
assert PARSERS.keys() == {f.name for f in fields(JoinSettings)}


def resolve(
    flags: Mapping[str, Any], environ: Mapping[str, str], config_path: str | None = None
) -> JoinSettings:
    """Settings from `flags` (None: not given), then `SHOAL_<NAME>` in `environ`, then the TOML file
    at `config_path` (or `SHOAL_CONFIG`), then defaults."""
    config_path = config_path or environ.get("SHOAL_CONFIG") or None
    from_file = _read_toml(config_path) if config_path else {}
    values = {}
    for name, parse in PARSERS.items():
        sources = (
            ("--" + name.replace("_", "-"), flags.get(name)),
            ("SHOAL_" + name.upper(), environ.get("SHOAL_" + name.upper())),
            (f"{name} in {config_path}", from_file.get(name)),
        )
        for where, raw in sources:
            if raw is None:
                continue
            try:
                values[name] = parse(raw)
            except ValueError as error:
                raise SettingsError(f"{where}: {error}") from None
            break
    settings = JoinSettings(**values)
    try:
        algorithm = settings.algorithm_config()
    except ValueError as error:  # settings that each parse but do not fit together, named
        name = str(error).split()[0]
        raise SettingsError(
            f"--{name.replace('_', '-') if name in PARSERS else 'algorithm'}: {error}"
        ) from None
    if settings.averaging == "butterfly" and isinstance(algorithm, DeMoConfig):
        raise SettingsError("--averaging butterfly: DiLoCo only (DeMo's payloads are sparse)")
    if settings.averaging == "butterfly" and settings.gather:
        raise SettingsError(
            "--gather: not with --averaging butterfly, which averages every peer's payload piece by piece"
        )
    return settings


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise SettingsError(f"--config {path}: {error.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise SettingsError(f"--config {path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise SettingsError(f"--config {path}: not valid TOML ({error})") from None
    unknown = sorted(set(table) - PARSERS.keys())
    if unknown:
        raise SettingsError(f"--config {path}: unknown setting {', '.join(map(repr, unknown))}")
    return table
