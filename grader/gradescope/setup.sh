#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder's image (Ubuntu; no GPU).
# It installs Python, the CPU build of torch, and what the grader needs, in /autograder/venv.
set -euo pipefail
apt-get update -q
apt-get install -y -q python3 python3-venv python3-pip
python3 -m venv /autograder/venv
PINS=/autograder/source/constraints/cpu.txt     # the tested CPU set, the same as learners install
/autograder/venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cpu "$(grep '^torch==' "$PINS")"
/autograder/venv/bin/pip install -q -c "$PINS" triton numpy matplotlib
cd /autograder/source
/autograder/venv/bin/python -c "from kernels import runtime; print('kernels run on', runtime.describe())"
