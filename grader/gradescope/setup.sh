#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder's image (Ubuntu; no GPU).
# It installs Python, the CPU build of torch, and what the grader needs, in /autograder/venv.
set -euo pipefail
apt-get update -q
# bubblewrap sandboxes learner code where the container allows namespaces (grader/isolation/);
# util-linux's setpriv (in the base image) runs it as a dedicated user where it does not.
apt-get install -y -q python3 python3-venv python3-pip bubblewrap

# The workbook needs Python 3.11 or newer: Ubuntu 24.04's python3 is 3.12; on 22.04 (3.10) the
# universe archive has python3.11.
pick_python() {
    if python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        PY=python3
    elif apt-get install -y -q python3.11 python3.11-venv && python3.11 -c 'import venv' 2>/dev/null; then
        PY=python3.11
    else
        echo "the workbook needs Python 3.11 or newer, and this image has $(python3 --version 2>&1):" \
             "choose the Ubuntu 24.04 base image in the autograder's settings" >&2
        return 1
    fi
}
pick_python
"$PY" -m venv /autograder/venv
PINS=/autograder/source/constraints/cpu.txt     # the tested CPU set, the same as learners install
/autograder/venv/bin/pip install -q --index-url https://download.pytorch.org/whl/cpu "$(grep '^torch==' "$PINS")"
/autograder/venv/bin/pip install -q -c "$PINS" triton numpy matplotlib
cd /autograder/source
/autograder/venv/bin/python -c "from kernels import runtime; print('kernels run on', runtime.describe())"
