#!/bin/sh
# Installs torch, then shoal, into /opt/shoal/venv, inside the image build (deploy/docker/Dockerfile):
#
#   install.sh torch VARIANT TORCH_INDEX    (its own layer: a source edit does not fetch torch again)
#   install.sh shoal VARIANT EXTRAS
#
# With wheels in /opt/shoal/wheels (an offline build), pip reads that folder alone; otherwise torch
# comes from TORCH_INDEX (default: PyTorch's index for VARIANT) and the rest from PyPI.
set -eu
what=$1 variant=$2
case "$variant" in
    cpu) default_index=https://download.pytorch.org/whl/cpu ;;
    cuda) default_index=https://download.pytorch.org/whl/cu128 ;;
    *) echo "install.sh: VARIANT must be cpu or cuda, not '$variant'" >&2; exit 2 ;;
esac
venv=/opt/shoal/venv
offline=""
if ls /opt/shoal/wheels/*.whl >/dev/null 2>&1; then
    offline="--no-index --find-links /opt/shoal/wheels"
    echo "install.sh: offline, from the wheels in deploy/docker/wheels"
fi

case "$what" in
torch)
    torch_index=${3:-$default_index}
    python3 -m venv "$venv"
    # shellcheck disable=SC2086
    if [ -n "$offline" ]; then "$venv/bin/pip" install $offline torch
    else "$venv/bin/pip" install --index-url "$torch_index" torch; fi
    # the build that VARIANT names, whatever the wheel folder held
    "$venv/bin/python" - "$variant" <<'PY'
import sys
import torch
has_cuda = torch.version.cuda is not None
if has_cuda != (sys.argv[1] == "cuda"):
    sys.exit(f"install.sh: VARIANT={sys.argv[1]} but torch {torch.__version__} is a "
             f"{'CUDA' if has_cuda else 'CPU'} build: give the wheels or TORCH_INDEX of that variant")
print(f"install.sh: torch {torch.__version__}")
PY
    ;;
shoal)
    extras=${3:-}
    target=/opt/shoal/src
    [ -z "$extras" ] || target="/opt/shoal/src[$extras]"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install $offline "$target"
    rm -rf /opt/shoal/src/build
    "$venv/bin/shoal" --version
    ;;
*) echo "install.sh: the first argument is torch or shoal, not '$what'" >&2; exit 2 ;;
esac
