"""The algorithms as typed configs: `DeMoConfig` and `DiLoCoConfig`, one frozen record per algorithm
with the hyperparameters a run chooses for it. A run's `--algorithm` string is parsed into one of them
once (shoal.peer.config.spec: `PeerSpec.algorithm_config`); the code that depends on the algorithm
reads the record (`isinstance(config, DeMoConfig)`, `config.overlapped`) instead of the string.

    DEFAULTS["diloco-eager"]                    # DiLoCoConfig(mode="eager", ...), at its defaults
    DiLoCoConfig(mode="standard").outer_momentum  # 0.9: the mode's (OUTER_MOMENTUM)
    DeMoConfig(overlapped=True).name            # "demo-overlap", as --algorithm spells it

No torch here, so that the settings parse and check the algorithm before torch loads
(tests/unit/test_layers.py).
"""

import math
from dataclasses import dataclass
from typing import cast

MODES = ("standard", "delayed", "eager")
"""DiLoCo's outer updates (shoal.peer.algorithms.diloco): blocking, one round late, or one round late
with this participant's own fresh share applied at once."""
OUTER_MOMENTUM = {"standard": 0.9, "delayed": 0.0, "eager": 0.0}
"""The outer Nesterov momentum of each mode when none is given: DiLoCo's 0.9 in standard mode, none in
the late modes. Momentum carries the stale part of each late update forward, round after round, and
the late modes fall behind or diverge with it (BENCHMARKS.md: `shoal bench converge`, eager at outer
lr 0.7 reaches 3.87 against standard's 2.51; `shoal bench wan`, 48 steps at lr 0.4: eager 3.89 against
2.96)."""
AVERAGING = ("gather", "butterfly")
"""How a DiLoCo round is averaged: every peer pulls every payload, or piece by piece
(shoal.peer.algorithms.butterfly)."""
VALUE_BITS = (32, 16, 8, 4, 2, 1)
"""The bits per value the codecs can send (shoal.compression.values)."""
COMPRESSION = {
    "reference": ("demo", {"topk": 32, "value_bits": 32}),
    "compact": ("demo", {"topk": 4, "value_bits": 1}),
    "int8": ("diloco", {"value_bits": 8}),
    "sparse": ("diloco", {"topk": 64, "value_bits": 2}),
}
"""`--compression` presets: the algorithm each is for and the codec settings it stands for.
- reference: DeMo's paper settings, the DCT top-32 of every 64x64 chunk in float32 (104x smaller
  than float32 gradients);
- compact: the DCT top-4 at 1 bit (signs and one magnitude): 2,500x;
- int8: DiLoCo's pseudo-gradients, every value at 8 bits, one scale per 64 (3.8x);
- sparse: the top 64 of every 64x64 chunk at 2 bits (4 levels per chunk), Elias-Fano indices and
  error feedback (SparseLoCo, arXiv 2508.15706): 186x for 64x64 chunks, 148x for the tiny model (its
  many 64-value tensors cost a header each)."""
DEFAULT_COMPRESSION = {"demo": "reference", "diloco": "int8"}
SPARSE_OUTER = (1.5, 0.0)
"""The outer (learning rate, Nesterov momentum) of `--compression sparse` unless given: a plain SGD
step, as SparseLoCo's (arXiv 2508.15706), whose error feedback stands in for the momentum; the best
of a sweep on `shoal bench converge --quick --inner-steps 5` (BENCHMARKS.md).
"""
SPARSE_ERROR_DECAY = 1.0
"""The error feedback's beta with the sparse codec: all that was dropped is sent later. SparseLoCo's
Covenant-72B setting, 0.95, did worse on `shoal bench converge` (BENCHMARKS.md)."""


def _check_codec(topk: int, value_bits: int, chunk: int) -> None:
    if not 1 <= topk <= 4096:
        raise ValueError(f"topk must be in [1, 4096], got {topk}")
    if value_bits not in VALUE_BITS:
        raise ValueError(f"value_bits must be one of {', '.join(map(str, VALUE_BITS))}; got {value_bits!r}")
    if not 1 <= chunk <= 256:  # DecodeLimits.max_chunk: a receiver refuses larger chunks
        raise ValueError(f"chunk must be in [1, 256], got {chunk}")


def _positive(name: str, value: float) -> None:
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeMoConfig:
    """DeMo (shoal.peer.algorithms.demo): every step exchanges the DCT top-k of the momentum and
    applies the sign of the combined update."""

    overlapped: bool = False
    """Exchange each round on a background thread while the next one computes and apply it one step
    late, with Psyche's lookahead (`--algorithm demo-overlap`); the coordinator runs with --overlap."""
    lr: float = 2e-3
    """The learning rate: the step size of the sign update."""
    topk: int = 32
    """DCT coefficients sent per chunk (DeMo's compression_topk)."""
    value_bits: int = 32
    """Bits per sent coefficient: 32, 16 (bf16), 8, 4, 2, or 1 (signs only)."""
    chunk: int = 64
    """The side of the DCT chunks."""

    def __post_init__(self) -> None:
        _positive("lr", self.lr)
        _check_codec(self.topk, self.value_bits, self.chunk)

    @property
    def name(self) -> str:
        """The algorithm as `--algorithm`, run configs, checkpoints and logs spell it."""
        return "demo-overlap" if self.overlapped else "demo"

    @property
    def inner_steps(self) -> int:
        """Optimizer steps per round: DeMo exchanges in every step."""
        return 1


