"""What a peer trains on.

- `sources`: `--data` resolved into token streams (`load_data`);
- `text`: the documents of a text corpus (jsonl, parquet, csv, arrow, text files);
- `tokenizer`: bytes, or a Hugging Face fast tokenizer, and the separator between documents;
- `prepare`: `shoal data prepare`, a corpus tokenized once into shards, resumably;
- `shards`: prepared shards and their manifest, `.npy` and `.bin` token files;
- `tokens`: token ids read window by window, never loaded whole;
- `streams`: the training and validation streams, the standard-library corpus, and the batches.
"""

from shoal.peer.data.sources import load_data
from shoal.peer.data.streams import (
    VALIDATION_SHARE,
    BatchPlan,
    RoundSlices,
    TokenStreams,
    stdlib_corpus,
    validation_batches,
    validation_loss,
)
from shoal.peer.data.text import DataError
from shoal.peer.data.tokens import Tokens

__all__ = [
    "VALIDATION_SHARE",
    "BatchPlan",
    "DataError",
    "RoundSlices",
    "TokenStreams",
    "Tokens",
    "load_data",
    "stdlib_corpus",
    "validation_batches",
    "validation_loss",
]
