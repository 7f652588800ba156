"""`shoal bench converge --scale medium`: the methods compared at a scale that means something, each at
the best of the same sweep budget.

    shoal bench converge --scale medium               # the sweep (~2 h on 2 CPU cores), then the table
    shoal bench converge --scale medium --plots docs/ # and the PNG curves of each method at its best
    shoal bench converge --scale medium --report      # the table from the record alone, running nothing
    shoal bench converge --scale gpu                  # the GPU form: 27M parameters, bf16, <= 8 minutes

The medium scale (`MEDIUM`): a 5.8M-parameter GPT (6 blocks of width 256) on a byte-level BPE of 4,096
tokens trained here on the standard library's sources; the corpus goes through `shoal data prepare`'s
path (shoal.peer.data.prepare), so validation is on held-out documents (1 in 20, by the SHA-256 of
each). Four workers, 8 sequences of 128 tokens each per step, the same 250 steps (1.02M tokens) for
every method, each learning rate (DiLoCo's inner one) warmed up over 25 steps, then decayed along a
cosine to a tenth.

The sweep (`SWEEPS`) gives every method the same rule: three learning rates a factor of 2 apart; a
fourth beyond the edge if the best was at one (once); then one run of the method's own knob at the
best of them (DeMo: its momentum beta; DiLoCo: the inner learning rate halved, the outer learning
rate being the swept one, since H is fixed by what each comparison asks; AdamW has no knob of its
own). DiLoCo's inner AdamW starts from data-parallel AdamW's best learning rate, as the DiLoCo paper
does.

Every run is appended to a record (`--record`, JSON lines) as it ends: an interrupted sweep resumes
where it stopped, and the table and plots are made from the record.
"""

import contextlib
import hashlib
import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import torch

from shoal.peer.bench.converge import ConvergeConfig, MethodResult, run_method
from shoal.peer.data import TokenStreams
from shoal.peer.data.prepare import _held_out, prepare
from shoal.peer.data.shards import open_prepared
from shoal.peer.data.sources import default_cache
from shoal.peer.data.streams import stdlib_files
from shoal.peer.data.text import TextSource
from shoal.peer.data.tokenizer import HFTokenizer, train_bpe

VOCAB = 4096
MEDIUM = ConvergeConfig(
    model="small", n_layer=6, vocab_size=VOCAB, steps=250, batch_size=8, inner_steps=10, eval_every=50,
    eval_batches=16, warmup=25, cosine=True,
)  # fmt: skip
"""5.8M parameters; H = 10, the DiLoCo presets' (shoal.peer.algorithms.configs)."""
GPU = ConvergeConfig(
    model="base", vocab_size=VOCAB, steps=600, batch_size=16, inner_steps=10, eval_every=100, eval_batches=16,
    device="cuda", precision="bf16", warmup=60, cosine=True,
)  # fmt: skip
"""27M parameters (8 blocks of width 512, 256 tokens of context), bf16 autocast."""
SCALES = {"medium": MEDIUM, "gpu": GPU}


@dataclass(frozen=True, slots=True)
class Sweep:
    """A method's runs: `lrs` of its learning rate (`lr_field` of ConvergeConfig), then each of `knobs`
    at the best of them."""

    lr_field: str
    lrs: tuple[float, ...]
    knobs: tuple[dict, ...] = ()


def _diloco(outer: tuple[float, ...]) -> Sweep:
    return Sweep("outer_lr", outer, ({"adamw_lr": "half"},))


SWEEPS = {
    "adamw_dp": Sweep("adamw_lr", (5e-4, 1e-3, 2e-3)),
    "lion_dp": Sweep("adamw_lr", (1e-4, 2e-4, 4e-4)),  # the sign-descent reference for DeMo's gap
    "demo_reference": Sweep("demo_lr", (1e-3, 2e-3, 4e-3), ({"demo_decay": 0.995},)),
    "demo_compact": Sweep("demo_lr", (1e-3, 2e-3, 4e-3), ({"demo_decay": 0.995},)),
    "diloco_standard": _diloco((0.5, 0.7, 1.0)),
    "diloco_eager": _diloco((0.4, 0.7, 1.0)),
    "diloco_sparse": _diloco((1.0, 1.5, 2.0)),
}
"""The papers' settings are among the points: DeMo's beta 0.999 (reference) and 0.995 (its sweep's
best), DiLoCo's outer 0.7 with Nesterov 0.9, SparseLoCo's plain outer SGD (shoal's sparse preset: 1.5)."""
PARITY = (
    ("DeMo reference / AdamW-DP", "demo_reference", "adamw_dp", 1.00),
    ("DeMo compact / AdamW-DP", "demo_compact", "adamw_dp", 1.02),
    ("eager / standard DiLoCo", "diloco_eager", "diloco_standard", 1.01),
    ("sparse / float32 DiLoCo (H=10)", "diloco_sparse", "diloco_standard", 1.02),
)


