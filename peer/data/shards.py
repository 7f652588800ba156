"""Pre-tokenized corpora: the shards `shoal data prepare` writes with their manifest, and token files
made elsewhere (`.npy`, nanoGPT's and llm.c's `.bin`), opened as `Tokens` that are read window by
window (shoal.peer.data.tokens), never loaded whole.

A prepared corpus is a folder of `.npy` shards (uint16 when the vocabulary fits, uint32 otherwise)
and `manifest.json`: the tokenizer (name and digest), the separator, each shard's name, split, token
count, largest id and SHA-256, and the document counts. Its `digest` (of the manifest's canonical
JSON) is what a run pins. Opening it checks every shard against the manifest, so a shard that was
changed, cut short or swapped is refused before anything trains on it. A shard whose digest matched
is recorded with its size and modification time (`verified.json`, where the folder can be written) and
not read again while they stay the same: a large corpus starts in seconds.

Token files: a `.npy` holds one 1-D array of integers; a `.bin` is llm.c's (a 256-int32 header, magic
20240520, version 1 for uint16 or 2 for uint32 ids, then its token count) or nanoGPT's raw uint16.
Their last VALIDATION_FRACTION of tokens (of the last file) is held out.
"""

import contextlib
import glob
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from shoal.peer.data.streams import TokenStreams
from shoal.peer.data.text import DataError
from shoal.peer.data.tokens import FileArray, Tokens
from shoal.peer.files import replace_text

MANIFEST = "manifest.json"
VERIFIED = "verified.json"
FORMAT = 1
VALIDATION_FRACTION = 0.05
LLMC_MAGIC, LLMC_HEADER_INTS = 20240520, 256
MIN_TOKENS = 1000  # fewer training tokens than this is no corpus


@dataclass(frozen=True)
class Shard:
    name: str
    split: str
    """train or validation."""
    tokens: int
    max_id: int
    sha256: str
    """Of the shard file's bytes."""


@dataclass(frozen=True)
class Manifest:
    tokenizer: str
    tokenizer_digest: str
    vocab_size: int
    """The tokenizer's vocabulary."""
    separator: list[int]
    dtype: str
    shards: list[Shard]
    documents: dict[str, int]
    """Documents per split."""
    format: int = FORMAT

    @property
    def digest(self) -> str:
        """SHA-256 of the canonical JSON of everything but the tokenizer's path: what a run pins."""
        content = asdict(self) | {"tokenizer": ""}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def write(self, folder: Path) -> None:
        """Writes manifest.json atomically: a folder without one is not a prepared corpus."""
        replace_text(
            folder / MANIFEST, json.dumps(asdict(self), indent=1, sort_keys=True) + "\n", durable=True
        )

    @staticmethod
    def read(folder: Path) -> "Manifest":
        path = folder / MANIFEST
        try:
            raw = json.loads(path.read_text())
            shards = [Shard(**shard) for shard in raw.pop("shards")]
            manifest = Manifest(shards=shards, **raw)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            raise DataError(f"--data {folder}: {MANIFEST} is not a shoal manifest ({error})") from None
        if manifest.format != FORMAT or manifest.dtype not in ("uint16", "uint32"):
            raise DataError(f"--data {folder}: {MANIFEST} of format {manifest.format}, {manifest.dtype} ids")
        for shard in manifest.shards:
            kinds = (shard.name, shard.split, shard.sha256, shard.tokens, shard.max_id)
            if not all(isinstance(v, str) for v in kinds[:3]) or not all(type(v) is int for v in kinds[3:]):
                raise DataError(f"--data {folder}: {MANIFEST} lists a shard with fields of the wrong types")
        return manifest


def open_prepared(folder: Path) -> TokenStreams:
    """A prepared corpus, every shard checked against the manifest (size, SHA-256, or the record of an
    earlier check: see the module docstring); DataError if one does not match."""
    manifest = Manifest.read(folder)
    arrays: dict[str, list[FileArray]] = {"train": [], "validation": []}
    verified = _verified(folder)
    for shard in manifest.shards:
        path = folder / shard.name
        if Path(shard.name).name != shard.name or shard.split not in arrays:
            raise DataError(f"--data {folder}: {MANIFEST} names a shard {shard.name!r} ({shard.split})")
        array = npy_array(path)
        if array.length != shard.tokens or array.dtype != np.dtype(manifest.dtype).newbyteorder("<"):
            raise DataError(
                f"--data {path}: {array.length} {array.dtype} ids, the manifest says {shard.tokens}"
            )
        if verified.get(shard.name) != [shard.sha256, *_stamp(path)] and file_digest(path) != shard.sha256:
            raise DataError(f"--data {path}: its content does not match the manifest's digest (changed?)")
        arrays[shard.split].append(array)
    record_verified(folder, manifest.shards)
    train, validation = Tokens(arrays["train"]), Tokens(arrays["validation"])
    if not len(train):  # every document went to validation (one document, say): they are the corpus
        train, validation = validation, Tokens([])
    if len(train) < MIN_TOKENS:
        raise DataError(f"--data {folder}: {len(train)} training tokens is too few to train on")
    if not len(validation):  # no document went to validation: hold out the tail
        train, validation = train.split(VALIDATION_FRACTION)
    largest = max(shard.max_id for shard in manifest.shards)
    return TokenStreams(
        train, validation, largest + 1, str(folder), manifest.digest, _tokenizer_name(manifest)
    )


