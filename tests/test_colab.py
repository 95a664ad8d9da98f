"""Each notebook opens in Colab and sets itself up there: a badge, then a set-up cell.

The set-up cell runs here in a plain Jupyter kernel, as it would outside Colab, and again with its
Colab branch forced (``WORKBOOK_COLAB=dry``: the commands are shown, not run) and a fake
``nvidia-smi`` standing in for Colab's T4.
"""

from __future__ import annotations

import json
import re
import sys

from kernels.loader import ROOT

import pytest

from grader import stages

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
PLACEHOLDER = "YOUR-ORG/flash-attention-workbook"
NOT_ON_COLAB = "Not on Colab: nothing to install; this notebook uses the workbook's environment.\n"


def _cells(path):
    return json.loads(path.read_text())["cells"]


def _text(cell) -> str:
    return "".join(cell["source"])


def test_every_stage_has_a_notebook_with_the_badge_and_the_setup_cell():
    assert [p.name for p in NOTEBOOKS] == [s.notebook for s in stages.STAGES]
    for path in NOTEBOOKS:
        first, setup = _cells(path)[:2]
        url = f"https://colab.research.google.com/github/{PLACEHOLDER}/blob/main/notebooks/{path.name}"
        assert _text(first).startswith(f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                                       f"({url})"), path.name
        source = _text(setup)
        assert setup["cell_type"] == "code" and source.startswith("# NBVAL_IGNORE_OUTPUT\n")
        assert f'WORKBOOK_REPO = "https://github.com/{PLACEHOLDER}"' in source
        stage = stages.STAGES[NOTEBOOKS.index(path)]
        assert f"!workbook {stage.name} " in source and f"stages/{stage.module}.py" in source
        assert "".join(setup["outputs"][0]["text"]) == NOT_ON_COLAB, "the stored output is the plain run's"


@pytest.fixture(scope="module")
def kernel():
    from jupyter_client.manager import start_new_kernel
    manager, client = start_new_kernel(kernel_name="python3", extra_arguments=[], cwd=str(ROOT / "notebooks"))
    yield client
    client.stop_channels()
    manager.shutdown_kernel(now=True)


def _run(client, code: str) -> str:
    """Execute ``code`` in the kernel; return what it printed (an error fails the test)."""
    out = []

    def collect(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("ERROR " + "\n".join(msg["content"]["traceback"]))

    reply = client.execute_interactive(code, output_hook=collect, timeout=120)
    text = "".join(out)
    assert reply["content"]["status"] == "ok", text
    return text


def test_outside_colab_the_cell_only_says_so(kernel):
    _run(kernel, "import os; os.environ.pop('WORKBOOK_COLAB', None)")
    for path in NOTEBOOKS:
        assert _run(kernel, _text(_cells(path)[1])) == NOT_ON_COLAB, path.name


def test_the_colab_branch_clones_installs_and_says_how_to_grade(kernel, tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "Tesla T4, 7.5"\n')
    smi.chmod(0o755)
    _run(kernel, f"import os; os.environ['WORKBOOK_COLAB'] = 'dry'; os.environ['PATH'] = {str(tmp_path)!r} + "
                 "os.pathsep + os.environ['PATH']")
    try:
        for path, stage in zip(NOTEBOOKS, stages.STAGES):
            out = _run(kernel, _text(_cells(path)[1]))
            home = "/content/flash-attention-workbook"
            assert f"$ git clone --quiet --depth 1 --branch main https://github.com/{PLACEHOLDER} {home}\n" in out
            assert re.search(rf"\$ \S*python\S* -m pip install --quiet --no-deps -e {home}\n", out), out
            assert "GPU: Tesla T4, 7.5\n" in out
            assert f"flash-attention-workbook/stages/{stage.module}.py" in out and f"!workbook {stage.name}" in out
        # A CPU session: nvidia-smi finds no GPU (a stand-in that fails, so that a real nvidia-smi
        # later on PATH, on a GPU machine, is not consulted); the cell says how to get one.
        smi.write_text('#!/bin/sh\necho "NVIDIA-SMI has failed because it could not communicate with the NVIDIA '
                       'driver." >&2\nexit 9\n')
        out = _run(kernel, _text(_cells(NOTEBOOKS[0])[1]))
        assert "GPU: none. For GPU checks: Runtime > Change runtime type > T4 GPU" in out
    finally:
        _run(kernel, "import os; os.environ.pop('WORKBOOK_COLAB', None)")


def test_the_kernel_is_this_environment(kernel):
    assert _run(kernel, "import sys; print(sys.prefix)").strip() == sys.prefix
