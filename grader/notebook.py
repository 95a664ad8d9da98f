"""Run a stage's notebook with nbval against the learner's (or the solution's) code."""

from __future__ import annotations

import os
import subprocess
import sys

from grader.stages import Stage
from kernels.loader import ENV_VAR, ROOT


def run_notebook(stage: Stage, source: str = "stages", *, timeout: int = 900) -> bool:
    """``pytest --nbval-lax notebooks/NN_*.ipynb`` with WORKBOOK_SOURCE set; True when it passed."""
    path = ROOT / "notebooks" / stage.notebook
    if not path.exists():
        print(f"no notebook for {stage.name} at {path}")
        return False
    env = dict(os.environ, **{ENV_VAR: str(source)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
           f"--nbval-cell-timeout={timeout}", str(path)]
    print(f"\nrunning {path.relative_to(ROOT)} with nbval against {source}/ ...", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0
