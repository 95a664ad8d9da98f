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

from kernels import runtime
from kernels.loader import ROOT

import pytest

from grader import batch, formats, stages
from grader.grade import grade_stage
from grader.isolation.limits import ENV, Limits
from grader.publishing import release
from grader.testing import mutants
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


# -- what graded a record: a resume grades again what no longer matches; --regrade; the batch's seed ------
def test_the_checks_digest_covers_a_hidden_check_added(tmp_path):
    for rel in ["grader/checks/stage1.py", "grader/checks/attention.py", *batch.GRADING_SOURCES]:
        if (ROOT / rel).exists():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, tmp_path / rel)
    before = batch.checks_digest(STAGE1, tmp_path)
    assert batch.checks_digest(STAGE1, tmp_path) == before              # the same sources, the same digest
    hidden = tmp_path / "grader" / "checks" / "hidden" / "stage1.py"
    hidden.parent.mkdir(parents=True)
    hidden.write_text("@check(points=2, hidden=True)\ndef another(ctx):\n    pass\n")
    added = batch.checks_digest(STAGE1, tmp_path)
    assert added != before
    hidden.write_text("@check(points=3, hidden=True)\ndef another(ctx):\n    pass\n")
    assert batch.checks_digest(STAGE1, tmp_path) not in (before, added)
    (tmp_path / "grader" / "checks" / "attention.py").write_text("# a shared helper changed\n")
    assert batch.checks_digest(STAGE1, tmp_path) != before


@pytest.mark.slow
def test_a_resume_regrades_what_no_longer_matches(tmp_path, run_batch):
    subs, out = tmp_path / "subs", tmp_path / "out"
    for name in ("cy", "di"):                 # not started: a grading that starts no worker, quick to make
        _write(subs / name, release.rendered()[FILE])
    seed = ["--stages", "stage1", "--seed", "1234", "--stage-timeout", "120"]

    code, err = run_batch(subs, out, *seed)
    assert code == 0 and "2 to grade, 0 already graded" in err, err
    made = _record(out, "cy")["fingerprint"]
    assert made["seed"] == 1234 and made["checks"] == batch.checks_digest(STAGE1)
    assert made["limits"]["stage_timeout"] == 120 and made["grader"] == batch.version() != "unknown"

    # A record that other checks made (before a hidden check was added) is graded again; the other stays.
    record = _record(out, "cy")
    record["fingerprint"]["checks"] = "0" * 64
    record["result"]["results"] = record["result"]["results"][:-1]       # one check fewer, as it was then
    (out / "learners" / "cy" / "stage1.json").write_text(json.dumps(record))
    code, err = run_batch(subs, out, *seed)
    assert code == 0 and "1 to grade, 1 already graded" in err, err
    assert "1 (the checks or the code that runs them changed)" in err, err
    assert _book(out)[("cy", "stage1")]["max_score"] == str(MAX)
    assert _record(out, "cy")["fingerprint"]["checks"] == batch.checks_digest(STAGE1)

    # Another per-check limit: every record is graded again under it.
    code, err = run_batch(subs, out, *seed, "--check-timeout", "30")
    assert code == 0 and "2 to grade, 0 already graded" in err and "2 (other limits)" in err, err
    assert _record(out, "di")["fingerprint"]["limits"]["check_timeout"] == 30

    # --regrade: one learner's stage, whatever its record says; a learner or stage not in the batch is refused.
    kept = _record(out, "cy")["seconds"]
    (out / "learners" / "di" / "stage1.json").write_text(json.dumps(dict(_record(out, "di"), seconds=-1.0)))
    code, err = run_batch(subs, out, *seed, "--check-timeout", "30", "--regrade", "di/stage1")
    assert code == 0 and "1 to grade, 1 already graded" in err and "1 (--regrade)" in err, err
    assert _record(out, "di")["seconds"] >= 0 and _record(out, "cy")["seconds"] == kept
    assert set(_book(out)) == {("cy", "stage1"), ("di", "stage1")} and _book(out)[("di", "stage1")]["seconds"] != "-1.0"
    code, err = run_batch(subs, out, *seed, "--check-timeout", "30", "--regrade", "cy")       # every stage of one
    assert code == 0 and "1 to grade, 1 already graded" in err and "1 (--regrade)" in err, err
    code, err = run_batch(subs, out, *seed, "--check-timeout", "30", "--regrade", "nobody")
    assert code == 2 and "--regrade 'nobody'" in err and "cy, di" in err, err
    code, err = run_batch(subs, out, *seed, "--check-timeout", "30", "--regrade", "di/stage2")
    assert code == 2 and "stage2 is not among --stages" in err, err


