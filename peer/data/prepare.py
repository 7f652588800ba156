"""`shoal data prepare`: a corpus tokenized once into shards (shoal.peer.data.shards), resumably.

Documents are read in order (shoal.peer.data.text), encoded a batch at a time (a fast tokenizer
spreads a batch over every core), each followed by the tokenizer's separator. A document goes to
validation when the SHA-256 of its text says so (1 in VALIDATION_SHARE), so the split depends on
neither order nor size. Training tokens are cut into shards of at least `shard_tokens` (whole
documents); each time a training shard is full, it and the validation tokens so far are written.

Nothing is left half-written that could pass for complete: each file is written whole and durably
(shoal.peer.files.write_atomically: a temporary file renamed into place, fsynced with its folder);
`progress.json` lists the shards written and the documents they hold; `manifest.json` comes last.
A prepare stopped at any point (Ctrl-C) resumes from its last shard with the same command: the
documents already written are skipped. Two processes preparing into one folder (peers of one machine
sharing a cache) take turns on a lock: the second finds the first's corpus.
"""

import fcntl
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, TextIO, cast

import numpy as np

from shoal.peer.data.shards import MANIFEST, Manifest, Shard, file_digest, record_verified
from shoal.peer.data.streams import VALIDATION_SHARE
from shoal.peer.data.text import DataError, TextSource
from shoal.peer.data.tokenizer import Tokenizer
from shoal.peer.files import replace_text, write_atomically

PROGRESS = "progress.json"
LOCK = ".lock"
SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB of uint16
BATCH_DOCUMENTS = 512


@dataclass
class Progress:
    """What a prepare has written so far (`PROGRESS`); `key` names what it prepares."""

    key: str
    shards: list[Shard] = field(default_factory=list)
    documents: dict[str, int] = field(default_factory=lambda: {"train": 0, "validation": 0})
    max_id: int = -1

    @property
    def done(self) -> int:
        return sum(self.documents.values())

    def save(self, folder: Path) -> None:
        replace_text(folder / PROGRESS, json.dumps(asdict(self)))

    @staticmethod
    def load(folder: Path, key: str) -> "Progress":
        """The progress of an interrupted prepare of the same `key`, else a fresh one."""
        try:
            raw = json.loads((folder / PROGRESS).read_text())
            if raw.get("key") == key:
                return Progress(key, [Shard(**s) for s in raw["shards"]], raw["documents"], raw["max_id"])
        except (OSError, ValueError, TypeError, KeyError):
            pass
        return Progress(key)


