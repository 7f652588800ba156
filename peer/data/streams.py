"""Token streams and deterministic, disjoint per-worker batches.

- `TokenStreams`: a training and a validation stream (`Tokens`, shoal.peer.data.tokens), with the
  vocabulary they need and, for a prepared corpus, the digest a run pins (shoal.peer.data.sources).
- `stdlib_corpus()`: the default, no download: the Python standard library's own `.py` files, read
  from the running interpreter's install, as bytes, joined by newlines, at most its first 16 MiB (the
  embedded demo corpus; any other source is read whole). Files go to validation by a hash of their
  relative path (1 in 20), so the split does not depend on file order or size.

Batches: the training stream is cut into non-overlapping windows of `seq_len + 1` tokens; an epoch
is a permutation of the windows drawn from (seed, epoch). Step `s` gives worker `w` of `W` the
windows at positions `(s * W + w) * B ... + B` of that order, so within a step no two workers train
on the same window, and every worker can compute any other's batch.
"""

import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from shoal.peer.data.order import permuted
from shoal.peer.data.tokens import Tokens

VALIDATION_SHARE = 20  # one file in VALIDATION_SHARE goes to validation


@dataclass(frozen=True, slots=True)
class TokenStreams:
    """A training and a validation token stream of ids < vocab_size."""

    train: Tokens
    validation: Tokens
    vocab_size: int
    name: str
    digest: str | None = None
    """What a run pins of its data: a prepared corpus's manifest digest (None: the standard library)."""
    tokenizer: str = "bytes"
    """The tokenizer that made the ids (its name and digest: shoal.peer.data.tokenizer)."""


def _split_files(files: list[Path], root: Path, max_bytes: int | None) -> TokenStreams:
    train: list[bytes]
    validation: list[bytes]
    train, validation, total = [], [], 0
    for path in sorted(files):
        data = path.read_bytes()
        relative = path.relative_to(root).as_posix().encode()
        is_validation = int(hashlib.sha256(relative).hexdigest(), 16) % VALIDATION_SHARE == 0
        (validation if is_validation else train).append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    if not train:
        raise ValueError(f"--data {root}: no training data (no file, or every file went to validation)")
    if not validation:  # few files: hold out the tail of the bytes instead
        joined = b"\n".join(train)
        cut = len(joined) - max(len(joined) // VALIDATION_SHARE, 1)
        return TokenStreams(_bytes_to_ids(joined[:cut]), _bytes_to_ids(joined[cut:]), 256, str(root))
    return TokenStreams(
        _bytes_to_ids(b"\n".join(train)), _bytes_to_ids(b"\n".join(validation)), 256, str(root)
    )


def _bytes_to_ids(data: bytes) -> Tokens:
    return Tokens([np.frombuffer(data, dtype=np.uint8)])


STDLIB_EXCLUDED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})


def stdlib_files() -> list[Path]:
    """The standard library's `.py` sources, test suites and site-packages excluded."""
    root, found = Path(sysconfig.get_paths()["stdlib"]), []
    # the excluded folders are never walked: site-packages alone (torch's tree among them) takes seconds
    for folder, folders, files in os.walk(root):
        folders[:] = [name for name in folders if name not in STDLIB_EXCLUDED]
        found += [Path(folder, name) for name in files if name.endswith(".py")]
    return sorted(found)


def stdlib_corpus(max_bytes: int | None = 16 << 20) -> TokenStreams:
    """The standard library's sources, as bytes: at most `max_bytes` of them (see the module
    docstring)."""
    return _split_files(stdlib_files(), Path(sysconfig.get_paths()["stdlib"]), max_bytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchPlan:
    """Which windows each worker trains on at each step."""

    seq_len: int
    """Tokens per sample (inputs); windows hold seq_len + 1."""
    batch_size: int
    """Samples per worker per step."""
    workers: int
    """Workers drawing from the same stream."""
    seed: int = 0
    """Seed of the window order."""

    def batch(
        self, stream: Tokens | torch.Tensor, step: int, worker: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len), for `worker` at `step`."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} outside [0, {self.workers})")
        stream, window = Tokens.of(stream), self.seq_len + 1
        windows = stream.windows(window)
        per_step = self.batch_size * self.workers
        if windows < per_step:
            raise ValueError(f"{windows} windows of {window} tokens cannot feed {per_step} samples per step")
        steps_per_epoch = windows // per_step
        epoch, position = divmod(step, steps_per_epoch)
        order = _window_order(self.seed, epoch, windows)
        start = (position * self.workers + worker) * self.batch_size
        rows = stream.rows(order[start : start + self.batch_size], window)
        return rows[:, :-1], rows[:, 1:]