@pytest.mark.slow
def test_another_seed_is_refused_without_regrade_all(tmp_path, run_batch):
    subs, out = tmp_path / "subs", tmp_path / "out"
    _write(subs / "cy", release.rendered()[FILE])
    code, err = run_batch(subs, out, "--stages", "stage1", "--seed", "1234")
    assert code == 0, err
    _write(subs / "late", release.rendered()[FILE])         # handed in late: the class's inputs, or none

    before = {p: p.read_bytes() for p in out.rglob("*.json")}
    code, err = run_batch(subs, out, "--stages", "stage1", "--seed", "99")
    assert code == 2 and "--seed 99 is not this batch's seed (1234" in err and "--regrade all" in err, err
    assert {p: p.read_bytes() for p in out.rglob("*.json")} == before and not (out / "learners" / "late").exists()
    code, err = run_batch(subs, out, "--stages", "stage1")                      # the batch's own seed
    assert code == 0 and "1 to grade, 1 already graded" in err, err
    assert _record(out, "late")["result"]["seed"] == 1234

    code, err = run_batch(subs, out, "--stages", "stage1", "--seed", "99", "--regrade", "all")
    assert code == 0 and "2 to grade, 0 already graded" in err and "from 1234 to 99" in err, err
    assert json.loads((out / "batch.json").read_text())["seed"] == 99
    assert {_record(out, n)["result"]["seed"] for n in ("cy", "late")} == {99}
    assert set(_book(out)) == {("cy", "stage1"), ("late", "stage1")}
    assert all((out / "learners" / n / "results.json").is_file() for n in ("cy", "late"))


# -- a subset merges; one rule for max scores; checks.csv; submission times; a name that is not UTF-8 ---
@pytest.mark.slow
def test_grading_a_subset_keeps_the_other_stages_and_max_scores_agree(tmp_path, run_batch):
    subs, out = tmp_path / "subs", tmp_path / "out"
    mutants.copy_solution(STAGE1, subs / "ada")
    mutants.copy_solution(STAGE2, subs / "ada")
    os.utime(subs / "ada" / FILE, (1_700_000_000, 1_700_000_000))
    _write(subs / "cy", SOLUTION)                            # stage 1 done, stage 2 not started
    odd = os.path.join(os.fsencode(subs), os.fsencode(CAFE))  # stage 1 not started, under an odd name
    os.makedirs(odd)
    with open(os.path.join(odd, os.fsencode(FILE)), "w") as f:
        f.write(release.rendered()[FILE])
    label = formats.learner_label(CAFE)
    assert label == "caf\\xe9"

    common = ["--seed", "7", "--stage-timeout", "120", "--jobs", "2"]
    code, err = run_batch(subs, out, "--stages", "stage1", *common)
    assert code == 0, err
    assert set(_book(out)) == {("ada", "stage1"), ("cy", "stage1"), (label, "stage1")}
    code, err = run_batch(subs, out, "--stages", "stage2", *common)
    assert code == 0 and "3 to grade, 0 already graded" in err, err

    book = _book(out)
    assert set(book) == {(n, s) for n in ("ada", "cy", label) for s in ("stage1", "stage2")}
    assert book[("ada", "stage1")]["score"] == book[("cy", "stage1")]["score"] == str(MAX)
    assert book[("ada", "stage2")]["score"] == str(HERE_MAX2)
    assert book[("cy", "stage2")]["status"] == book[(label, "stage1")]["status"] == "not started"
    # The same max for every learner, graded or not started: the points that can run on this machine.
    assert book[("ada", "stage2")]["max_score"] == book[("cy", "stage2")]["max_score"] == str(HERE_MAX2)
    for name in ("ada", "cy", CAFE):
        results = json.loads((out / "learners" / name / "results.json").read_text())
        assert results["extra_data"]["stages"] == ["stage1", "stage2"]
        assert sum(t["max_score"] for t in results["tests"]) == MAX + HERE_MAX2, name
    assert json.loads((out / "learners" / "ada" / "results.json").read_text())["score"] == MAX + HERE_MAX2
    assert book[("ada", "stage1")]["submitted"] == _record(out, "ada")["submitted"] == "2023-11-14T22:13:20Z"

    # checks.csv: a row per check of every graded stage, adding up to the gradebook.
    checks = _rows(out / "checks.csv")
    assert list(checks[0]) == list(batch.CHECK_COLUMNS)
    for (name, stage), row in book.items():
        mine = [c for c in checks if (c["learner"], c["stage"]) == (name, stage)]
        assert len(mine) == len(stages.find(stage).checks())
        assert sum(int(c["points"]) for c in mine) == int(row["score"])
        assert sum(int(c["max_points"]) for c in mine) == int(row["max_score"])
    assert HIDDEN <= {c["check"] for c in checks if c["stage"] == "stage1"}   # the instructor's file names them
    if not runtime.ON_GPU:
        gpu = [c for c in checks if c["learner"] == "cy" and c["stage"] == "stage2" and c["status"] == "not run"]
        assert len(gpu) == sum(c.gpu for c in STAGE2.checks()) and all(c["max_points"] == "0" for c in gpu)

    # Run again: nothing to grade, and the odd name keeps its one label.
    code, err = run_batch(subs, out, "--stages", "stage1,stage2", *common)
    assert code == 0 and "0 to grade, 6 already graded" in err, err
    assert set(_book(out)) == set(book)
    # A learner missing from next week's submissions keeps the grades already given.
    shutil.rmtree(subs / "cy")
    code, err = run_batch(subs, out, "--stages", "stage2", *common)
    assert code == 0 and "0 to grade, 2 already graded" in err, err
    assert set(_book(out)) == set(book)


