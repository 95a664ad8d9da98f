"""``python -m grader batch``: a class of submissions, some broken, some hostile, graded whole.

One class of seven learners on stage 1, graded four times: interrupted after the first grading,
resumed to the end, run again (nothing left to grade), and run once more after one learner
changed their file (only theirs is graded again).
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time

from kernels import runtime
from kernels.loader import ROOT

import pytest

from grader import stages
from grader.publishing import release
from grader.testing import mutants

STAGE1 = stages.find("stage1")
FILE = f"{STAGE1.module}.py"
SOLUTION = (ROOT / "solutions" / FILE).read_text()
HIDDEN = {c.name for c in STAGE1.checks() if c.hidden}
MAX = sum(c.points for c in STAGE1.checks())
# Short, so that the learner who hangs costs little; on a GPU a worker's first check also pays for
# starting CUDA, which takes seconds on a busy machine.
CHECK_TIMEOUT = runtime.pick(cpu="5", gpu="30")


def _write(folder, text):
    folder.mkdir(parents=True)
    (folder / FILE).write_text(text)


def _edit(old, new):
    assert SOLUTION.count(old) == 1
    return SOLUTION.replace(old, new)


def _class(root):
    subs = root / "submissions"
    mutants.copy_solution(STAGE1, subs / "ada")                                       # right
    _write(subs / "bo" / "stages", _edit("1.0 / math.sqrt(D)", "1.0 / D"))             # a whole workbook, wrong scale
    _write(subs / "cy", release.rendered()[FILE])                                     # not started
    (subs / "di").mkdir()                                                             # handed in nothing
    _write(subs / "ed", _edit("import math\n", "import math\nwhile True:\n    pass\n"))  # hangs at import
    _write(subs / "fa", _edit("    xf = x.float()\n", "    import ctypes\n    ctypes.string_at(0)\n"))  # segfaults
    _write(subs / "gu", _edit("import math\n", f"import math\nexec(open({str(subs / 'ada' / FILE)!r}).read())\n"))
    return subs


def _sigint_as_usual():
    """In the child before it starts: SIGINT back to its default, so Python turns it into
    KeyboardInterrupt even when the tests run where SIGINT is ignored (a shell script's background
    job inherits it ignored, and Python keeps an ignored SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _batch(subs, out, *extra, **popen):
    cmd = [sys.executable, "-m", "grader", "batch", str(subs), "--stages", "stage1", "--out", str(out),
           "--check-timeout", CHECK_TIMEOUT, "--stage-timeout", "60", "--seed", "1234", *extra]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _gradebook(out):
    with open(out / "gradebook.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and list(rows[0]) == ["learner", "stage", "score", "max_score", "status", "seconds", "isolation",
                                      "submitted"]
    return {r["learner"]: r for r in rows}


@pytest.mark.slow
def test_a_class_is_graded_whole_resumed_and_regraded(tmp_path):
    subs, out = _class(tmp_path), tmp_path / "out"

    # 1. Interrupted once the first grading is in: the gradebook holds exactly what finished.
    proc = _batch(subs, out, "--jobs", "1", preexec_fn=_sigint_as_usual)
    deadline = time.monotonic() + 120
    while not list(out.glob("learners/*/stage1.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    done = {p.parent.name for p in out.glob("learners/*/stage1.json")}
    assert done and set(_gradebook(out)) == done
    assert not list(out.rglob("*.tmp")), "a temporary file was left behind"

    # 2. Resumed: only what was not done is graded; every learner ends with a row and a reason.
    proc = _batch(subs, out, "--jobs", "2")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    assert f"{7 - len(done)} to grade, {len(done)} already graded" in err
    book = _gradebook(out)
    assert set(book) == {"ada", "bo", "cy", "di", "ed", "fa", "gu"}
    assert all(r["max_score"] == str(MAX) for r in book.values())
    assert book["ada"]["score"] == str(MAX) and book["ada"]["status"] == "graded"
    assert 0 < int(book["bo"]["score"]) < MAX
    assert (book["cy"]["status"], book["cy"]["score"]) == ("not started", "0")
    assert (book["di"]["status"], book["di"]["score"]) == ("not started", "0")
    assert (book["ed"]["status"], book["ed"]["score"]) == ("import error", "0")
    assert book["fa"]["status"] == "graded" and int(book["fa"]["score"]) < MAX
    assert (book["gu"]["status"], book["gu"]["score"]) == ("import error", "0")   # may not read ada's file

    # Each learner's results.json is Gradescope's format, hidden checks folded into one line.
    for name in book:
        results = json.loads((out / "learners" / name / "results.json").read_text())
        assert results["score"] == int(book[name]["score"]) == sum(t["score"] for t in results["tests"])
        assert isinstance(results["execution_time"], int)
        assert all({"name", "score", "max_score", "output"} <= set(t) for t in results["tests"])
        text = json.dumps(results)
        assert not any(h in text for h in HIDDEN), f"{name}'s results.json names a hidden check"
    fa = json.loads((out / "learners" / "fa" / "results.json").read_text())["tests"]
    assert any("segmentation fault" in t["output"] and t["status"] == "failed" for t in fa)
    gu = json.loads((out / "learners" / "gu" / "stage1.json").read_text())["result"]["results"][0]["message"]
    assert "another submission" in gu
    ada = json.loads((out / "learners" / "ada" / "stage1.json").read_text())["result"]["results"]
    assert HIDDEN <= {r["name"] for r in ada}, "the instructor's record names every check"

    # 3. Run again: nothing to grade.
    proc = _batch(subs, out)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "0 to grade, 7 already graded" in err

    # 4. bo fixes their file: only bo is graded again.
    (subs / "bo" / "stages" / FILE).write_text(SOLUTION)
    proc = _batch(subs, out)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "1 to grade, 6 already graded" in err
    assert _gradebook(out)["bo"]["score"] == str(MAX)


def test_a_cell_a_spreadsheet_would_run_as_a_formula_is_written_as_text():
    """A learner's folder named like a formula must not run in the instructor's spreadsheet."""
    from grader import batch
    names = ["=HYPERLINK(\"http://x\",\"y\")", "+1+1", "-2", "@SUM(A1)", "\tx", "ada", "b=c"]
    text = batch._csv(("learner", "score"), [(name, 7) for name in names])
    rows = list(csv.reader(text.splitlines()))[1:]
    assert [r[0] for r in rows] == ["'" + n for n in names[:5]] + ["ada", "b=c"]
    assert all(r[1] == "7" for r in rows)