@lru_cache(maxsize=4)
def _window_order(seed: int, epoch: int, windows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
    return torch.randperm(windows, generator=generator)


def validation_batches(
    stream: Tokens | torch.Tensor, seq_len: int, batch_size: int, batches: int
) -> list[torch.Tensor]:
    """The first `batches` batches of consecutive validation windows: fixed, so losses compare."""
    stream, window = Tokens.of(stream), seq_len + 1
    windows = min(stream.windows(window), batches * batch_size)
    rows = stream.rows(np.arange(windows), window)
    return [rows[i : i + batch_size] for i in range(0, windows, batch_size)]


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    loss_fn,
    stream: Tokens | torch.Tensor,
    seq_len: int,
    windows: int = 64,
    batch_size: int = 8,
) -> float | None:
    """The mean of `loss_fn(model, inputs, targets)` over the first `windows` windows of `stream`
    (held-out tokens; rounded up to whole batches of `batch_size`), on the model's device, in eval
    mode: the same windows every time, so models compare, unlike a round's training loss (the noise
    of its own batches). None where the stream holds no window."""
    batches = validation_batches(stream, seq_len, batch_size, math.ceil(windows / batch_size))
    if not batches:
        return None
    device, training = next(model.parameters()).device, model.training
    model.eval()
    try:
        losses = [loss_fn(model, b[:, :-1].to(device), b[:, 1:].to(device)).float() * len(b) for b in batches]
        return (torch.stack(losses).sum() / sum(len(b) for b in batches)).item()
    finally:
        model.train(training)


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundSlices:
    """Which windows each peer of a swarm trains on in a round, when peers come and go.

    Round r draws a permutation of the stream's windows from (seed, r), computed position by position
    (shoal.peer.data.order: a corpus's windows are never listed). The peer in `slot` s of `slots`
    (its place among the round's peers: RoundPlan.slot of SwarmExchange.plan_round) takes, for its
    micro-batch m, the `stride` positions starting at `(m * slots + s) * stride` (wrapping around):
    within a round no two peers that agree on the peer list share a window, however many
    micro-batches each one fits, and with any micro-batch size up to `stride`.
    """

    seq_len: int
    stride: int
    """Positions reserved per micro-batch: the largest micro-batch size."""
    seed: int = 0

    def batch(
        self,
        stream: Tokens | torch.Tensor,
        *,
        round_number: int,
        slot: int,
        slots: int,
        micro: int,
        batch_size: int,
        seed: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `micro`-th micro-batch of the peer in `slot`; `seed` replaces the run's (a coordinator's
        round data seed)."""
        if not 0 <= slot < slots:
            raise ValueError(f"slot {slot} outside [0, {slots})")
        if not 1 <= batch_size <= self.stride:
            raise ValueError(f"batch size {batch_size} outside [1, {self.stride}]")
        stream, window = Tokens.of(stream), self.seq_len + 1
        windows = stream.windows(window)
        if windows < self.stride:
            raise ValueError(f"{windows} windows of {window} tokens cannot fill a batch of {self.stride}")
        start = (micro * slots + slot) * self.stride
        positions = (start + np.arange(batch_size)) % windows
        key = ((self.seed if seed is None else seed) * 1_000_003 + round_number) % (1 << 63)
        rows = stream.rows(permuted(positions, windows, key), window)
        return rows[:, :-1], rows[:, 1:]