@pytest.mark.skipif(runtime.ON_GPU, reason="on a GPU every check of stage 2 runs")
def test_a_stage_not_started_has_the_max_of_the_checks_that_run_here(tmp_path):
    result = grade_stage(STAGE2, str(tmp_path))                  # no file: not started, nothing runs
    assert result.status == "not started" and result.max_score == HERE_MAX2 < sum(c.points for c in STAGE2.checks())
    entry = formats.gradescope([(STAGE2, result)])["tests"]
    assert sum(t["max_score"] for t in entry) == HERE_MAX2


# -- a hang costs only its own checks ---------------------------------------------------------------------
@pytest.mark.slow
def test_a_hanging_function_costs_only_its_own_checks(tmp_path, run_batch, monkeypatch):
    subs, out = tmp_path / "subs", tmp_path / "out"
    # online_softmax never returns.  It sleeps rather than spins (test_faults.py times out a spinning
    # function): what is shown here is how the stage's time is shared, and a spinning hang would take
    # a core from every other test for as long as the four checks wait.
    _write(subs / "hy", _edit("    xf = x.float()\n", "    import time\n    while True:\n        time.sleep(60)\n"))
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)                        # the limits' defaults...
    # ...but for the stage's, scaled down so the hangs cost seconds: each check's share is a ninth of it
    # (10 s on a CPU, twice the CPU floor), the four softmax checks hang for theirs, and the attention
    # checks still have the rest, 50 s, for five worker starts and well under a second of calls each.
    code, err = run_batch(subs, out, "--stages", "stage1", "--seed", "5", "--jobs", "1",
                          "--stage-timeout", runtime.pick(cpu="90", gpu="600"))
    assert code == 0, err
    hy = _book(out)[("hy", "stage1")]
    assert hy["status"] == f"timeout ({len(SOFTMAX)} checks timed out)", hy
    assert hy["score"] == str(MAX - sum(SOFTMAX.values())), hy          # every attention check's points
    checks = {c["check"]: c for c in _rows(out / "checks.csv") if c["learner"] == "hy"}
    assert {n for n, c in checks.items() if c["status"] == "timeout"} == set(SOFTMAX)
    assert all(c["status"] == "pass" for n, c in checks.items() if n not in SOFTMAX)


def test_the_per_check_default_shares_out_the_stage():
    from grader.isolation.limits import CHECK_FLOOR
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

    class Runner:                          # the worker's side of isolation.runner.Runner, started as it starts
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


def test_no_learner_path_on_a_grading_s_command_line(tmp_path, run_batch, monkeypatch):
    """Every local user can read a process's command line (/proc/PID/cmdline), only its own user its
    environment: a batch names the learner's folder and the record's path in the environment alone."""
    import subprocess
    seen = []
    real = subprocess.Popen

    def recording(cmd, *args, **kwargs):
        seen.append((list(cmd), dict(kwargs.get("env") or {})))
        return real(cmd, *args, **kwargs)
    monkeypatch.setattr(batch.subprocess, "Popen", recording)
    subs, out = tmp_path / "subs", tmp_path / "out"
    _write(subs / "ada", SOLUTION)
    code, err = run_batch(subs, out, "--stages", "stage1", "--jobs", "1")
    assert code == 0, err
    assert seen, "the batch started no grading process"
    for cmd, env in seen:
        assert not any(str(subs) in part or str(out) in part for part in cmd), cmd
        assert env.get("WORKBOOK_BATCH_SUBMISSION", "").endswith("ada") and env.get("WORKBOOK_BATCH_OUT")
    assert _book(out)[("ada", "stage1")]["score"] == _book(out)[("ada", "stage1")]["max_score"]
