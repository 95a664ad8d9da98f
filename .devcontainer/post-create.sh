#!/usr/bin/env bash
# Runs once in the new container, in the workbook's folder: install the workbook itself (its
# dependencies are in the image), make sure stages/ exists, and show what runs here.
set -euo pipefail
python -m pip install -q --no-deps --disable-pip-version-check -e .     # `workbook`, `python -m grader`
python -m grader release --check >/dev/null 2>&1 || python -m grader release
if [ -d solutions ]; then
  python -m grader stage1 --solutions      # the reference passes here: the container works
fi
python -m grader doctor
echo
echo "Ready. Open notebooks/01_online_softmax.ipynb (kernel: /opt/workbook), then: workbook stage1"