def prepare(
    source: TextSource,
    out: Path,
    tokenizer: Tokenizer,
    *,
    shard_tokens: int = SHARD_TOKENS,
    report: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Tokenizes `source` into `out` (see the module docstring) and returns its manifest; one that is
    there already, from the same source and tokenizer, is returned as it is. `report(documents,
    tokens)` hears of each batch. DataError for a corpus that cannot be read, or an `out` that holds
    another corpus."""
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens must be >= 1, got {shard_tokens}")
    key = hashlib.sha256(f"{source.fingerprint()}|{tokenizer.digest}|{shard_tokens}".encode()).hexdigest()
    out.mkdir(parents=True, exist_ok=True)
    # peers of one machine that share a cache: one prepares, the others wait for it
    with open(out / LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another process is preparing {source.spec} into {out}: waiting for it", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / MANIFEST).exists():
            return _finished(out, key)
        return _prepare(source, out, tokenizer, key, shard_tokens, report)


def _prepare(
    source: TextSource,
    out: Path,
    tokenizer: Tokenizer,
    key: str,
    shard_tokens: int,
    report: Callable[[int, int], None] | None,
) -> Manifest:
    progress = Progress.load(out, key)
    if not all(_intact(out, shard) for shard in progress.shards):  # changed since: start over
        progress = Progress(key)
    dtype = np.dtype("<u2" if tokenizer.vocab_size <= 1 << 16 else "<u4")
    buffers: dict[str, list[np.ndarray]] = {"train": [], "validation": []}
    held = 0  # training tokens in the buffer
    documents = _skipped(source.documents(), progress.done)
    for batch in _batches(documents, BATCH_DOCUMENTS):
        encoded = tokenizer.encode(batch)
        for text, ids in zip(batch, encoded, strict=True):
            split = "validation" if _held_out(text) else "train"
            ids = np.concatenate(
                [ids.astype(np.int64, copy=False), np.asarray(tokenizer.separator, np.int64)]
            )
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise DataError(
                    f"--tokenizer {tokenizer.name}: made id {ids.max()}, outside its own vocabulary"
                )
            buffers[split].append(ids.astype(dtype))  # stored narrow: a buffer costs what its shard will
            progress.documents[split] += 1
            held += ids.size if split == "train" else 0
            if held >= shard_tokens:
                _flush(out, buffers, dtype, progress, tokenizer)
                held = 0
        if report is not None:
            report(len(batch), sum(len(ids) + len(tokenizer.separator) for ids in encoded))
    _flush(out, buffers, dtype, progress, tokenizer)
    if not progress.done:
        raise DataError(f"--data {source.spec}: no documents")
    manifest = Manifest(
        tokenizer=tokenizer.name,
        tokenizer_digest=tokenizer.digest,
        vocab_size=tokenizer.vocab_size,
        separator=list(tokenizer.separator),
        dtype=dtype.name,
        shards=progress.shards,
        documents=progress.documents,
    )
    (out / "source.json").write_text(json.dumps({"key": key, "source": source.spec}) + "\n")
    record_verified(out, manifest.shards)  # their digests were taken as they were written, or checked
    manifest.write(out)
    (out / PROGRESS).unlink(missing_ok=True)
    return manifest


def _finished(out: Path, key: str) -> Manifest:
    try:
        same = json.loads((out / "source.json").read_text()).get("key") == key
    except (OSError, ValueError, AttributeError):
        same = False
    if not same:
        raise DataError(
            f"{out} holds a prepared corpus of another source or tokenizer; choose another folder"
        )
    return Manifest.read(out)


def _intact(out: Path, shard: Shard) -> bool:
    path = out / shard.name
    return path.is_file() and file_digest(path) == shard.sha256


def _held_out(text: str) -> bool:
    digest = hashlib.sha256(text.encode("utf-8", errors="surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % VALIDATION_SHARE == 0


def _flush(
    out: Path, buffers: dict[str, list[np.ndarray]], dtype: np.dtype, progress: Progress, tokenizer: Tokenizer
) -> None:
    """Writes each split's buffered tokens as a shard, then the progress that counts them."""
    for split, pieces in buffers.items():
        if not pieces:
            continue
        ids = np.concatenate(pieces)
        largest = int(ids.max())
        name = f"{split}-{len(progress.shards):05d}.npy"
        # cast: mypy cannot infer a lambda with a default (`ids`, bound now) against a one-argument callable
        write_atomically(
            out / name,
            cast("Callable[[BinaryIO], object]", lambda file, ids=ids: np.save(file, ids)),
            durable=True,
        )
        progress.shards.append(Shard(name, split, int(ids.size), largest, file_digest(out / name)))
        progress.max_id = max(progress.max_id, largest)
        pieces.clear()
    progress.save(out)


def _skipped(documents: Iterator[str], count: int) -> Iterator[str]:
    for _ in range(count):
        if next(documents, None) is None:
            raise DataError("the corpus is shorter than the interrupted prepare it resumes (changed?)")
    yield from documents


def _batches(documents: Iterator[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


LOG_EVERY_S = 10.0  # how often the progress of a tokenization is told where stderr is not a terminal


class ProgressLine:
    """What a tokenization tells as it goes (`prepare`'s `report`), on stderr: a line redrawn in place
    on a terminal; a line every `every_s` seconds elsewhere (a service's journal, a container's log),
    so that a corpus of gigabytes, minutes of work, is never silent. Documents, tokens and tokens/s."""

    def __init__(self, spec: str = "", stream: TextIO | None = None, every_s: float = LOG_EVERY_S):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = 0.25 if self.tty else every_s
        self.started = self.told = time.monotonic()
        self.documents = self.tokens = 0
        self.name = f" {spec}" if spec else ""
        self.shown = False

    def __call__(self, documents: int, tokens: int) -> None:
        self.documents += documents
        self.tokens += tokens
        if time.monotonic() - self.told >= self.every_s:
            self._tell()

    def close(self) -> None:
        """The totals, once, if anything was tokenized."""
        if self.documents:
            self._tell(final=True)

    def _tell(self, final: bool = False) -> None:
        now = self.told = time.monotonic()
        rate = self.tokens / max(now - self.started, 1e-9)
        verb = "tokenized" if final else "tokenizing"
        line = (
            f"{verb}{self.name}: {self.documents:,} documents, {self.tokens:,} tokens "
            f"({rate:,.0f} tokens/s, {now - self.started:.0f} s)"
        )
        self.stream.write(f"\r{line}\x1b[K" + ("\n" if final else "") if self.tty else line + "\n")
        self.stream.flush()


def progress_bar(spec: str = "") -> ProgressLine:
    """The progress of tokenizing `spec` on stderr (ProgressLine)."""
    return ProgressLine(spec)
