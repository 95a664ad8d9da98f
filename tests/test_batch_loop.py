"""The instructor's batch loop: grades are never mixed, dropped or reused after the grader changed.

Tiny classes on stages 1 and 2 (a grading starts a worker, which costs seconds): a record names
what graded it and a resume grades again what no longer matches; ``--regrade``; a ``--seed`` that
is not the batch's is refused; grading a subset of stages keeps the others; a hanging function
costs only its own checks; max scores follow one rule; checks.csv; a learner whose folder name is
not UTF-8.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal

import pytest

from grader import batch, formats, stages
from grader.grade import grade_stage
from grader.publishing import release
from grader.limits import ENV, Limits
from grader.testing import mutants
from kernels import runtime
from kernels.loader import ROOT
from tests.test_batch import FILE, HIDDEN, MAX, SOLUTION, STAGE1, _edit, _write

STAGE2 = stages.find("stage2")
HERE_MAX2 = sum(c.points for c in STAGE2.checks() if runtime.ON_GPU or not c.gpu)   # stage 2's points that run here
SOFTMAX = {c.name: c.points for c in STAGE1.checks() if c.name.startswith("softmax")}
CAFE = os.fsdecode(b"caf\xe9")          # a folder name that is not UTF-8 (Latin-1, as an old zip tool writes it)


@pytest.fixture
def run_batch(capfd):
    """``python -m grader batch`` in this process (torch is imported once); returns (exit status, stderr)."""
    term = signal.getsignal(signal.SIGTERM)

    def go(subs, out, *args):
        from grader.__main__ import main
        capfd.readouterr()
        code = main(["batch", str(subs), "--out", str(out), *args])
        return code, capfd.readouterr().err
    yield go
    signal.signal(signal.SIGTERM, term)


def _rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def _book(out):
    rows = _rows(out / "gradebook.csv")
    assert rows and list(rows[0]) == list(batch.COLUMNS)
    return {(r["learner"], r["stage"]): r for r in rows}


def _record(out, learner, stage="stage1"):
    return json.loads((out / "learners" / learner / f"{stage}.json").read_text())


# -- one rule for max scores ------------------------------------------------------------------------------
@pytest.mark.skipif(runtime.ON_GPU, reason="on a GPU every check of stage 2 runs")
def test_a_stage_not_started_has_the_max_of_the_checks_that_run_here(tmp_path):
    result = grade_stage(STAGE2, str(tmp_path))                  # no file: not started, nothing runs
    assert result.status == "not started" and result.max_score == HERE_MAX2 < sum(c.points for c in STAGE2.checks())
    entry = formats.gradescope([(STAGE2, result)])["tests"]
    assert sum(t["max_score"] for t in entry) == HERE_MAX2


# -- a hang costs only its own checks ---------------------------------------------------------------------
def test_the_per_check_default_shares_out_the_stage():
    from grader.limits import CHECK_FLOOR
    n = len(STAGE1.checks())
    assert Limits(stage_timeout=600).for_stage(n, 1).call_timeout == round(600 / n, 1)   # 9 hangs fit in 600 s
    assert Limits(stage_timeout=600).for_stage(n, 3).call_timeout == 200.0      # run_check keeps 180 s, the check's own
    assert Limits(stage_timeout=20).for_stage(n, 1, gpu=True).call_timeout == CHECK_FLOOR["gpu"]
    assert Limits(check_timeout=7).for_stage(n, 1) == Limits(check_timeout=7)        # a limit given is kept


def test_a_worker_restart_is_not_charged_to_the_next_check():
    """Under --check-timeout, the check after a crash or hang pays no worker start (importing torch, seconds
    on a busy machine): a 3 s start and a 2 s per-check limit still leave the check its 2 s."""
    import time

    from grader.check import Check
    from grader.grade import run_check

    class Runner:                          # the worker's side of grader.worker.Runner, started as it starts
        stage, source, last_call = STAGE1.module, "solutions", None
        _proc = None

        def _start(self, timeout):
            time.sleep(3.0)
            self._proc = object()

        def call(self, fn_name, *args, timeout, **kwargs):
            if self._proc is None:
                self._start(timeout)
            return 1.0

        def output_tail(self, limit):
            return ""

    def two_calls(ctx):
        ctx.learner.online_softmax(0.0)
        ctx.learner.online_softmax(1.0)

    check = Check("two_calls", two_calls, points=1)
    r = run_check(check, Runner(), 0, deadline=time.monotonic() + 60, limits=Limits(check_timeout=2))
    assert (r.status, r.earned) == ("pass", 1), r.message
