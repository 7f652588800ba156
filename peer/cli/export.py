"""`shoal export --checkpoint-dir DIR OUT`: a run's model as a Hugging Face directory
(peer/models/export.py)."""

import argparse
import sys

HELP = "export a checkpoint as a Hugging Face model directory"
DESCRIPTION = (
    "Write the newest checkpoint of --checkpoint-dir to OUT, a new folder that transformers loads "
    "(AutoModelForCausalLM.from_pretrained): config, safetensors weights, tokenizer, and provenance.json "
    "(the run, its round, the run configuration's hash, the data, the tokens consumed, the peers that "
    "counted). The embedded GPT becomes a GPT-2. Needs the hf extra."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint-dir", required=True, metavar="DIR", help="the peer's checkpoint folder")
    parser.add_argument("out", metavar="OUT", help="a new folder to write the model to")
    parser.add_argument(
        "--model", metavar="MODEL", help="the model the checkpoint trained (default: the one it names)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        from shoal.peer.models.export import ExportError, export
    except ImportError as error:
        print(f"shoal export: error: {error}: pip install 'shoal[hf]'", file=sys.stderr)
        return 2
    try:
        provenance = export(args.checkpoint_dir, args.out, model=args.model)
    except ExportError as error:
        print(f"shoal export: error: {error}", file=sys.stderr)
        return 2
    except ImportError as error:
        print(
            f"shoal export: error: {error}: the export needs the hf extra: pip install 'shoal[hf]'",
            file=sys.stderr,
        )
        return 2
    print(f"wrote round {provenance['round']} of run {provenance['run']} to {args.out}")
    return 0
