"""Whether a model trains on this device with an algorithm, and in time: what `shoal check --model` and
`shoal join` (before its DHT starts) decide before a peer joins.

- `estimate`: the larger of the backward pass's peak (the parameters, the algorithm's state, the
  activations a micro-batch keeps for its backward pass) and the optimizer step's (the parameters,
  their gradients, the algorithm's state and the step's buffers: `algorithm_memory`). The activations
  come from the model's own autograd graph, traced on fake tensors (nothing is allocated) under the
  autocast the peer trains in: the saved-tensor hooks see every tensor the backward pass will read.
  Backward's own temporaries are counted as two of the largest saved tensor (the loss's gradient
  through the logits), or, with activation checkpointing, as one block's recomputed activations.
- `measure`: a dry run on the device with the model itself (its parameters and the random generators
  are put back afterwards): two rounds over a loopback exchange of one peer on random tokens, whose
  peak memory is read (the CUDA allocator's peak; elsewhere `LiveTensors`, which follows every live
  tensor), then one more round's computation, untracked, for the time.
- `fit`: the largest micro-batch (from --batch-size down, halving), then with activation
  checkpointing, then (DiLoCo on a GPU) with the outer state in host memory, whose estimate and then
  measured peak fit the memory budget, and whose round computes within the compute window (DiLoCo's H
  inner steps; DeMo's one micro-batch). `FitError` with the numbers and what to change when nothing
  fits in memory: `shoal join` refuses with exit 2. A device too slow for the window is a `late` fit:
  `shoal join` says so with the numbers and joins (a device's speed varies with its load), then tells
  of each run of rounds its payloads missed. `--fit off` skips the check.

    fit(loaded, DeMoConfig(), device=torch.device("cpu"), batch_size=8, window_s=5.0).describe()
"""

import contextlib
import dataclasses
import functools
import math
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shoal.peer.algorithms.configs import AlgorithmConfig, DeMoConfig, DiLoCoConfig
from shoal.peer.algorithms.exchange import LoopbackExchange
from shoal.peer.algorithms.feedback import codec_for
from shoal.peer.algorithms.tile_groups import slice_parameters
from shoal.peer.models.gpt import TinyGPT
from shoal.peer.models.loading import LoadedModel, recompute, recomputing
from shoal.peer.train.trainer import Trainer

MIB = 1 << 20
HEADROOM = 0.9
"""The share of the device's free memory a fit may use: the rest is left to the allocator's
fragmentation, the exchange's buffers and the other processes of the machine."""
DEMO_SLICE_NUMEL = 1 << 24
"""DeMo's largest slice (shoal.peer.algorithms.demo.DeMo's max_slice_numel default)."""
DRY_INNER_STEPS = 2
"""Inner steps a dry run of DiLoCo takes per round (its H steps cost H times one, in time only)."""


class FitError(ValueError):
    """Nothing fits: the message has the numbers and what to change."""


def algorithm_memory(
    algorithm: AlgorithmConfig, params: list[torch.Tensor], outer_on_host: bool = False
) -> tuple[int, int]:
    """(bytes the algorithm keeps between steps, bytes at the peak of its step, gradients included) for
    `params`, from the buffers of shoal.peer.algorithms, in parameter-sized float32 copies as a dry run
    of each measured them (tiny and a GPT-2 configuration alike, within 1%):
    - DeMo: its momentum, and three workspace slots the size of its largest slice (the DCT of the
      gradient, the sum, the selection), four and a third of them at the step; the lookahead's origin
      when overlapped;
    - DiLoCo: 6 copies between steps (AdamW's two moments, the outer copy, its momentum, the error
      feedback's residual, the last payload sent), 10.1 at the outer step (the pseudo-gradient, its
      encoding and the round's mean); 10.4 eager and sparse (the eager direction, the top-k residual);
      with its outer state on the host (`outer_on_host`), only AdamW's moments stay, and at its step the
      gradients and one temporary (not measured yet: it needs a GPU)."""
    size = sum(p.numel() for p in params) * 4
    if isinstance(algorithm, DeMoConfig):
        slices = slice_parameters(params, algorithm.chunk, DEMO_SLICE_NUMEL)
        slot = max((piece.plan.numel for piece in slices), default=0) * 4
        own = size * (1 + algorithm.overlapped)
        return own + 3 * slot, size + own + int(4.35 * slot)
    between, step = 6.0, 10.1
    if outer_on_host:
        between, step = 2.0, 4.0
    elif algorithm.mode == "eager" or algorithm.compression == "sparse":
        step = 10.4
    return int(between * size), int(step * size)


