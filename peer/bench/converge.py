"""`shoal bench converge`: DeMo, DiLoCo and data-parallel AdamW on one model, one data set, one budget.

    shoal bench converge --quick          # a table, within 3 minutes on 2 CPU cores
    shoal bench converge --json           # {"results": [{"method", "final_val_loss", ...}]}
    shoal bench converge --quick --methods demo_compact,demo_compact_overlap,demo_compact_lookahead

Four simulated workers (threads, LoopbackExchange) train the embedded byte-level GPT on the standard
library corpus for the same number of optimizer steps each, with disjoint batches per worker and step.
The workers stand for swarm peers (an untrusted loopback): DeMo and DiLoCo screen every round with the
swarm's defaults (shoal.peer.algorithms.robust), except where a method says otherwise.

- adamw_dp: data-parallel AdamW, the float32 gradient averaged every step (what DDP sends);
- demo_reference: DeMo with the paper's reference settings (k=32, 32-bit values, beta 0.999, alpha 1);
- demo_reference_unscreened: the same without screening (`robust.NONE`): the reference semantics, what
  DeMo does by default over torch.distributed;
- demo_compact: DeMo with k=4, 1-bit values, beta 0.99, alpha 1 (the best of the alpha/beta we tried);
- diloco_standard / diloco_delayed / diloco_eager: AdamW inner steps, an outer Nesterov step every
  `inner_steps`, exact float32 pseudo-gradients; `finish()` applies the last round still in flight.
  The outer learning rate and momentum are each mode's best on the quick setting (`OUTER`).

On request (`--methods`): demo_compact_overlap and demo_compact_lookahead, demo_compact exchanged in
the background and applied a step late, without and with Psyche's lookahead (shoal.peer.algorithms.demo).

Reported per method: validation loss of worker 0's final parameters on fixed validation batches,
payload bytes each worker sent, and wall time.
"""

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TypedDict, Unpack, cast

import torch

from shoal.compression import Codec, DCTTopKCodec, DenseCodec, TopKCodec
from shoal.peer.algorithms.configs import SPARSE_ERROR_DECAY, SPARSE_OUTER
from shoal.peer.algorithms.demo import DeMo
from shoal.peer.algorithms.diloco import DiLoCo
from shoal.peer.algorithms.exchange import Delegating, Exchange, Plan, run_loopback
from shoal.peer.algorithms.robust import NONE
from shoal.peer.algorithms.schedule import Schedule
from shoal.peer.data import BatchPlan, TokenStreams, stdlib_corpus
from shoal.peer.data import validation_loss as held_out_loss
from shoal.peer.models.gpt import GPTConfig, TinyGPT

METHODS = (
    "adamw_dp",
    "demo_reference",
    "demo_reference_unscreened",
    "demo_compact",
    "diloco_standard",
    "diloco_delayed",
    "diloco_eager",
)
EXTRA_METHODS = ("demo_compact_overlap", "demo_compact_lookahead")
OUTER = {"standard": (0.4, 0.5), "delayed": (0.4, 0.0), "eager": (0.4, 0.0)}
"""DiLoCo's outer (learning rate, Nesterov momentum) per mode: the best of a sweep on the quick setting
(BENCHMARKS.md). The late modes want no momentum: it carries the stale part of each update forward.
At DiLoCo's 0.7 and 0.9, delayed and eager diverge on this short run."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConvergeConfig:
    """One benchmark setting."""

    model: str
    """GPTConfig preset."""
    vocab_size: int = 256
    """The model's vocabulary: 256 for bytes, the tokenizer's for the medium scale (scale.py)."""
    n_layer: int = 0
    """Transformer blocks; 0: the preset's."""
    steps: int
    """Optimizer steps per worker (inner steps for DiLoCo): the same token budget for every method."""
    batch_size: int
    """Sequences per worker per step."""
    workers: int = 4
    inner_steps: int = 25
    """DiLoCo's H."""
    outer_lr: float | None = None
    """DiLoCo's outer learning rate; None: the mode's in `OUTER`."""
    outer_momentum: float | None = None
    """DiLoCo's outer Nesterov momentum (0 turns it off); None: the mode's in `OUTER`."""
    adamw_lr: float = 4e-3
    """AdamW learning rate, also DiLoCo's inner one."""
    demo_lr: float = 2e-3
    """DeMo's sign-step learning rate."""
    demo_decay: float | None = None
    """DeMo's momentum beta (compression_decay); None: the method's (0.999 reference, 0.99 compact)."""
    demo_topk: int | None = None
    """DeMo's coefficients sent per chunk (compression_topk); None: the method's (32 reference, 4 compact)."""
    demo_error_feedback: float | None = None
    """DeMo's error feedback alpha, the share of the sent part taken out of the momentum; None: the
    method's (1.0)."""
    error_decay: float = SPARSE_ERROR_DECAY
    """DiLoCo's error feedback beta with a lossy codec (SparseLoCo's 0.95 did worse here: BENCHMARKS.md)."""
    eval_batches: int = 8
    seed: int = 0
    gather: int = 0
    """At most this many workers' payloads count in a round (shoal.protocol.rules); 0: all."""
    carry: bool = False
    """Whether a worker left out of a round also sends its work again with its next contribution (the
    optimizers' `carry`)."""
    warmup: int = 0
    """Steps of linear warmup of every method's learning rate (DiLoCo's inner one)."""
    cosine: bool = False
    """After the warmup, a cosine decay to a tenth of the rate by the last step; else constant."""
    eval_every: int = 0
    """Worker 0's validation loss every this many steps (a multiple of `inner_steps`, so that DiLoCo is
    measured just after an outer step), for the curves; 0: only at the end."""
    device: str = "cpu"
    precision: str = "fp32"
    """fp32, or bf16: the forward and backward pass under bf16 autocast (the GPU form)."""

    @property
    def gpt(self) -> GPTConfig:
        layers = {"n_layer": self.n_layer} if self.n_layer else {}
        return GPTConfig.preset(self.model, vocab_size=self.vocab_size, **layers)

    @property
    def tokens_per_step(self) -> int:
        """Tokens trained by all workers in one step."""
        return self.workers * self.batch_size * self.gpt.seq_len


