"""`shoal data prepare SOURCE OUT`: tokenize a corpus once into shards and a manifest
(shoal.peer.data.prepare), for `shoal join --data OUT`."""

import argparse
import sys
import time
from pathlib import Path

HELP = "prepare a corpus: tokenize it once into shards"
DESCRIPTION = (
    "Tokenize SOURCE (a .jsonl, .parquet or .csv file, a save_to_disk folder, text files; a folder or a "
    "glob of them) into OUT: shards of token ids (uint16 when the vocabulary fits, else uint32) and a "
    "manifest with their digests, for --data OUT. Stopped (Ctrl-C), it resumes with the same command."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    prepare = actions.add_parser("prepare", help="tokenize SOURCE into OUT", description=DESCRIPTION)
    prepare.add_argument("source", metavar="SOURCE")
    prepare.add_argument("out", metavar="OUT")
    prepare.add_argument(
        "--tokenizer", metavar="PATH", default="bytes",
        help="a tokenizer.json, a folder holding one (a Hugging Face model's), or bytes (default: bytes, "
        "the embedded model's)",
    )  # fmt: skip
    prepare.add_argument("--text-field", metavar="NAME", default="text", help="the field holding the text")
    prepare.add_argument(
        "--shard-tokens", metavar="N", type=int, default=1 << 26, help="training tokens per shard, at least"
    )


def run(args: argparse.Namespace) -> int:
    from shoal.peer.data.prepare import prepare, progress_bar
    from shoal.peer.data.text import text_source
    from shoal.peer.data.tokenizer import ByteTokenizer, load_tokenizer

    started = time.monotonic()
    try:
        tokenizer = load_tokenizer(args.tokenizer, "") or ByteTokenizer()
        source = text_source(args.source, args.text_field)
        manifest = prepare(
            source, Path(args.out), tokenizer, shard_tokens=args.shard_tokens, report=progress_bar()
        )
    except ValueError as error:  # DataError, TokenizerError, a bad --shard-tokens
        print(f"shoal data prepare: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # an OUT it cannot write, a disk full, a file gone
        print(f"shoal data prepare: error: {error.filename or args.out}: {error.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nshoal data prepare: interrupted; the same command resumes it", file=sys.stderr)
        return 130
    tokens = sum(shard.tokens for shard in manifest.shards)
    seconds = time.monotonic() - started
    documents = ", ".join(f"{count} {split}" for split, count in manifest.documents.items())
    print(
        f"prepared {args.out}: {tokens:,} tokens ({manifest.dtype}) in {len(manifest.shards)} shards, "
        f"documents {documents}; {tokens / max(seconds, 1e-9):,.0f} tokens/s; digest {manifest.digest}"
    )
    return 0
