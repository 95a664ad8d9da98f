"""The verdict line of a notebook's check cell, with the grader's statuses.

Each notebook teaches its checks in full: the cell builds the inputs, compares your output with
the float64 reference under the workbook's tolerance rule and asks ``grader.diagnose`` for the
likely cause.  What it prints at the end is this module's: ``passed``, ``FAILED`` with the
problems found, or ``not written yet`` when the code the check ran still holds a TODO exactly as
release wrote it (the grader's ``todo``), wherever that TODO now is in the file:

    check = checker(stage)                     # stage: the module load_stage gave the notebook
    check("N = 129, 32x32 tiles", lambda: attention_problems(q, k, v), "TODO(5a) and TODO(5b)")

``run`` returns a list of problems (empty when everything matches); ``todo`` names the holes the
check exercises.  A failure while one of them is unfilled is ``not written yet``: a kernel whose
hole is a ``pass`` computes zeros, and "got 0, expected 0.83" would blame code nobody wrote.
"""

from __future__ import annotations

import re
from pathlib import Path

from kernels.loader import ROOT
from kernels.solution_file import LABEL

from grader import holes

_RANGE = re.compile(r"TODO\((\d+)([a-z])\) to TODO\(\1([a-z])\)")      # "TODO(2a) to TODO(2c)"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def labels(todo: str) -> set[str]:
    """The TODO labels ``todo`` names: "TODO(8a) and TODO(8c)", "TODO(2a) to TODO(2c)" (all three)."""
    found = set(LABEL.findall(todo or ""))
    for stage, first, last in _RANGE.findall(todo or ""):
        found |= {f"TODO({stage}{chr(c)})" for c in range(ord(first), ord(last) + 1)}
    return found


def unfilled(path, todo: str) -> list[tuple[str, int]]:
    """(label, current line) of each TODO named in ``todo`` that the file at ``path`` still holds as released."""
    path = Path(path)
    wanted = labels(todo)
    try:
        found = holes.unfilled_in(path.read_text(), path.name)
    except (OSError, SyntaxError, ValueError):
        return []
    return [(label, line) for label, line in found if label in wanted]


def waiting(stage, todo: str) -> str:
    """"not written yet: TODO(5a) (line 80), ... still as released in <file>" when a TODO named in
    ``todo`` is unchanged in ``stage``'s file, else "": a cell that times or draws a finished
    kernel asks this first, so an unfinished copy prints what is left instead of raising."""
    path = Path(stage.__file__)
    left = unfilled(path, todo)
    if not left:
        return ""
    return "not written yet: " + ", ".join(f"{label} (line {line})" for label, line in left) + \
        f" still as released in {_shown(path)}"


def checker(stage, todo: str = ""):
    """``check(what, run, todo=...)`` for the notebook of ``stage`` (the loaded stage module);
    ``todo`` here is the default for checks that name none."""

    def check(what: str, run, todo: str = todo) -> None:
        try:
            problems, raised = run(), None
        except Exception as exc:  # a learner's error is a verdict, not a crash
            problems, raised = [], exc
        if not problems and raised is None:
            print(f"{what}: passed")
            return
        left = waiting(stage, todo)
        if left:
            print(f"{what}: {left}")
            return
        if isinstance(raised, NotImplementedError):
            print(f"{what}: not written yet (NotImplementedError: {raised}); fill in {todo or 'its TODO'}")
            return
        if raised is not None:
            first = (str(raised).strip().splitlines() or [""])[0][:300]
            print(f"{what}: FAILED, it raised {type(raised).__name__}: {first}")
            return
        print(f"{what}: FAILED")
        for problem in problems:
            print("    " + problem)

    return check
