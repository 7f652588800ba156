"""Corpora and tokenizers the tests build locally (nothing is downloaded): documents cut from the
standard library's docstrings, a small BPE trained on them with the `tokenizers` library, and files
in the formats researchers keep their data in."""

import ast
import json
import sysconfig
from pathlib import Path

from shoal.peer.data import tokenizer

MODULES = ("json", "argparse", "dataclasses", "pathlib", "textwrap", "functools", "shutil", "zipfile")


def documents(count: int = 400) -> list[str]:
    """`count` documents: the docstrings of a few standard-library modules (repeated if needed)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for name in MODULES:
        path = root / f"{name}.py" if (root / f"{name}.py").exists() else root / name / "__init__.py"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node)
                if text and len(text) > 40:
                    found.append(text)
    return [found[i % len(found)] + ("" if i < len(found) else f" ({i})") for i in range(count)]


def train_bpe(folder: Path, texts: list[str], vocab_size: int = 400) -> Path:
    """A byte-level BPE trained on `texts`, saved in `folder` as a Hugging Face model folder holds it."""
    return tokenizer.train_bpe(folder, texts, vocab_size)


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    with open(path, "w") as file:
        for i, text in enumerate(texts):
            file.write(json.dumps({field: text, "id": i}) + "\n")
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: texts, "id": list(range(len(texts)))}), path)
    return path
