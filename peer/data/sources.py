"""`--data`: what a peer trains on, resolved into `TokenStreams` before the peer joins.

- `stdlib`: the standard library's sources (shoal.peer.data.streams), as bytes for the embedded
  model; a model with its own tokenizer gets them tokenized, prepared like any text corpus;
- a prepared corpus (a folder with manifest.json, `shoal data prepare`), checked shard by shard;
- token files: `.npy`/`.bin` (a file, a folder of them, a glob; shoal.peer.data.shards);
- any text corpus (shoal.peer.data.text): prepared once into the cache (`--data-cache`, under a key of
  its files' names, sizes and times and of the tokenizer) with the tokenizer, then opened from there.
  A later run on the same files starts at once.

A prepared corpus or token files pin their digest in the run's configuration (`data`, with the
tokenizer's name): a peer with other data or another tokenizer is refused, and the refusal names both.
"""

import dataclasses
import hashlib
import os
import shutil
from pathlib import Path

from shoal.peer.data.prepare import prepare, progress_bar
from shoal.peer.data.shards import MANIFEST, open_prepared, open_token_files, token_files
from shoal.peer.data.streams import TokenStreams, stdlib_corpus, stdlib_files
from shoal.peer.data.text import DataError, TextSource, text_source
from shoal.peer.data.tokenizer import ByteTokenizer, Tokenizer


def default_cache() -> Path:
    """Where text corpora are prepared: $XDG_CACHE_HOME/shoal/data, or ~/.cache/shoal/data."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "shoal" / "data"


def load_data(
    spec: str,
    *,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
    cache: Path | None = None,
    model_without_tokenizer: str | None = None,
) -> TokenStreams:
    """The token streams `spec` names (see the module docstring). `tokenizer`: the one the user or
    the model named (None: bytes, for the embedded model). `model_without_tokenizer`: a model
    directory that has none, whose text must not silently become byte ids. DataError (a ValueError)
    naming the file when the data cannot be used, or was made by another tokenizer than the one named."""
    try:
        path = Path(spec)
        prepared = path.is_dir() and (path / MANIFEST).is_file()
        files = [] if prepared or spec == "stdlib" else token_files(spec)
        if not (prepared or files) and tokenizer is None and model_without_tokenizer is not None:
            raise DataError(
                f"--model {model_without_tokenizer} has no tokenizer.json to tokenize --data {spec} with: "
                "give --tokenizer (the model's tokenizer.json, or bytes for byte ids)"
            )
        if spec == "stdlib" and tokenizer is None:
            return stdlib_corpus()
        if prepared:
            return _same_tokenizer(open_prepared(path), tokenizer, spec)
        if files:
            return open_token_files(spec, files, cache or default_cache())
        if spec == "stdlib":
            source = TextSource("stdlib", tuple(stdlib_files()), "plain")
        else:
            source = text_source(spec, text_field)
        tokenizer = tokenizer or ByteTokenizer()
        key = hashlib.sha256(f"{source.fingerprint()}|{tokenizer.digest}".encode()).hexdigest()[:24]
        folder = (cache or default_cache()) / key
        _prepare_telling(source, folder, tokenizer, spec)
        try:
            streams = open_prepared(folder)
        except DataError:  # the cache's copy was damaged (a disk fault, a hand): made again
            shutil.rmtree(folder)
            _prepare_telling(source, folder, tokenizer, spec)
            streams = open_prepared(folder)
        return dataclasses.replace(streams, name=f"{spec} (tokenized into {folder})")
    except OSError as error:  # a file that cannot be read: the setting's to fix, like a missing one
        raise DataError(f"--data {spec}: cannot read {error.filename or spec}: {error.strerror}") from None


def _prepare_telling(source, folder: Path, tokenizer: Tokenizer, spec: str) -> None:
    """`prepare`, telling its progress on stderr (a corpus is tokenized once, then read from `folder`)."""
    report = progress_bar(f"--data {spec}")
    try:
        prepare(source, folder, tokenizer, report=report)
    finally:
        report.close()


def _same_tokenizer(streams: TokenStreams, tokenizer: Tokenizer | None, spec: str) -> TokenStreams:
    if tokenizer is not None and tokenizer.digest[:12] not in streams.tokenizer:
        raise DataError(
            f"--data {spec} was prepared with tokenizer {streams.tokenizer}, not with {tokenizer.name} "
            f"({tokenizer.digest[:12]}): prepare it again with this one, or train with that one"
        )
    return streams
