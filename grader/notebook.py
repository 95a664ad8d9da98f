"""Run a stage's notebook with nbval against the learner's (or the solution's) code.

A notebook runs its cells in a Jupyter kernel started by this process, as you, with your files
and environment: no sandbox.  That is fine for your own ``stages/`` (your code, on your machine),
never for someone else's submission, so ``--notebook`` does not go with ``--submission`` unless
isolation is explicitly ``none`` (grading that runs everything as you anyway).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kernels.loader import ENV_VAR, ROOT

from grader.stages import Stage


def refusal(source: str, isolation: str | None) -> str:
    """Why the notebook may not run against ``source`` under ``isolation`` (the mechanism asked for:
    ``--isolation`` or $WORKBOOK_ISOLATION, None for the default), or "" when it may."""
    if str(source) in ("stages", "solutions"):
        return ""
    from grader.isolation import choice
    asked = (isolation or os.environ.get(choice.ENV, "auto")).strip().lower()
    if asked == "none":
        return ""
    return ("--notebook runs the notebook's cells outside the sandbox, as you, so it does not go with "
            "--submission: a submission's code would run with your files and environment. Grade it without "
            "--notebook; to run its notebook, copy the submission into a workbook of its own and run it there, or "
            "add --isolation none if you trust this code as much as your own")


def run_notebook(stage: Stage, source: str = "stages", *, timeout: int = 900) -> bool:
    """``pytest --nbval-lax notebooks/NN_*.ipynb`` with WORKBOOK_SOURCE set; True when it passed."""
    why = refusal(source, None)
    if why:
        print(f"\nnotebook not run: {why}", flush=True)
        return False
    path = ROOT / "notebooks" / stage.notebook
    if not path.exists():
        print(f"no notebook for {stage.name} at {path}")
        return False
    env = dict(os.environ, **{ENV_VAR: str(source)})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-lax", "--nbval-current-env",
           f"--nbval-cell-timeout={timeout}", str(path)]
    print(f"\nrunning {path.relative_to(ROOT)} with nbval against {source}/ (as you, outside the sandbox: "
          "the isolation above is the grading's) ...", flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode == 0