@dataclass(slots=True)
class Run:
    """One run of the sweep, as the record keeps it."""

    key: str
    method: str
    settings: dict
    final_val_loss: float
    bytes_sent_per_worker: int
    wall_s: float
    curve: list = field(default_factory=list)


def medium_corpus(cache: Path | None = None) -> TokenStreams:
    """The standard library's sources, tokenized by a BPE of `VOCAB` trained on their training
    documents, prepared once into `cache` (shoal's data cache by default)."""
    root = (cache or default_cache()) / f"bench-stdlib-{sys.version_info.major}.{sys.version_info.minor}"
    source = TextSource("stdlib", tuple(stdlib_files()), "plain")
    folder = root / f"bpe{VOCAB}"
    if not (folder / "tokenizer.json").is_file():
        train_bpe(folder, (d for d in source.documents() if not _held_out(d)), VOCAB)
    prepare(source, root / "corpus", HFTokenizer(folder))
    streams = open_prepared(root / "corpus")
    assert streams.vocab_size <= VOCAB, streams.vocab_size
    return streams


LATER_FIELDS = ("demo_topk", "demo_error_feedback")
"""ConvergeConfig fields added after the record began: left out of a run's key at their default (None),
so that the runs recorded before them keep their keys."""


def run_key(method: str, config: ConvergeConfig, corpus: str | None) -> str:
    """What a run's result depends on: a record made with other settings or data is not reused."""
    fields = {k: v for k, v in asdict(config).items() if not (k in LATER_FIELDS and v is None)}
    text = json.dumps([method, fields, corpus, torch.__version__], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_record(path: Path) -> dict[str, Run]:
    runs = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                run = Run(**json.loads(line))
                runs[run.key] = run
    return runs


def _settings(config: ConvergeConfig, base: ConvergeConfig, method: str) -> dict:
    shown = {SWEEPS[method].lr_field} | ({"adamw_lr"} if method.startswith("diloco") else set())  # inner
    return {k: v for k, v in asdict(config).items() if v != getattr(base, k) or k in shown}


class NotRecorded(Exception):
    """`sweep(..., run=False)` needs a run the record does not hold."""


def sweep(
    methods: tuple[str, ...],
    base: ConvergeConfig,
    streams: TokenStreams,
    record: Path,
    full: bool = True,
    run: bool = True,
) -> dict[str, list[Run]]:
    """Each method's runs (`SWEEPS`; only its first point when not `full`), read from `record` where it
    holds them, else run and appended to it; with `run` False, only what the record holds (a method's
    sweep up to its first run missing)."""
    done = load_record(record)

    def point(method: str, config: ConvergeConfig) -> Run:
        """The run of `method` with `config`: the record's, else run now and recorded."""
        key = run_key(method, config, streams.digest)
        if key not in done:
            if not run:
                raise NotRecorded(key)
            done[key] = _record(record, key, method, config, base, streams)
        return done[key]

    runs: dict[str, list[Run]] = {}
    for method in methods:
        found: list[Run] = []
        with contextlib.suppress(NotRecorded):  # report only: the sweep as far as the record goes
            _sweep_method(method, base, full, runs, found, point)
        if found:
            runs[method] = found
    return runs


def _sweep_method(
    method: str,
    base: ConvergeConfig,
    full: bool,
    runs: dict[str, list[Run]],
    found: list[Run],
    point: Callable[[str, ConvergeConfig], Run],
) -> None:
    """Appends to `found` the method's runs, one by one (see `sweep`)."""
    plan = SWEEPS[method]
    start = base
    if method.startswith("diloco") and "adamw_dp" in runs:  # the inner AdamW: AdamW-DP's best lr
        start = replace(start, adamw_lr=_best(runs["adamw_dp"]).settings.get("adamw_lr", base.adamw_lr))
    for lr in plan.lrs if full else plan.lrs[:1]:
        # `lr_field` names one of ConvergeConfig's float fields
        found.append(point(method, replace(start, **cast("dict[str, Any]", {plan.lr_field: lr}))))
    best = _best(found).settings[plan.lr_field]
    if full and best in (min(plan.lrs), max(plan.lrs)):  # the best at an edge: one step beyond it
        beyond = best / 2 if best == min(plan.lrs) else best * 2
        found.append(point(method, replace(start, **{plan.lr_field: beyond})))
    for knob in plan.knobs if full else ():
        best = replace(start, **_best(found).settings)
        change = {k: (getattr(best, k) / 2 if v == "half" else v) for k, v in knob.items()}
        found.append(point(method, replace(best, **change)))


def _record(
    record: Path, key: str, method: str, config: ConvergeConfig, base: ConvergeConfig, streams: TokenStreams
) -> Run:
    """Runs `method` with `config` and appends the run to `record`."""
    result: MethodResult = run_method(method, config, streams)
    run = Run(
        key, method, _settings(config, base, method), result.final_val_loss, result.bytes_sent_per_worker,
        result.wall_s, result.curve,
    )  # fmt: skip
    with open(record, "a") as file:
        file.write(json.dumps(asdict(run)) + "\n")
    print(f"{method:<16} {_describe(run.settings):<40} val loss {run.final_val_loss:.4f}  "
          f"{run.wall_s:6.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    return run


def _best(runs: list[Run]) -> Run:
    return min(runs, key=lambda run: run.final_val_loss)


def _describe(settings: dict) -> str:
    shown = {k: v for k, v in settings.items() if k not in ("vocab_size",)}
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(shown.items()))


def report(runs: dict[str, list[Run]], config: ConvergeConfig, streams: TokenStreams) -> dict:
    """The sweep table, each method at its best, and the parity ratios against their targets."""
    best = {method: _best(found) for method, found in runs.items()}
    parity = [
        {"comparison": name, "ratio": best[a].final_val_loss / best[b].final_val_loss, "target": target}
        for name, a, b, target in PARITY
        if a in best and b in best
    ]
    params = sum(p.numel() for p in _model(config).parameters())
    return {
        "setting": {
            "parameters": params,
            "vocab_size": streams.vocab_size,
            "train_tokens": len(streams.train),
            "validation_tokens": len(streams.validation),
            "tokens_per_method": config.steps * config.tokens_per_step,
            "workers": config.workers,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        },
        "sweep": [asdict(run) | {"curve": None} for found in runs.values() for run in found],
        "best": {method: asdict(run) for method, run in best.items()},
        "parity": parity,
    }


def _model(config: ConvergeConfig) -> torch.nn.Module:
    from shoal.peer.models.gpt import TinyGPT

    with torch.device("meta"):
        return TinyGPT(config.gpt)


def print_table(result: dict) -> None:
    setting = result["setting"]
    print(
        f"{setting['parameters'] / 1e6:.2f}M parameters, BPE {setting['vocab_size']}, "
        f"{setting['tokens_per_method']:,} tokens per method, {setting['workers']} workers; "
        f"{setting['train_tokens']:,} training and {setting['validation_tokens']:,} held-out tokens"
    )
    for run in result["sweep"]:
        star = "*" if result["best"][run["method"]]["key"] == run["key"] else " "
        print(
            f"{star} {run['method']:<16} {_describe(run['settings']):<44} val loss "
            f"{run['final_val_loss']:.4f}  sent/worker {run['bytes_sent_per_worker']:>13,d} B"
        )
    for row in result["parity"]:
        verdict = "met" if row["ratio"] <= row["target"] else "missed"
        print(f"{row['comparison']:<34} {row['ratio']:.4f}x (target <= {row['target']:.2f}x: {verdict})")


def plot(result: dict, folder: Path, name: str) -> list[Path]:
    """Validation loss against tokens and against bytes sent, one line per method at its best."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plots needs matplotlib: pip install 'shoal[bench]'") from None
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for axis, column, label, log in (
        ("tokens", 0, "tokens trained (all workers)", False),
        ("bytes", 1, "bytes sent per worker", True),
    ):
        figure, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
        for method, run in result["best"].items():
            points = [p for p in run["curve"] if not log or p[1] > 0]
            ax.plot([p[column] for p in points], [p[2] for p in points], marker="o", ms=3, label=method)
        ax.set_xlabel(label)
        ax.set_ylabel("validation loss (held-out documents)")
        if log:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
        figure.tight_layout()
        path = folder / f"converge-{name}-{axis}.png"
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written


def main(
    *,
    scale: str,
    as_json: bool,
    methods: tuple[str, ...],
    record: Path | None,
    plots: Path | None,
    report_only: bool = False,
    **overrides,
) -> int:
    """`overrides`: ConvergeConfig fields (steps, workers, device...). The GPU form runs each method's
    first sweep point only: one run each, to stay within 8 minutes."""
    config = replace(SCALES[scale], **overrides)
    if config.device.startswith("cuda") and not torch.cuda.is_available() and not report_only:
        print("shoal bench converge: error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.workers))
    streams = medium_corpus()
    record = record or Path(f"converge-{scale}.jsonl")
    runs = sweep(methods, config, streams, record, full=scale != "gpu", run=not report_only)
    result = report(runs, config, streams)
    if plots is not None:
        result["plots"] = [str(p) for p in plot(result, plots, scale)]
    if as_json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0