@dataclass(frozen=True, kw_only=True, slots=True)
class DiLoCoConfig:
    """DiLoCo (shoal.peer.algorithms.diloco): `inner_steps` steps of an inner AdamW, then an outer SGD
    step on the round's mean pseudo-gradient."""

    mode: str = "standard"
    """When the outer update lands: "standard" (blocking), "delayed" or "eager" (one round late, the
    exchange overlapped with the next round's computation; eager applies this peer's own share at
    once)."""
    lr: float = 1e-3
    """The inner AdamW's learning rate."""
    inner_steps: int = 10
    """H: inner steps per round, the last of them exchanging."""
    outer_lr: float = 0.4
    """The outer SGD's learning rate."""
    outer_momentum: float | None = None
    """The outer Nesterov momentum, in [0, 1); None: the mode's (OUTER_MOMENTUM), filled in when the
    config is made, so that a config always holds the number it runs with."""
    averaging: str = "gather"
    """How a round is averaged: "gather" (every peer pulls every payload) or "butterfly" (piece by
    piece, shoal.peer.algorithms.butterfly)."""
    compression: str = "int8"
    """How pseudo-gradients travel: "int8" (every value, quantized per block of 64) or "sparse" (the
    top-k of every chunk, with error feedback); `COMPRESSION`."""
    topk: int = 64
    """sparse: values kept per chunk of chunk x chunk."""
    value_bits: int = 8
    """Bits per sent value: 32, 16, 8, 4, 2 or 1."""
    chunk: int = 64
    """sparse: the side of the chunks; int8: values per scale."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        _positive("lr", self.lr)
        if self.inner_steps < 1:
            raise ValueError(f"inner_steps must be >= 1, got {self.inner_steps}")
        _positive("outer_lr", self.outer_lr)
        if self.outer_momentum is None:
            object.__setattr__(self, "outer_momentum", OUTER_MOMENTUM[self.mode])
        elif not 0 <= self.outer_momentum < 1:
            raise ValueError(f"outer_momentum must be in [0, 1), got {self.outer_momentum!r}")
        if self.averaging not in AVERAGING:
            raise ValueError(f"averaging must be one of {', '.join(AVERAGING)}; got {self.averaging!r}")
        if self.compression not in ("int8", "sparse"):
            raise ValueError(f"compression must be int8 or sparse for DiLoCo; got {self.compression!r}")
        _check_codec(self.topk, self.value_bits, self.chunk)
        if self.compression == "sparse" and self.averaging == "butterfly":
            raise ValueError(
                "averaging butterfly needs a dense codec (compression int8): sparse payloads are gathered"
            )

    @property
    def error_decay(self) -> float:
        """The error feedback's beta: SPARSE_ERROR_DECAY for sparse, 1 (all that was dropped) for int8."""
        return SPARSE_ERROR_DECAY if self.compression == "sparse" else 1.0

    @property
    def name(self) -> str:
        """The algorithm as `--algorithm`, run configs, checkpoints and logs spell it."""
        return f"diloco-{self.mode}"

    @property
    def overlapped(self) -> bool:
        """Whether round r is exchanged while round r + 1 computes (delayed and eager); the coordinator
        then runs with --overlap."""
        return self.mode != "standard"


AlgorithmConfig = DeMoConfig | DiLoCoConfig
"""The algorithm a peer runs, with its hyperparameters."""


def run_config(model: str, algorithm: AlgorithmConfig, *, seed: int = 0, gather: int = 0) -> dict[str, str]:
    """What every peer of a run must share, as text (hashed into its records,
    shoal.peer.swarm.membership): the only place a run configuration is written, so that a test peer,
    a benchmark's peer and a `shoal join` peer with equal settings hold equal ones. Settings at their
    defaults are left out where they came after the first runs, so that those runs keep their hash."""
    config = {"model": model, "algorithm": algorithm.name, "lr": repr(algorithm.lr), "seed": str(seed)}
    if gather:
        config["gather"] = str(gather)
    if isinstance(algorithm, DeMoConfig):
        config["compression_topk"] = str(algorithm.topk)
        return config | _changed(algorithm, DeMoConfig(), ("value_bits", "chunk"))
    config |= _changed(algorithm, DiLoCoConfig(), ("compression", "topk", "value_bits", "chunk"))
    config |= {
        "inner_steps": str(algorithm.inner_steps),
        "outer_lr": repr(algorithm.outer_lr),
        "outer_momentum": repr(algorithm.outer_momentum),
    }
    if algorithm.averaging != "gather":
        config["averaging"] = algorithm.averaging
    return config


def _changed(config: AlgorithmConfig, default: AlgorithmConfig, names: tuple[str, ...]) -> dict[str, str]:
    return {
        name: str(getattr(config, name)) for name in names if getattr(config, name) != getattr(default, name)
    }


DEFAULTS: dict[str, AlgorithmConfig] = {
    config.name: config
    for config in cast(
        "tuple[AlgorithmConfig, ...]",
        (DeMoConfig(), DeMoConfig(overlapped=True), *(DiLoCoConfig(mode=mode) for mode in MODES)),
    )
}
"""Each algorithm at its default hyperparameters, by its name (`config.name`): demo, demo-overlap,
diloco-standard, diloco-delayed, diloco-eager. The alias `--algorithm diloco` is
shoal.peer.config.settings'."""


def outer_settings(mode: str, lr: float, momentum: float | None, nesterov: bool) -> dict:
    """DiLoCo's outer SGD settings, checked; `momentum` None: the mode's (OUTER_MOMENTUM)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    if not lr > 0:
        raise ValueError(f"outer_lr must be > 0, got {lr}")
    momentum = OUTER_MOMENTUM[mode] if momentum is None else momentum
    if not 0 <= momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {momentum}")
    return {"lr": lr, "momentum": momentum, "nesterov": nesterov and momentum > 0}
