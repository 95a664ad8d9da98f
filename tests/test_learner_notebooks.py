"""A learner's notebooks, run with every TODO as released, go from top to bottom.

The notebooks are validated with nbval against the solutions; this runs each one the way a learner
first meets it, against stages/ as release wrote it (tests/test_grader.py checks that stages/ is in
sync), as Jupyter's "Run All" would: a cell that raised would stop everything after it. Cells whose
code is not written yet must say so ("not written yet: TODO(3b) (line 84) ..."), never raise.
"""

import json
import os
import subprocess
import sys

from kernels.loader import ROOT

import pytest

NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_a_learners_notebook_runs_to_the_end(notebook, tmp_path):
    # The workbook's own copy only: there stages/ is as released (it has solutions/ to release from);
    # a learner's bundle leaves this file out, since its stages/ holds the learner's work.
    if not (ROOT / "solutions").is_dir():
        pytest.skip("stages/ is the learner's work here, not the release")
    copy = tmp_path / notebook
    copy.write_bytes((ROOT / "notebooks" / notebook).read_bytes())
    env = dict(os.environ, WORKBOOK_SOURCE="stages",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("WORKBOOK_COLAB", None)
    done = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                           "--allow-errors", "--inplace", "--ExecutePreprocessor.timeout=600", str(copy)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    cells = json.loads(copy.read_text())["cells"]
    errors = [(i, out["ename"], out["evalue"][:200]) for i, cell in enumerate(cells) if cell["cell_type"] == "code"
              for out in cell.get("outputs", []) if out["output_type"] == "error"]
    assert not errors, f"{notebook}: cells raised with every TODO as released (cell, error): {errors}"
    printed = "".join("".join(out.get("text", "")) for cell in cells for out in cell.get("outputs", []))
    assert "stage code loaded from stages/" in printed
    if any("check = checker(stage" in "".join(cell["source"]) for cell in cells):
        assert "not written yet" in printed
