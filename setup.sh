#!/usr/bin/env bash
# Set up the workbook in .venv, check that the reference solutions pass on this machine,
# and show your progress.  Safe to run again.
#
#   PYTHON=python3.12 bash setup.sh        use another interpreter
#   TORCH_SPEC="torch==2.11.0" bash setup.sh   install another torch (only if none is installed)
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python

# torch first, on its own: with no torch installed, the package's plain "torch" requirement
# would pull the newest build with every CUDA library.  An installed torch (CPU or CUDA) is kept.
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
"$PY" -m pip install -q -e ".[dev]"

"$PY" -c "from kernels import runtime; print('kernels run on', runtime.describe())"
"$PY" -m grader release --check || "$PY" -m grader release
echo
"$PY" -m grader stage1 --solutions      # the reference passes here: the set-up works
echo
"$PY" -m grader                         # your progress: every stage "not started" on a fresh copy
echo
echo "Next: .venv/bin/jupyter lab notebooks/01_online_softmax.ipynb   (or open it in your editor)"
