#!/usr/bin/env bash
# Set up the workbook in .venv, check that the reference solutions pass on this machine,
# and show your progress.  Safe to run again.
#
# It installs a tested set of versions (constraints/cpu.txt without an NVIDIA GPU, constraints/cuda.txt
# with one): the CPU build of torch from PyTorch's CPU index, or the CUDA build from its CUDA index.
# grader/setup_plan.py decides; these override it:
#
#   PYTHON=python3.12 bash setup.sh             use another interpreter (3.11 or newer)
#   WORKBOOK_TORCH=cpu bash setup.sh            the CPU build even with a GPU (or =cuda)
#   WORKBOOK_TORCH_INDEX=pypi bash setup.sh     torch from pip's default index, not PyTorch's
#   TORCH_SPEC="torch==2.11.0" bash setup.sh    install another torch (only if none is installed)
#
# A torch already in .venv is kept.  macOS: stage 1 runs; the Triton stages need the dev container
# or Colab.  Windows: use WSL2, the dev container or Colab (docs/platforms.md).
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
"$PYTHON" -m grader.setup_plan check        # Windows or an old Python: stop here and say what to use
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python

# torch first, on its own, from the index for this machine: with no torch installed, the package's
# plain "torch" requirement would pull the newest build with every CUDA library.
if ! "$PY" -c "import torch" 2>/dev/null; then
  TORCH_LINES=$("$PY" -m grader.setup_plan torch)        # one pip argument a line
  TORCH_ARGS=()
  while IFS= read -r arg; do TORCH_ARGS+=("$arg"); done <<< "$TORCH_LINES"
  "$PY" -m pip install -q "${TORCH_ARGS[@]}"
fi
INSTALLED_TORCH=$("$PY" -c "import torch; print(torch.__version__)")
CONSTRAINTS=$("$PY" -m grader.setup_plan constraints "$INSTALLED_TORCH" .venv/constraints.txt)
echo "installing the workbook with the pins of $CONSTRAINTS"
"$PY" -m pip install -q -c "$CONSTRAINTS" -e ".[dev]"

"$PY" -c "from kernels import runtime; print('kernels run on', runtime.describe())"
if [ -d solutions ]; then            # the instructor's repository
  "$PY" -m grader release --check || "$PY" -m grader release
fi
echo
if [ -d solutions ]; then
  "$PY" -m grader stage1 --solutions    # the reference passes here: the set-up works
else
  "$PY" -m grader doctor                # a learner's edition: what runs on this machine
fi
echo
"$PY" -m grader                         # your progress: every stage "not started" on a fresh copy
echo
echo "Check this machine any time:   ./workbook doctor"
echo "Grade a stage:                 ./workbook stage1     (the same as .venv/bin/python -m grader stage1)"
echo "Next: .venv/bin/jupyter lab notebooks/01_online_softmax.ipynb   (or open it in your editor)"