def _scanned(record: Path | None) -> tuple[int, str] | None:
    try:
        largest, digest = json.loads(record.read_text())  # type: ignore[union-attr]
    except (AttributeError, OSError, ValueError, TypeError):
        return None
    return (largest, digest) if isinstance(largest, int) and isinstance(digest, str) else None


def _stamp(path: Path) -> list[int]:
    """What changes when a file is replaced or written (ctime: no user can set it back)."""
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]


def _verified(folder: Path) -> dict:
    try:
        record = json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def record_verified(folder: Path, shards: list[Shard]) -> None:
    """Records the shards, whose digests matched, with their size and modification time; nothing
    where the folder cannot be written (a read-only corpus is then checked at each start)."""
    try:
        record = {shard.name: [shard.sha256, *_stamp(folder / shard.name)] for shard in shards}
        replace_text(folder / VERIFIED, json.dumps(record))
    except OSError:
        pass


def _tokenizer_name(manifest: Manifest) -> str:
    return f"{manifest.tokenizer} ({manifest.tokenizer_digest[:12]})"


def open_token_files(spec: str, files: list[Path] | None = None, scans: Path | None = None) -> TokenStreams:
    """`.npy` or `.bin` token files (`files`, else those `spec` names: one, a folder of them, or a glob;
    see the module docstring). Their largest id and digest take a read of every file: kept in `scans` (a
    folder) under the files' names, sizes and modification times, and read from there while they stay
    the same."""
    files = token_files(spec) if files is None else files
    arrays = [npy_array(f) if f.suffix == ".npy" else bin_array(f) for f in files]
    tokens = Tokens(arrays)
    if len(tokens) < MIN_TOKENS:
        raise DataError(f"--data {spec}: {len(tokens)} tokens is too few to train on")
    stamps = json.dumps([[str(f.resolve()), *_stamp(f)] for f in files])
    record = (
        None if scans is None else scans / f"scan-{hashlib.sha256(stamps.encode()).hexdigest()[:24]}.json"
    )
    try:
        largest, digest = _scanned(record) or tokens.scan()
    except ValueError as error:
        raise DataError(f"--data {spec}: {error}") from None
    if record is not None:
        with contextlib.suppress(OSError):
            replace_text(record, json.dumps([largest, digest]))
    train, validation = tokens.split(VALIDATION_FRACTION)
    return TokenStreams(train, validation, largest + 1, spec, digest, "pre-tokenized")


def token_files(spec: str) -> list[Path]:
    """The `.npy`/`.bin` files `spec` names (a file, a folder, a glob), sorted; [] if it names others."""
    path = Path(spec)
    if any(mark in spec for mark in "*?["):
        found = [Path(name) for name in glob.glob(spec, recursive=True)]
    elif path.is_dir():
        found = list(path.iterdir())
    else:
        found = [path] if path.is_file() else []
    files = sorted(f for f in found if f.is_file())
    if files and all(f.suffix in (".npy", ".bin") for f in files):
        return files
    return []


def npy_array(path: Path) -> FileArray:
    """The 1-D integer array of an `.npy` file, unread; DataError if it is not one."""
    try:
        with open(path, "rb") as file:
            version = np.lib.format.read_magic(file)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }
            if version not in read_header:
                raise ValueError(f"format version {version}")
            shape, _fortran, dtype = read_header[version](file)
            offset = file.tell()
        size = path.stat().st_size
    except (OSError, ValueError) as error:
        raise DataError(f"--data {path}: not an .npy file ({error})") from None
    if len(shape) != 1 or dtype.kind not in "iu" or dtype.itemsize > 8:
        raise DataError(f"--data {path}: holds a {shape} array of {dtype}, not 1-D integer token ids")
    if size != offset + shape[0] * dtype.itemsize:
        raise DataError(f"--data {path}: {size} bytes, its header says {offset + shape[0] * dtype.itemsize}")
    return FileArray(path, offset, dtype, shape[0])


def bin_array(path: Path) -> FileArray:
    """The ids of an llm.c or nanoGPT `.bin` file, unread; DataError if its size is not whole ids."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        header = np.frombuffer(file.read(LLMC_HEADER_INTS * 4), dtype="<i4")
    if header.size == LLMC_HEADER_INTS and header[0] == LLMC_MAGIC:
        if header[1] not in (1, 2):
            raise DataError(f"--data {path}: an llm.c token file of version {header[1]} (1 or 2 are read)")
        dtype = np.dtype("<u2" if header[1] == 1 else "<u4")
        offset, count = LLMC_HEADER_INTS * 4, int(header[2])
        if size != offset + count * dtype.itemsize:
            raise DataError(f"--data {path}: {size} bytes, its header says {offset + count * dtype.itemsize}")
        return FileArray(path, offset, dtype, count)
    if size % 2:
        raise DataError(f"--data {path}: {size} bytes is not a whole number of uint16 token ids")
    return FileArray(path, 0, np.dtype("<u2"), size // 2)


def file_digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            hasher.update(chunk)
    return hasher.hexdigest()
