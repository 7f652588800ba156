"""Documents: the texts of a corpus, read from local files, one file at a time, never all at once.

`text_source(spec)` resolves `--data` (or `shoal data prepare`'s SOURCE) into a `TextSource`:
- a file in a dataset format, read through Hugging Face `datasets` (the `shoal[hf]` extra), streamed:
  `.jsonl`/`.json`, `.parquet`, `.csv` (a row is a document, its `text_field` the text);
- an `.arrow` folder written by `Dataset.save_to_disk` (its `train` split, if it holds several);
- a folder, or a glob, of such files, all of one format;
- a text file (any other suffix: `.txt`, `.md`, `.py`...), or a folder of them: each file is one
  document (one larger than PIECE_BYTES: pieces of that size, cut after a newline).

Everything is checked before a token is trained on, and a problem names its file: a missing file or
an empty dataset, one that does not parse, a row whose `text_field` is missing or not a string (the
whole source is refused: a corpus with holes is better fixed than half-trained on), and a binary file
where text is expected (a NUL byte or invalid UTF-8), which is refused, never trained on.
"""

import codecs
import glob
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""Dataset formats by suffix, as `datasets.load_dataset` names its builders."""
SNIFF_BYTES = 8192  # a plain text file with a NUL byte in its first SNIFF_BYTES is binary
PIECE_BYTES = 1 << 20  # a text file larger than this is read as documents of about this size


class DataError(ValueError):
    """A corpus that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TextSource:
    """A corpus's files and how each is read (`documents`)."""

    spec: str
    files: tuple[Path, ...]
    kind: str
    """A `datasets` builder (FORMATS), `arrow` (a save_to_disk folder) or `plain` (text files)."""
    text_field: str = "text"

    def documents(self) -> Iterator[str]:
        """Every document, file after file, in the order of the sorted file names."""
        for file in self.files:
            yield from self._read(file)

    def fingerprint(self) -> str:
        """What changes when a file does (name, size, modification time; every file of an arrow
        folder): a prepared cache's key."""
        files = [f for top in self.files for f in (sorted(top.rglob("*")) if top.is_dir() else [top])]
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
        return repr((self.kind, self.text_field, stats))

    def _read(self, file: Path) -> Iterator[str]:
        if self.kind == "plain":
            yield from _plain_text(file)
            return
        rows = 0
        for row in _rows(file, self.kind):
            value = row.get(self.text_field) if isinstance(row, dict) else None
            if not isinstance(value, str):
                fields = ", ".join(row) if isinstance(row, dict) else "-"
                raise DataError(
                    f"--data {file}: row {rows} has no text under {self.text_field!r} (its fields: {fields}; "
                    "choose with --text-field)"
                )
            rows += 1
            yield value
        if rows == 0:
            raise DataError(f"--data {file}: an empty dataset")


def _rows(file: Path, kind: str) -> Iterator[dict]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: nothing is asked of the hub
    try:
        import datasets
    except ImportError:
        raise DataError(f"--data {file}: dataset files need the hf extra: pip install 'shoal[hf]'") from None
    datasets.disable_progress_bars()
    try:
        if kind == "arrow":
            loaded = datasets.load_from_disk(str(file))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise DataError(
                        f"--data {file}: a dataset of splits {', '.join(loaded)}, without 'train'"
                    )
                loaded = loaded["train"]
            yield from loaded
            return
        yield from datasets.load_dataset(kind, data_files=str(file), split="train", streaming=True)
    except DataError:
        raise
    except Exception as error:  # pyarrow's and datasets' own errors: a file that does not parse
        raise DataError(f"--data {file}: cannot be read as {kind}: {_first_line(error)}") from None


def _plain_text(file: Path) -> Iterator[str]:
    """The file as one document; a file past PIECE_BYTES as pieces of about that size, cut after a
    newline, read one block at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    text, offset, pieces = "", 0, 0
    with open(file, "rb") as reader:
        while True:
            block = reader.read(PIECE_BYTES)
            if offset == 0 and b"\0" in block[:SNIFF_BYTES]:
                raise DataError(
                    f"--data {file}: a binary file (a NUL byte) where text is expected; remove it"
                )
            try:
                text += decoder.decode(block, final=not block)
            except UnicodeDecodeError as error:
                where = offset + error.start
                raise DataError(
                    f"--data {file}: not UTF-8 text (byte {where}); remove it, or convert it"
                ) from None
            offset += len(block)
            if not block:
                break
            if len(text) >= PIECE_BYTES:
                cut = text.rfind("\n") + 1 or len(text)
                yield text[:cut]
                text, pieces = text[cut:], pieces + 1
    if text or not pieces:
        yield text


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def text_source(spec: str, text_field: str = "text") -> TextSource:
    """The corpus `spec` names (see the module docstring); DataError if there is none."""
    path = Path(spec)
    if any(mark in spec for mark in "*?["):
        files = tuple(sorted(Path(name) for name in glob.glob(spec, recursive=True) if Path(name).is_file()))
        if not files:
            raise DataError(f"--data {spec}: the pattern matches no file")
        return TextSource(spec, files, _kind_of(spec, files), text_field)
    if not path.exists():
        raise DataError(f"--data {spec}: no such file or directory")
    if path.is_file():
        return TextSource(spec, (path,), FORMATS.get(path.suffix.lower(), "plain"), text_field)
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        return TextSource(spec, (path,), "arrow", text_field)
    files = tuple(sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)))
    if not files:
        raise DataError(f"--data {spec}: an empty folder")
    return TextSource(spec, files, _kind_of(spec, files), text_field)


def _kind_of(spec: str, files: tuple[Path, ...]) -> str:
    kinds = {FORMATS.get(f.suffix.lower(), "plain") for f in files}
    if len(kinds) > 1:
        raise DataError(
            f"--data {spec}: files of several formats ({', '.join(sorted(kinds))}); give one format at a time"
        )
    return kinds.pop()


def _hidden(file: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in file.relative_to(root).parts)
