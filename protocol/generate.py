"""Regenerates the Python code of the `.proto` files in this folder.

    python -m shoal.protocol.generate          # rewrite the committed *_pb2.py / *_pb2.pyi / *_pb2_grpc.py
    python -m shoal.protocol.generate --check  # exit 1 if they differ from a fresh generation

protoc runs on a copy of the files laid out as `shoal/protocol/NAME.proto`, so the descriptors are
registered under that unique path and cross-file imports resolve to `shoal.protocol.NAME_pb2`.
Needs grpcio-tools, pinned in the `dev` extra so that regeneration is byte-for-byte reproducible.
"""

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def proto_files() -> list[Path]:
    return sorted(HERE.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc on every `.proto` here and writes the generated modules into `out_dir`."""
    from grpc_tools import protoc  # dev dependency: imported only when regenerating

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        package = root / "shoal" / "protocol"
        package.mkdir(parents=True)
        sources = []
        for proto in proto_files():
            shutil.copy(proto, package / proto.name)
            sources.append(f"shoal/protocol/{proto.name}")
        args = ["protoc", f"-I{root}", f"--python_out={root}", f"--pyi_out={root}", *sources]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {sources}")
        services = [
            s for s, proto in zip(sources, proto_files(), strict=True) if "\nservice " in proto.read_text()
        ]
        if services and protoc.main(["protoc", f"-I{root}", f"--grpc_python_out={root}", *services]) != 0:
            raise RuntimeError(f"protoc's gRPC plugin failed on {services}")
        written = []
        for generated in sorted(package.glob("*_pb2*.py*")):
            target = out_dir / generated.name
            shutil.copy(generated, target)
            written.append(target)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    if not args.check:
        for path in generate(HERE):
            print(f"wrote {path}")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        stale = [p.name for p in generate(Path(tmp)) if p.read_bytes() != (HERE / p.name).read_bytes()]
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m shoal.protocol.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