@dataclass(frozen=True, slots=True)
class Estimate:
    """What one micro-batch of `batch_size` costs in memory, in bytes, before running it: the larger of
    the backward pass's peak (parameters, the algorithm's state, the activations) and the optimizer
    step's (parameters, gradients and the step's buffers)."""

    batch_size: int
    checkpointing: bool
    parameters: int
    state: int
    """The algorithm's between steps."""
    activations: int
    """Saved for the backward pass, plus backward's largest temporaries."""
    step: int
    """At the peak of the optimizer step, beyond the parameters: gradients, state and its buffers."""

    @property
    def total(self) -> int:
        return self.parameters + max(self.state + self.activations, self.step)


@dataclass(frozen=True, slots=True)
class Trial:
    """One dry run: the estimate of a micro-batch, its measured peak and its compute time a round."""

    estimate: Estimate
    measured: float
    """Bytes at the peak; inf when the micro-batch ran out of memory."""
    round_s: float
    """Seconds of computation a round asks: DiLoCo's H inner steps, DeMo's one micro-batch."""
    outer_on_host: bool = False
    payload_bytes: int = 0
    """The size of the payload the dry run's round sent (what a round of the swarm sends)."""


@dataclass(frozen=True, slots=True)
class Fit:
    """The micro-batch and checkpointing chosen, with the numbers they were chosen on."""

    batch_size: int
    checkpointing: bool
    budget: int
    """Bytes the device offers (HEADROOM of its free memory, or --max-memory)."""
    window_s: float | None
    trials: tuple[Trial, ...]
    name: str = "the model"
    algorithm: AlgorithmConfig | None = None

    @property
    def chosen(self) -> Trial:
        return self.trials[-1]

    @property
    def outer_on_host(self) -> bool:
        """Whether DiLoCo's outer state goes to host memory (`--outer-state cpu`)."""
        return self.chosen.outer_on_host

    @property
    def late(self) -> bool:
        """Whether even this micro-batch computes a round past the compute window."""
        return self.window_s is not None and self.chosen.round_s > self.window_s

    def lateness(self) -> str:
        """Why this peer will miss its rounds, and what to change (`late`)."""
        # `fit` gives every Fit its algorithm; a late one has a window
        return too_slow(
            self.name, cast(AlgorithmConfig, self.algorithm), self.chosen, cast(float, self.window_s)
        )

    def describe(self) -> str:
        trial, estimate = self.chosen, self.chosen.estimate
        within = "" if self.window_s is None else f" within the {self.window_s:g} s compute window"
        return (
            f"fits: micro-batch {self.batch_size}{', activation checkpointing' if self.checkpointing else ''}"
            f"{', outer state in host memory' if self.outer_on_host else ''}"
            f", estimated {mib(estimate.total)} MiB ({parts(estimate)}), measured "
            f"{mib(trial.measured)} MiB of {mib(self.budget)} MiB; a round computes in "
            f"{trial.round_s:.2f} s{within}"
        )

    def record(self) -> dict:
        """The numbers, for --json and the logs."""
        trial = self.chosen
        return {
            "batch_size": self.batch_size,
            "activation_checkpointing": self.checkpointing,
            "outer_state": "cpu" if self.outer_on_host else "device",
            "budget_bytes": self.budget,
            "estimated_bytes": trial.estimate.total,
            "measured_bytes": trial.measured,
            "round_compute_s": round(trial.round_s, 4),
            "payload_bytes": trial.payload_bytes,
            "window_s": self.window_s,
            "tried": [
                {
                    "batch_size": t.estimate.batch_size,
                    "activation_checkpointing": t.estimate.checkpointing,
                    "estimated_bytes": t.estimate.total,
                    "measured_bytes": t.measured,
                    "round_compute_s": round(t.round_s, 4),
                }
                for t in self.trials
            ],
        }


