#!/usr/bin/env bash
# The dev container's environment: a venv at $1 holding exactly the pinned set in $2.
# The Dockerfile runs it; so can a test on any Linux machine (with a scratch folder for $1).
#
#   WORKBOOK_TORCH_INDEX=pypi   torch from pip's default index, where PyTorch's CPU index is unreachable
set -euo pipefail
venv=$1
pins=$2
python3 -m venv "$venv"
pip="$venv/bin/python -m pip --no-cache-dir --disable-pip-version-check"
torch=$(grep '^torch==' "$pins")
if [ "${WORKBOOK_TORCH_INDEX:-}" = "pypi" ]; then
  $pip install -q "$torch"
else
  $pip install -q --index-url https://download.pytorch.org/whl/cpu "$torch"     # the CPU build: no CUDA libraries
fi
$pip install -q -r "$pins"                   # everything else, at the tested versions
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, '/ triton', triton.__version__)"
