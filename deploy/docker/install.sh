#!/bin/sh
# Installs torch and shoal into /opt/shoal/venv, inside the image build (deploy/docker/Dockerfile).
# usage: install.sh VARIANT TORCH_INDEX EXTRAS
# With wheels in /opt/shoal/wheels (an offline build), pip reads that folder alone; otherwise torch
# comes from TORCH_INDEX (default: PyTorch's index for VARIANT) and the rest from PyPI.
set -eu
variant=$1 torch_index=$2 extras=$3
case "$variant" in
    cpu) default_index=https://download.pytorch.org/whl/cpu ;;
    cuda) default_index=https://download.pytorch.org/whl/cu128 ;;
    *) echo "install.sh: VARIANT must be cpu or cuda, not '$variant'" >&2; exit 2 ;;
esac
target=/opt/shoal/src
[ -z "$extras" ] || target="/opt/shoal/src[$extras]"

python3 -m venv /opt/shoal/venv
pip=/opt/shoal/venv/bin/pip
if ls /opt/shoal/wheels/*.whl >/dev/null 2>&1; then
    echo "install.sh: offline, from the wheels in deploy/docker/wheels"
    "$pip" install --no-index --find-links /opt/shoal/wheels torch "$target"
else
    "$pip" install --index-url "${torch_index:-$default_index}" torch
    "$pip" install "$target"
fi
rm -rf /opt/shoal/src/build
/opt/shoal/venv/bin/shoal --version
