"""Training data: token streams and deterministic, disjoint per-worker batches.

Sources:
- `stdlib_corpus()`: the default, no download: the Python standard library's own `.py` files, read
  from the running interpreter's install, as bytes. Files go to validation by a hash of their
  relative path (1 in 20), so the split does not depend on file order or size.
- `text_directory(path)`: every file under a directory, as bytes.
- `token_file(path)`: pre-tokenized little-endian uint16 token ids (nanoGPT's `.bin` format).

Batches: the training stream is cut into non-overlapping windows of `seq_len + 1` tokens; an epoch
is a permutation of the windows drawn from (seed, epoch). Step `s` gives worker `w` of `W` the
windows at positions `(s * W + w) * B ... + B` of that order, so within a step no two workers train
on the same window, and every worker can compute any other's batch.
"""

import hashlib
import math
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

VALIDATION_SHARE = 20  # one file in VALIDATION_SHARE goes to validation


@dataclass(frozen=True, slots=True)
class TokenStreams:
    """A training and a validation token stream (int64 tensors of ids < vocab_size)."""

    train: torch.Tensor
    validation: torch.Tensor
    vocab_size: int
    name: str


def _split_files(files: list[Path], root: Path, max_bytes: int | None) -> TokenStreams:
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


def _bytes_to_ids(data: bytes) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))


def stdlib_corpus(max_bytes: int | None = 16 << 20) -> TokenStreams:
    """The standard library's `.py` sources (test suites and site-packages excluded), as bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages", "test", "tests", "idlelib"} & set(p.relative_to(root).parts)
    ]
    return _split_files(files, root, max_bytes)


def text_directory(path: str | Path, max_bytes: int | None = None) -> TokenStreams:
    """Every regular file under `path`, as bytes."""
    root = Path(path)
    if not root.is_dir():
        raise ValueError(f"--data {path}: not a directory")
    return _split_files([p for p in root.rglob("*") if p.is_file()], root, max_bytes)


def token_file(path: str | Path, validation_fraction: float = 0.05) -> TokenStreams:
    """uint16 token ids; the last `validation_fraction` of the file is validation."""
    tokens = np.fromfile(path, dtype="<u2")
    if tokens.size < 1000:
        raise ValueError(f"--data {path}: {tokens.size} tokens is too few to train on")
    cut = int(tokens.size * (1 - validation_fraction))
    ids = torch.from_numpy(tokens.astype(np.int64))
    return TokenStreams(ids[:cut], ids[cut:], int(tokens.max()) + 1, str(path))


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

    def batch(self, stream: torch.Tensor, step: int, worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch_size, seq_len), for `worker` at `step`."""
        if not 0 <= worker < self.workers:
            raise ValueError(f"worker {worker} outside [0, {self.workers})")
        window = self.seq_len + 1
        windows = stream.numel() // window
        per_step = self.batch_size * self.workers
        if windows < per_step:
            raise ValueError(f"{windows} windows of {window} tokens cannot feed {per_step} samples per step")
        steps_per_epoch = windows // per_step
        epoch, position = divmod(step, steps_per_epoch)
        order = _window_order(self.seed, epoch, windows)
        start = (position * self.workers + worker) * self.batch_size
        chosen = order[start : start + self.batch_size]
        rows = stream[: windows * window].view(windows, window)[chosen]
        return rows[:, :-1], rows[:, 1:]


@lru_cache(maxsize=4)
def _window_order(seed: int, epoch: int, windows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (1 << 63))
    return torch.randperm(windows, generator=generator)


def validation_batches(
    stream: torch.Tensor, seq_len: int, batch_size: int, batches: int
) -> list[torch.Tensor]:
    """The first `batches` batches of consecutive validation windows: fixed, so losses compare."""
    window = seq_len + 1
    windows = min(stream.numel() // window, batches * batch_size)
    rows = stream[: windows * window].view(windows, window)
    return [rows[i : i + batch_size] for i in range(0, windows, batch_size)]


@torch.no_grad()
def validation_loss(
    model: torch.nn.Module,
    loss_fn,
    stream: torch.Tensor,
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


def load_data(spec: str, max_bytes: int | None = 16 << 20) -> TokenStreams:
    """`stdlib`, a text directory, or a uint16 token file."""
    path = Path(spec)
    try:
        if spec == "stdlib":
            return stdlib_corpus(max_bytes)
        if path.is_dir():
            return text_directory(path, max_bytes)
        if path.is_file():
            return token_file(path)
    except OSError as error:  # a file that cannot be read: the setting's to fix, like a missing one
        raise ValueError(f"--data {spec}: cannot read {error.filename or spec}: {error.strerror}") from None
    raise ValueError(f"--data {spec}: neither 'stdlib', a directory of text, nor a uint16 token file")


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundSlices:
    """Which windows each peer of a swarm trains on in a round, when peers come and go.

    Round r draws a permutation of the stream's windows from (seed, r). The peer in `slot` s of `slots`
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
        stream: torch.Tensor,
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
        window = self.seq_len + 1
        windows = stream.numel() // window
        if windows < self.stride:
            raise ValueError(f"{windows} windows of {window} tokens cannot fill a batch of {self.stride}")
        order = _window_order(self.seed if seed is None else seed, round_number, windows)
        start = (micro * slots + slot) * self.stride
        chosen = order[(start + torch.arange(batch_size)) % windows]
        rows = stream[: windows * window].view(windows, window)[chosen]
        return rows[:, :-1], rows[:, 1:]