def memory_budget(device: torch.device, max_memory_gib: float = 0.0) -> int:
    """Bytes a peer may use on `device`: `max_memory_gib` if given, else HEADROOM of what is free (a CUDA
    GPU's free memory; the machine's available memory for the CPU and MPS)."""
    if max_memory_gib:
        return int(max_memory_gib * (1 << 30))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(HEADROOM * (free + torch.cuda.memory_allocated(device)))
    return int(HEADROOM * available_memory())


def available_memory() -> int:
    """The machine's available memory (Linux's MemAvailable; else free pages)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        lines = Path("/proc/meminfo").read_text().splitlines()
        return int(next(x for x in lines if x.startswith("MemAvailable:")).split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def estimate(
    loaded: LoadedModel,
    algorithm: AlgorithmConfig,
    batch_size: int,
    *,
    checkpointing: bool = False,
    outer_on_host: bool = False,
    precision: torch.dtype | None = None,
) -> Estimate:
    """`batch_size` samples of the model at its sequence length, on fake tensors: nothing is run and
    nothing allocated on the device. `precision`: the autocast dtype the peer trains in (None: none),
    traced under the CPU's autocast with it (its casts are the GPU's for the layers that hold memory)."""
    module = loaded.module
    trainable: list[torch.Tensor] = [p for p in module.parameters() if p.requires_grad]
    parameters = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    state, step = algorithm_memory(algorithm, trainable, outer_on_host)
    saved, largest = saved_for_backward(loaded, batch_size, checkpointing, precision)
    transient = 2 * largest  # the loss's gradient through the logits, at the start of the backward pass
    if checkpointing:  # later, one block's activations recomputed at a time
        whole, _ = saved_for_backward(loaded, batch_size, False, precision)
        transient = max(transient, (whole - saved) // max(1, layers(module)))
    return Estimate(batch_size, checkpointing, parameters, state, saved + transient, step)


def saved_for_backward(
    loaded: LoadedModel, batch_size: int, checkpointing: bool, precision: torch.dtype | None = None
) -> tuple[int, int]:
    """(bytes, the largest tensor's) the autograd graph of one micro-batch keeps for the backward pass,
    parameters aside; traced on fake tensors, or, for a model whose forward pass fake tensors cannot run
    (one that reads values, a module:factory's own kernels), one real sample's, times the batch."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # torch's own, for shape propagation

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            return _trace(loaded, fake.from_tensor, batch_size, checkpointing, precision)
    except Exception:  # any failure of fake tensors: the real trace is the fallback
        saved, largest = _trace(loaded, lambda tensor: tensor, 1, checkpointing, precision)
        return saved * batch_size, largest * batch_size


def _trace(
    loaded: LoadedModel, make: Callable, batch_size: int, checkpointing: bool, precision: torch.dtype | None
) -> tuple[int, int]:
    module, vocab = loaded.module, loaded.vocab_size or 256
    cast = contextlib.nullcontext() if precision is None else torch.autocast("cpu", dtype=precision)
    saved: dict[int, int] = {}  # bytes by storage: a tensor saved by two operations counts once
    with _checkpointing(module, checkpointing):
        held = [make(p) for p in module.parameters()]  # held: their storages stay theirs
        own = {p.untyped_storage()._cdata for p in held}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage._cdata not in own:
                saved[storage._cdata] = max(saved.get(storage._cdata, 0), storage.nbytes())
            return tensor

        rows = make(torch.zeros(batch_size, loaded.seq_len + 1, dtype=torch.long))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), cast:
            loaded.loss_fn(module, rows[:, :-1], rows[:, 1:].clamp(max=vocab - 1))
    return sum(saved.values()), max(saved.values(), default=0)


def dtype_of(autocast: Callable) -> torch.dtype | None:
    """The dtype of an autocast factory (shoal.peer.train.hardware.autocast_for's), None for none."""
    keywords = getattr(autocast, "keywords", None) or {}
    return keywords.get("dtype") if getattr(autocast, "func", None) is torch.autocast else None


def layers(module: nn.Module) -> int:
    """The blocks activation checkpointing recomputes one at a time."""
    if isinstance(module, TinyGPT):
        return len(module.blocks)
    config = getattr(module, "config", None)
    return int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0) or 1)


