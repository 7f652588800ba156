#!/usr/bin/env bash
# The wheels a lent GPU machine lacks to run shoal (its image has Python 3.12, CUDA torch, numpy,
# transformers and pytest, and reaches no index): the closure of shoal's dependencies less the image's
# packages, for CPython 3.12 on x86-64 Linux, into .whl/ (ignored by git; carried with the run).
#
#     bash tests/benchmarks/gpu_wheels.sh            # here, where pip reaches PyPI (about 60 MB)
#
# Then run tests/benchmarks/gpu_checks.sh there, carrying .whl (its header says how).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
rm -rf .whl && mkdir .whl
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${tag}_x86_64")
done
# compiled: for that interpreter and platform; grpcio and protobuf too, as the committed *_pb2*.py
# need at least these versions (pyproject.toml)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    grpcio==1.85.4 grpcio-tools==1.85.1 protobuf==7.36.2 zstandard==0.25.0 blake3==1.0.11 \
    cffi==2.1.1 cryptography==51.0.1 mmh3==5.3.1 pydantic-core==2.50.5
# hivemind's wheel carries its libp2p daemon, built for x86-64 Linux
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl hivemind==1.1.12
# pure Python (some published as source only): built into wheels here
python3 -m pip wheel -q --no-deps -w .whl \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 annotated-types==0.8.0 base58==2.1.1 \
    configargparse==1.9.0 morphys==1.0 netaddr==1.3.0 prefetch-generator==1.0.3 py-cid==0.5.0 \
    py-multibase==2.0.0 py-multicodec==1.0.0 py-multihash==3.0.0 pycparser==3.12 pydantic==2.14.4 \
    python-baseconv==1.2.2 typing-inspection==0.4.5 varint==1.0.2
du -sh .whl
