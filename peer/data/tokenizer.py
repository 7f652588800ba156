"""Tokenizers: how text becomes token ids, and what separates two documents.

- `ByteTokenizer`: the embedded byte-level GPT's: a document's UTF-8 bytes (vocabulary 256), documents
  joined by a newline, as the standard-library corpus has always been (a byte vocabulary has no room
  for an end-of-text token).
- `HFTokenizer`: a Hugging Face fast tokenizer (`tokenizer.json`, read with the `tokenizers` library of
  the `shoal[hf]` extra). Documents are separated by its end-of-text token: the `eos_token` of the
  folder's tokenizer_config.json, else the first of END_OF_TEXT it knows.

`load_tokenizer` takes `--tokenizer` (a tokenizer.json, a folder holding one, or `bytes`) or, when it
is not given, the `--model` directory's own tokenizer. A tokenizer's `digest` names it in a prepared
corpus's manifest and in the run's configuration: peers with another tokenizer are refused.
`train_bpe` makes a byte-level BPE here, for benchmarks and tests (nothing is downloaded).
"""

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import numpy as np

END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
"""End-of-text tokens looked for in a tokenizer whose folder names none, in this order."""


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names it and what is wrong."""


class Tokenizer(Protocol):
    name: str
    """What the user named (`bytes`, a path)."""
    digest: str
    """SHA-256 of what encodes (the tokenizer's JSON and its separator)."""
    vocab_size: int
    separator: tuple[int, ...]
    """Ids written after each document."""

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text, without the separator."""
        ...


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256
    separator: tuple[int, ...] = (ord("\n"),)
    digest = hashlib.sha256(b"shoal bytes tokenizer, newline-separated").hexdigest()

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [
            np.frombuffer(text.encode("utf-8", errors="surrogateescape"), dtype=np.uint8) for text in texts
        ]


class HFTokenizer:
    """A Hugging Face fast tokenizer (see the module docstring)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer as Fast
        except ImportError:
            raise TokenizerError(
                f"--tokenizer {path}: Hugging Face tokenizers need the hf extra: pip install 'shoal[hf]'"
            ) from None
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            self._fast = Fast.from_file(str(file))
        except Exception as error:  # the library raises its own Exception for any file it cannot read
            raise TokenizerError(
                f"--tokenizer {path}: {file} does not load as a tokenizer: {error}"
            ) from None
        self.name = str(path)
        self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
        eot = _end_of_text(
            file.parent / "tokenizer_config.json", self._fast.get_vocab(with_added_tokens=True)
        )
        if eot is None:
            raise TokenizerError(
                f"--tokenizer {path}: it has no end-of-text token to separate documents (looked for the "
                f"eos_token of tokenizer_config.json, then {', '.join(END_OF_TEXT)})"
            )
        self.separator: tuple[int, ...] = (eot,)
        # of the file's JSON, canonical (not of the library's re-serialization, which may change with
        # its version): two machines with one tokenizer.json pin one digest
        canonical = json.dumps(json.loads(file.read_text()), sort_keys=True, separators=(",", ":"))
        self.digest = hashlib.sha256(canonical.encode() + b"\0" + str(eot).encode()).hexdigest()

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        encoded = self._fast.encode_batch_fast(texts, add_special_tokens=False)  # threads on every core
        return [np.asarray(item.ids, dtype=np.int64) for item in encoded]


def _end_of_text(config: Path, vocab: dict[str, int]) -> int | None:
    named = None
    if config.is_file():
        try:
            named = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            named = None
        if isinstance(named, dict):
            named = named.get("content")
    for token in (named, *END_OF_TEXT):
        if isinstance(token, str) and token in vocab:
            return vocab[token]
    return None


def load_tokenizer(spec: str | None, model: str) -> Tokenizer | None:
    """The tokenizer `--tokenizer` names, else that of the `--model` directory; None when neither
    names one (text is then read as bytes, for the embedded model)."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec is not None:
        path = Path(spec)
        if not path.exists():
            raise TokenizerError(f"--tokenizer {spec}: no such file or directory")
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            raise TokenizerError(
                f"--tokenizer {spec}: the folder holds no tokenizer.json (save a fast tokenizer there: "
                "tokenizer.save_pretrained)"
            )
        return HFTokenizer(path)
    if model and Path(model).is_dir() and (Path(model) / "tokenizer.json").is_file():
        return HFTokenizer(Path(model))
    return None


def train_bpe(folder: Path, texts: Iterable[str], vocab_size: int) -> Path:
    """A byte-level BPE of `vocab_size` trained on `texts` with the `tokenizers` library, saved as
    folder/tokenizer.json with an end-of-text token named by folder/tokenizer_config.json, as a Hugging
    Face model folder holds them (the benchmarks' and the tests' tokenizers: nothing is downloaded)."""
    from tokenizers import Tokenizer as Fast
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = Fast(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return folder