def measure(
    loaded: LoadedModel,
    algorithm: AlgorithmConfig,
    device: torch.device,
    batch_size: int,
    *,
    checkpointing: bool = False,
    outer_on_host: bool = False,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    guess: Estimate | None = None,
) -> Trial:
    """A dry run of `batch_size` on `device` (module docstring); the model is where it was after it.
    `outer_on_host`: DiLoCo's outer state in host memory (`--outer-state cpu`); `guess`: its estimate,
    if the caller made it already."""
    module, vocab = loaded.module, loaded.vocab_size or 256
    home = next(module.parameters()).device
    kept = {name: t.detach().to("cpu", copy=True) for name, t in module.state_dict().items()}
    inner = algorithm.inner_steps
    dry = algorithm
    if isinstance(dry, DiLoCoConfig):  # butterfly's pieces need other peers
        dry = dataclasses.replace(dry, inner_steps=min(inner, DRY_INNER_STEPS), averaging="gather")

    def batches(step, micro, size, plan):
        rows = torch.randint(0, vocab, (size, loaded.seq_len + 1), device=device)
        return rows[:, :-1], rows[:, 1:]

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _checkpointing(module, checkpointing):
        module.to(device)
        trainer = None
        tracker: contextlib.nullcontext[None] | LiveTensors
        peak: float
        try:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                tracker = contextlib.nullcontext()
            else:
                tracker = LiveTensors(device, [*module.parameters(), *module.buffers()])
            with tracker:
                exchange = LoopbackExchange.group(1)[0]
                trainer = Trainer(
                    module,
                    exchange,
                    algorithm=dry,
                    batches=batches,
                    codec=codec_for(dry) if isinstance(dry, DiLoCoConfig) else None,
                    loss_fn=loaded.loss_fn,
                    batch_size=batch_size,
                    max_micro_batches=1,
                    autocast=autocast,
                    outer_device="cpu" if outer_on_host else None,
                )
                for _ in range(2):  # the first allocates the algorithm's state, the second is as all others
                    trainer.round()
            peak = (
                torch.cuda.max_memory_allocated(device)
                if device.type == "cuda"
                else cast(LiveTensors, tracker).peak  # not on CUDA: the LiveTensors
            )
            timed = trainer.round()
            if trainer.batch_size != batch_size:  # it ran out of memory and halved
                peak = math.inf
            round_s = timed.phases["compute"] / dry.inner_steps * inner
        finally:
            if trainer is not None:
                trainer.close()
            del trainer
            module.load_state_dict(kept)
            module.to(home)
            for p in module.parameters():
                p.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if guess is None:
        setup = {"checkpointing": checkpointing, "outer_on_host": outer_on_host}
        guess = estimate(loaded, algorithm, batch_size, **setup, precision=dtype_of(autocast))
    return Trial(guess, peak, round_s, outer_on_host, exchange.sent_bytes)


