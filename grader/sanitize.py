"""``python -m grader stageN --sanitize``: grade under NVIDIA's compute-sanitizer (memcheck).

memcheck sees every out-of-bounds or misaligned global-memory access a kernel makes, including
the ones the grader's canaries cannot (far past an output, or into a buffer that was not made
with ``torch.empty``), and names the kernel, the thread and the address.  It needs a CUDA GPU,
and it slows kernels down 10-100x, so grade one check at a time:

    python -m grader stage3 --sanitize --only sequence_lengths

The whole grading runs under the sanitizer with ``--target-processes all``, so it follows the
worker process that runs the learner's code.  Its report is saved in build/sanitizer/ and its
errors are printed after the grader's table; the time limits are raised to match (30 minutes a
check) unless set.  An access memcheck catches also makes the kernel fail, so the check fails
("crash", a CUDA error) as well.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kernels.loader import ROOT

ENV = "WORKBOOK_SANITIZER_LOG"  # set in the sanitized run: it is not started again


def find() -> str | None:
    """compute-sanitizer from PATH, $CUDA_HOME/bin or /usr/local/cuda/bin."""
    candidates = [shutil.which("compute-sanitizer")]
    candidates += [str(Path(d) / "bin" / "compute-sanitizer")
                   for d in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if d]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def command(exe: str, argv: list[str], log: Path) -> list[str]:
    """The grader's own command line, run under memcheck."""
    rest = [a for a in argv if a != "--sanitize"]
    return [exe, "--tool", "memcheck", "--target-processes", "all", "--log-file", str(log),
            sys.executable, "-m", "grader", *rest]


def errors(log: Path, limit: int = 60) -> list[str]:
    """The report's lines about errors (memcheck prefixes its lines with '=========')."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [ln for ln in lines if ln.startswith("=========") and ln.strip("= ")][:limit]


def relaunch(argv: list[str]) -> int:
    import torch
    if not torch.cuda.is_available():
        print("--sanitize runs the checks under NVIDIA compute-sanitizer, which needs a CUDA GPU; none is "
              "visible here. On a CPU, out-of-bounds stores next to an output are caught by the grader anyway.",
              file=sys.stderr)
        return 2
    exe = find()
    if exe is None:
        print("--sanitize needs compute-sanitizer (part of the CUDA toolkit) on PATH, in $CUDA_HOME/bin or in "
              "/usr/local/cuda/bin", file=sys.stderr)
        return 2
    log = ROOT / "build" / "sanitizer" / f"{time.strftime('%Y%m%d-%H%M%S')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, **{ENV: str(log)})
    env.setdefault("WORKBOOK_CHECK_TIMEOUT", "1800")
    env.setdefault("WORKBOOK_STAGE_TIMEOUT", "7200")
    code = subprocess.run(command(exe, argv, log), env=env).returncode
    found = errors(log)
    summary = [ln for ln in found if "ERROR SUMMARY" in ln]
    bad = [ln for ln in summary if "ERROR SUMMARY: 0 errors" not in ln]
    print(f"\ncompute-sanitizer (memcheck) report: {log}")
    print("\n".join(found) if found else "  (no report: did compute-sanitizer start?)")
    return code or (1 if bad else 0)
