#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder's image (Ubuntu; no GPU).
# It installs Python, the CPU build of torch, and what the grader needs, in /autograder/venv.
set -euo pipefail
apt-get update -q
# bubblewrap sandboxes learner code where the container allows namespaces (grader/sandbox.py);
# util-linux's setpriv (in the base image) runs it as a dedicated user where it does not.
apt-get install -y -q python3 python3-venv python3-pip bubblewrap
python3 -m venv /autograder/venv
PINS=/autograder/source/constraints/cpu.txt     # the tested CPU set, the same as learners install
/autograder/venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cpu "$(grep '^torch==' "$PINS")"
/autograder/venv/bin/pip install -q -c "$PINS" triton numpy matplotlib
cd /autograder/source
/autograder/venv/bin/python -c "from kernels import runtime; print('kernels run on', runtime.describe())"