class LiveTensors(TorchDispatchMode):
    """The bytes of the tensor storages alive on one device, and their peak, while the mode is on: every
    storage an operation returns is counted until it is freed (a weak reference to it). Operations of
    other threads are not seen (an overlapped exchange's thread)."""

    def __init__(self, device: torch.device, existing: list[torch.Tensor]):
        super().__init__()
        self.device, self.bytes, self.peak = device, 0, 0
        self._sizes: dict[int, tuple[weakref.ref, int]] = {}
        for tensor in existing:
            self._count(tensor)

    def _count(self, tensor: object) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device != self.device:
            return
        storage = tensor.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        known = self._sizes.get(key)
        if known is not None and known[0]() is storage:
            self.bytes += size - known[1]  # resized in place (resize_, out= variants)
        else:
            self.bytes += size
        self._sizes[key] = (weakref.ref(storage, functools.partial(self._freed, key)), size)
        self.peak = max(self.peak, self.bytes)

    def _freed(self, key: int, ref: weakref.ref) -> None:
        known = self._sizes.get(key)
        if known is not None and known[0] is ref:
            self.bytes -= known[1]
            del self._sizes[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(result):
            self._count(tensor)
        return result


def fit(
    loaded: LoadedModel,
    algorithm: AlgorithmConfig,
    *,
    device: torch.device,
    batch_size: int,
    window_s: float | None,
    checkpointing: bool = False,
    outer_on_host: bool = False,
    max_memory_gib: float = 0.0,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    name: str = "the model",
) -> Fit:
    """The largest micro-batch that fits in memory and, if one does, in time (module docstring), then
    with activation checkpointing, then (DiLoCo on a GPU) with the outer state in host memory;
    FitError if none fits in memory. One that fits in memory only is `late`."""
    budget = memory_budget(device, max_memory_gib)
    recompute = [checkpointing] if checkpointing or recomputing(loaded.module) is None else [False, True]
    options = [(on, outer_on_host) for on in recompute]
    if (
        isinstance(algorithm, DiLoCoConfig) and device.type == "cuda" and not outer_on_host
    ):  # then on the host
        options.append((recompute[-1], True))
    sizes = [batch_size >> shift for shift in range(batch_size.bit_length())]
    trials: list[Trial] = []
    for recomputed, on_host in options:
        for size in sizes:
            setup = {"checkpointing": recomputed, "outer_on_host": on_host}
            guess = estimate(loaded, algorithm, size, **setup, precision=dtype_of(autocast))
            if guess.total > budget:
                continue
            trial = measure(loaded, algorithm, device, size, **setup, autocast=autocast, guess=guess)
            trials.append(trial)
            if trial.measured > budget:
                continue
            if window_s is not None and trial.round_s > window_s and size > 1:
                continue  # a smaller micro-batch computes a round sooner
            return Fit(size, recomputed, budget, window_s, tuple(trials), name, algorithm)
    raise FitError(too_large(name, algorithm, budget, trials, estimate(loaded, algorithm, 1)))


def too_slow(name: str, algorithm: AlgorithmConfig, trial: Trial, window_s: float) -> str:
    asks = (
        f"its {algorithm.inner_steps} inner steps of one sample each"
        if isinstance(algorithm, DiLoCoConfig)
        else "one micro-batch of one sample"
    )
    return (
        f"{name} with {algorithm.name} is too slow on this device for the run: a round asks {asks}, "
        f"{trial.round_s:.2f} s here, and the compute window is {window_s:g} s (--round-seconds x "
        "--compute-fraction): its payloads will miss their rounds, and the others go on without them. "
        "Use a faster --device or a smaller --seq-len, or join a run with longer rounds (or fewer inner "
        "steps)"
    )


def too_large(
    name: str, algorithm: AlgorithmConfig, budget: int, trials: list[Trial], least: Estimate
) -> str:
    measured = f", measured {mib(trials[-1].measured)} MiB" if trials else ""
    return (
        f"{name} with {algorithm.name} does not fit in {mib(budget)} MiB on this device: one sample "
        f"needs {mib(least.total)} MiB by estimate{measured} ({parts(least)}). Choose a smaller "
        "--model or --seq-len, a device with more memory, or --activation-checkpointing on; --max-memory "
        "sets the budget"
    )


def mib(size: float) -> str:
    """Bytes in MiB, with a decimal below 10."""
    return f"{size / MIB:,.1f}" if size < 10 * MIB else f"{size / MIB:,.0f}"


def parts(estimate: Estimate) -> str:
    return (
        f"parameters {mib(estimate.parameters)} MiB, algorithm state {mib(estimate.state)}, "
        f"activations {mib(estimate.activations)}; at the optimizer step {mib(estimate.step)}"
    )


@contextlib.contextmanager
def _checkpointing(module: nn.Module, on: bool):
    """Activation checkpointing switched `on` for the block (if it was off), as it was after."""
    switch = on and not recomputing(module)
    if switch:
        recompute(module, True)
    try:
        yield
    finally:
        if switch:
            recompute(module, False)
