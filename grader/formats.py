"""Grades as data: Gradescope's results.json, and the grader's own JSON.

``python -m grader stage5,stage6 --format gradescope`` is what a learner (or Gradescope) sees:
one test per check, named ``stage5 / check_name``, with its status and teaching message, and
each stage's hidden checks folded into one entry, "k hidden checks: x/y points".  A check that
needs a GPU on a machine without one is listed with ``max_score`` 0 and no status: it neither
passed nor failed, and its points are in no max score here (a stage not started included: its one
entry's ``max_score`` is the points that run here, as for a learner who handed in their work).
The format: https://gradescope-autograders.readthedocs.io/en/latest/specs/

``--format json`` is everything, hidden checks by name included: the instructor's record (a
learner's own machine has no hidden checks to show).  ``python -m grader batch`` reads it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from grader.results import StageResult, hidden_summary
from grader.stages import Stage


def learner_label(name: str) -> str:
    """A learner's folder name as text that any file can hold: a name that is not UTF-8 (``os.fsdecode``
    keeps its bytes as surrogates) has each such byte written ``\\xNN``, and a backslash is doubled, so
    two folders never get the same label and a folder keeps its label from one run to the next."""
    raw = os.fsencode(name).replace(b"\\", b"\\\\")
    return raw.decode("utf-8", errors="backslashreplace")


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    try:
        with open(tmp, "x") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def detail(graded: list[tuple[Stage, StageResult]]) -> dict:
    """The grader's JSON: every stage's result, every check by name."""
    return {"score": sum(r.score for _, r in graded), "max_score": sum(r.max_score for _, r in graded),
            "stages": [dict(r.to_dict(), title=s.title, module=s.module) for s, r in graded]}


def _test(stage: Stage, r) -> dict:
    entry = {"name": f"{stage.name} / {r.name}", "score": r.earned, "max_score": r.points,
             "output": r.status if not r.message else f"{r.status}: {r.message}", "visibility": "visible"}
    if r.status == "not run":
        entry.update(name=entry["name"] + " (not run: needs a CUDA GPU)", max_score=0)
    else:
        entry["status"] = "passed" if r.status == "pass" else "failed"
    return entry


def gradescope(graded: list[tuple[Stage, StageResult]], notes: list[str] = ()) -> dict:
    """Gradescope's results.json for these stages; hidden checks are counted, never named."""
    tests, lines = [], []
    for stage, result in graded:
        hidden = hidden_summary(result.results) if result.status != "not started" else ""
        if result.status == "not started":
            missing = any("does not exist" in r.message for r in result.results)
            tests.append({"name": f"{stage.name}: not started", "score": 0, "max_score": result.max_score,
                          "status": "failed", "visibility": "visible",
                          "output": f"{stage.module}.py {'is not in the submission' if missing else 'is as released'}"
                                    ": fill in its TODOs first."})
        elif result.status == "import error" and result.results:     # one cause: shown once, not once per check
            tests.append({"name": f"{stage.name}: does not import", "score": 0, "max_score": result.max_score,
                          "status": "failed", "visibility": "visible",
                          "output": f"{result.results[0].message}\nNone of its {len(result.results)} checks ran."})
        else:
            tests += [_test(stage, r) for r in result.results if not r.hidden]
            if hidden:
                earned = sum(r.earned for r in result.results if r.hidden)
                points = sum(r.points for r in result.results if r.hidden and r.status != "not run")
                tests.append({"name": f"{stage.name} / hidden checks", "score": earned, "max_score": points,
                              "status": "passed" if earned == points else "failed", "output": hidden,
                              "visibility": "visible"})
        line = f"{stage.name} ({stage.title}): {result.score}/{result.max_score} points, {result.status}"
        lines.append(line + (f"; {hidden}" if hidden else ""))
    seeds = sorted({r.seed for _, r in graded})
    lines.append(f"Inputs seed {', '.join(map(str, seeds))}: WORKBOOK_SEED=<seed> repeats them. "
                 f"Graded on {graded[0][1].device if graded else 'this machine'}.")
    lines += list(notes)
    isolation = sorted({r.isolation for _, r in graded if r.isolation})
    if isolation:
        lines.append(f"Learner code isolated by: {', '.join(isolation)}.")
    return {"score": sum(r.score for _, r in graded),
            "execution_time": round(sum(r.seconds for _, r in graded)),
            "output": "\n".join(lines), "visibility": "visible", "stdout_visibility": "hidden",
            "tests": tests, "extra_data": {"stages": [s.name for s, _ in graded], "seeds": seeds,
                                            "isolation": isolation}}


def gradescope_failure(reason: str, notes: list[str] = ()) -> dict:
    """Gradescope's results.json when the grader itself failed: an ``output`` that says so and why, and
    neither a score nor tests, so that no grade comes of it (Gradescope takes the score from the top-level
    ``score`` or from every test's)."""
    reason = reason if len(reason) <= 2000 else reason[:2000] + " ..."
    lines = ["The autograder failed, so this submission was not graded: this is not your score. "
             "Your course staff can see what went wrong; submit again once they say it is fixed.",
             f"What failed: {reason}", *notes]
    return {"output": "\n".join(lines), "visibility": "visible", "stdout_visibility": "hidden",
            "extra_data": {"autograder_failed": True, "reason": reason}}