QUICK = ConvergeConfig(model="tiny", steps=300, batch_size=16, inner_steps=25)
FULL = ConvergeConfig(model="tiny", steps=1500, batch_size=16, inner_steps=50, eval_batches=16)


class ConvergeOverrides(TypedDict, total=False):
    """The ConvergeConfig fields `shoal bench converge` sets from its flags (`main`)."""

    inner_steps: int
    outer_lr: float | None
    outer_momentum: float | None
    error_decay: float
    demo_error_feedback: float | None
    workers: int
    gather: int
    carry: bool


@dataclass(slots=True)
class MethodResult:
    method: str
    final_val_loss: float
    bytes_sent_per_worker: int
    wall_s: float
    curve: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
    """(tokens trained by all workers, bytes worker 0 sent, validation loss) every `eval_every` steps
    and at the end; empty without `eval_every`."""


@dataclass(slots=True)
class _WorkerOutcome:
    model: TinyGPT
    bytes_sent: int


def _adamw(model: TinyGPT, config: ConvergeConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=config.adamw_lr, betas=(0.9, 0.95), weight_decay=0.1)


def _loss(model: TinyGPT, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    device = inputs.device.type
    with torch.autocast(device, dtype=torch.bfloat16, enabled=getattr(model, "bf16", False)):
        return model(inputs, targets=targets)


class _Counted(Delegating):
    """An exchange that counts the bytes its worker sends (payloads gathered; tensors averaged, as
    float32), so that a curve can be drawn against bytes."""

    def __init__(self, inner: Exchange):
        super().__init__(inner)
        self.sent = 0

    def gather(self, payload: bytes, samples: int, state=None, plan: Plan | None = None):
        self.sent += len(payload)
        return super().gather(payload, samples, state, plan)

    def mean(self, tensor: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
        self.sent += tensor.numel() * 4
        return super().mean(tensor, weight)


def _scheduled(optimizer: torch.optim.Optimizer, config: ConvergeConfig, batches):
    """The batches, the optimizer's learning rate set for each one's step (`warmup`, `cosine`)."""
    if not config.warmup and not config.cosine:
        yield from batches
        return
    bases = [group["lr"] for group in optimizer.param_groups]
    kind, decay = ("cosine", config.steps - config.warmup) if config.cosine else ("constant", 0)
    for step, batch in enumerate(batches):
        for group, base in zip(optimizer.param_groups, bases, strict=True):
            group["lr"] = Schedule(kind=kind, warmup=config.warmup, decay=decay, min_lr=base / 10).lr(
                base, step
            )
        yield batch


class _Lion(torch.optim.Optimizer):
    """Lion (Chen et al., arXiv 2302.06675): the sign of an interpolation of momentum and gradient,
    decoupled weight decay. The sign-descent reference DeMo's update belongs to (`lion_dp`)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.99), weight_decay: float = 1.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]  # no closure: only stepped plainly here
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(momentum.lerp(p.grad, 1 - beta1).sign_(), alpha=-group["lr"])
                momentum.lerp_(p.grad, 1 - beta2)


def _train_dp(model, exchange, batches, optimizer: torch.optim.Optimizer, config) -> int:
    """Data-parallel training: the float32 gradient averaged every step, then `optimizer` steps."""
    batches = _scheduled(optimizer, config, batches)
    params = [p for p in model.parameters() if p.requires_grad]
    sent = 0
    for inputs, targets in batches:
        _loss(model, inputs, targets).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        averaged = exchange.mean(flat)
        sent += flat.numel() * 4
        offset = 0
        for p in params:
            p.grad.copy_(averaged[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return sent


def _train_adamw_dp(model, exchange, batches, config) -> int:
    return _train_dp(model, exchange, batches, _adamw(model, config), config)


def _train_lion_dp(model, exchange, batches, config) -> int:
    """Lion at `adamw_lr` (its learning rate; Lion's paper: 3-10x below AdamW's, with 3-10x its weight
    decay: 1.0 against AdamW's 0.1 here)."""
    return _train_dp(model, exchange, batches, _Lion(model.parameters(), lr=config.adamw_lr), config)


def _train_demo(model, exchange, batches, config, **settings) -> int:
    settings |= {"weight_decay": 0.1, "carry": config.carry}
    if config.demo_decay is not None:
        settings["compression_decay"] = config.demo_decay
    if config.demo_topk is not None:
        settings["compression_topk"] = config.demo_topk
    if config.demo_error_feedback is not None:
        settings["error_feedback"] = config.demo_error_feedback
    optimizer = DeMo(model.parameters(), lr=config.demo_lr, exchange=exchange, **settings)
    batches = _scheduled(optimizer, config, batches)
    for inputs, targets in batches:
        _loss(model, inputs, targets).backward()
        optimizer.step(samples=inputs.shape[0])
        optimizer.zero_grad(set_to_none=True)
    optimizer.finish()  # overlap: the last round, still in flight
    optimizer.close()
    return optimizer.stats.bytes_sent


def _train_diloco(model, exchange, batches, config, *, mode: str, codec: Codec | None = None) -> int:
    sparse = isinstance(codec, DCTTopKCodec)  # and TopKCodec: what `--compression sparse` runs with
    outer_lr, outer_momentum = SPARSE_OUTER if sparse else OUTER[mode]
    inner = _adamw(model, config)
    batches = _scheduled(inner, config, batches)
    with DiLoCo(
        model,
        inner,
        exchange=exchange,
        inner_steps=config.inner_steps,
        mode=mode,
        outer_lr=outer_lr if config.outer_lr is None else config.outer_lr,
        outer_momentum=outer_momentum if config.outer_momentum is None else config.outer_momentum,
        codec=codec,
        error_decay=config.error_decay,
        carry=config.carry,
    ) as diloco:
        for inputs, targets in batches:
            _loss(model, inputs, targets).backward()
            diloco.step(samples=inputs.shape[0])
        diloco.finish()
    return diloco.stats.bytes_sent


TRAINERS: dict[str, Callable[..., int]] = {
    "adamw_dp": _train_adamw_dp,
    "lion_dp": _train_lion_dp,
    "demo_reference": lambda *a: _train_demo(*a),
    "demo_reference_unscreened": lambda *a: _train_demo(*a, robust=NONE),
    "demo_compact": lambda *a: _train_demo(
        *a, compression_topk=4, value_bits=1, compression_decay=0.99, error_feedback=1.0
    ),
    "demo_compact_overlap": lambda *a: _train_demo(
        *a, compression_topk=4, value_bits=1, compression_decay=0.99, error_feedback=1.0, overlap=True
    ),
    "demo_compact_lookahead": lambda *a: _train_demo(
        *a,
        compression_topk=4,
        value_bits=1,
        compression_decay=0.99,
        error_feedback=1.0,
        overlap=True,
        lookahead=True,
    ),
    "diloco_standard": lambda *a: _train_diloco(*a, mode="standard"),
    "diloco_delayed": lambda *a: _train_diloco(*a, mode="delayed"),
    "diloco_eager": lambda *a: _train_diloco(*a, mode="eager"),
    "diloco_int8": lambda *a: _train_diloco(*a, mode="standard", codec=DenseCodec(8)),
    "diloco_sparse": lambda *a: _train_diloco(*a, mode="standard", codec=TopKCodec(topk=64, value_bits=2)),
    "diloco_sparse_eager": lambda *a: _train_diloco(*a, mode="eager", codec=TopKCodec(topk=64, value_bits=2)),
    "diloco_sparse_dct": lambda *a: _train_diloco(
        *a, mode="standard", codec=DCTTopKCodec(topk=64, value_bits=2, elias_fano=True)
    ),
    **{
        # a codec per worker: codecs keep scratch buffers and are not thread-safe
        f"diloco_sparse_k{k}_{bits}bit": lambda *a, k=k, bits=bits: _train_diloco(
            *a, mode="standard", codec=TopKCodec(topk=k, value_bits=bits)
        )
        for k in (32, 64, 128)
        for bits in (1, 2, 4)
    },
}


def validation_loss(model: TinyGPT, streams: TokenStreams, config: ConvergeConfig) -> float:
    windows = config.eval_batches * config.batch_size
    # None only for a validation stream without a window: the benchmark's corpora hold many
    return cast(
        float,
        held_out_loss(model, _loss, streams.validation, config.gpt.seq_len, windows, config.batch_size),
    )


def run_method(method: str, config: ConvergeConfig, streams: TokenStreams) -> MethodResult:
    """Trains `config.workers` workers with `method` and evaluates worker 0."""
    if config.eval_every and config.eval_every % config.inner_steps:
        raise ValueError(f"eval_every ({config.eval_every}) must be a multiple of H ({config.inner_steps})")
    torch.manual_seed(config.seed)
    initial = TinyGPT(config.gpt).state_dict()
    plan = BatchPlan(
        seq_len=config.gpt.seq_len, batch_size=config.batch_size, workers=config.workers, seed=config.seed
    )
    device = torch.device(config.device)
    curve: list[tuple[int, int, float]] = []

    def batches(rank: int, model: TinyGPT, exchange: _Counted):
        for step in range(config.steps):
            if rank == 0 and config.eval_every and step and step % config.eval_every == 0:
                # asked for the next batch: step `step - 1` is done (and DiLoCo's outer step with it)
                curve.append(
                    (step * config.tokens_per_step, exchange.sent, validation_loss(model, streams, config))
                )
            inputs, targets = plan.batch(streams.train, step, rank)
            yield inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    def work(rank: int, exchange: Exchange) -> _WorkerOutcome:
        model = TinyGPT(config.gpt).to(device)
        model.load_state_dict(initial)
        # torch types nn.Module's attribute assignment as Tensor | Module only
        model.bf16 = config.precision == "bf16"  # type: ignore[assignment]
        counted = _Counted(exchange)
        return _WorkerOutcome(model, TRAINERS[method](model, counted, batches(rank, model, counted), config))

    start = time.perf_counter()
    # a medium-scale run takes minutes, and a paused machine longer: hours before a worker counts as hung
    outcomes = run_loopback(
        config.workers, work, gather_limit=config.gather, timeout=timedelta(hours=4), trusted=False
    )
    wall = time.perf_counter() - start
    loss = validation_loss(outcomes[0].model, streams, config)
    if not math.isfinite(loss):
        raise RuntimeError(f"{method}: validation loss is {loss}")
    if config.eval_every:
        curve.append((config.steps * config.tokens_per_step, outcomes[0].bytes_sent, loss))
    return MethodResult(method, loss, outcomes[0].bytes_sent, wall, curve)


def main(
    *, as_json: bool, quick: bool, methods: tuple[str, ...] = METHODS, **overrides: Unpack[ConvergeOverrides]
) -> int:
    """`overrides`: ConvergeConfig fields (inner_steps, outer_lr, outer_momentum, error_decay,
    demo_error_feedback, workers, gather, carry)."""
    config = dataclasses.replace(QUICK if quick else FULL, **overrides)
    streams = stdlib_corpus()
    results, width = [], max(16, *map(len, methods))
    for method in methods:
        result = run_method(method, config, streams)
        results.append(result)
        if not as_json:
            print(
                f"{result.method:<{width}} val loss {result.final_val_loss:.4f}  sent/worker "
                f"{result.bytes_sent_per_worker:>12,d} B  {result.wall_s:6.1f} s",
                flush=True,
            )
    if as_json:
        print(json.dumps({"results": [asdict(r) for r in results]}))
    return 0
