"""The grader itself: release, "not started", and learner code that crashes, hangs or is unfinished."""

import subprocess
import sys

from kernels import solution_file
from kernels.loader import ROOT

import pytest

from grader import stages
from grader.grade import grade_stage
from grader.publishing import release
from grader.testing.mutants import copy_solution

STAGE1 = stages.find("stage1")
SOLUTION = (ROOT / "solutions" / f"{STAGE1.module}.py").read_text()


# Stage 1 with an online_softmax that aborts on rows of length 1 and never returns on rows of 300.  It
# sleeps rather than spins: what the tests below prove is that the call's limit ends it and grading
# goes on (test_faults.py times out a spinning one); a spinning hang would take a core from every
# other test for as long as the limit.  That limit is the whole check's: the other checks' calls
# take a fraction of a second, and a worker's restart is not charged to them.
CRASH_OR_HANG = ("    import os, time\n    if x.shape[-1] == 1: os.abort()\n    if x.shape[-1] == 300: \n"
                 "        while True: time.sleep(60)\n    xf = x.float()\n")
HANG_TIMEOUT = "10"


def _submission(tmp_path, old, new):
    folder = copy_solution(STAGE1, tmp_path / "sub")
    path = folder / f"{STAGE1.module}.py"
    assert SOLUTION.count(old) == 1
    path.write_text(SOLUTION.replace(old, new))
    return folder


def test_render_replaces_solution_blocks_and_keeps_todos():
    text = "def f():\n    # TODO: add\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n" \
           "# BEGIN SOLUTION stub=\nprint('demo')\n# END SOLUTION\n" \
           "    # BEGIN SOLUTION stub=pass\n    x = 1\n    # END SOLUTION\n"
    out = solution_file.render(text, "s.py")
    assert "# TODO: add" in out and "return 1" not in out and "demo" not in out
    assert 'raise NotImplementedError("s.py: the TODO above is not written yet")' in out
    labelled = solution_file.render("def f():\n    # TODO(1a): add\n    # BEGIN SOLUTION\n    return 1\n"
                                    "    # END SOLUTION\n", "s.py")
    assert 'raise NotImplementedError("s.py: TODO(1a) is not written yet")' in labelled
    assert out.rstrip().endswith("    pass")
    with pytest.raises(solution_file.MarkerError, match="never closed"):
        solution_file.render("# BEGIN SOLUTION\nx\n", "s.py")


def test_release_keeps_learner_edits_and_force_keeps_a_backup(tmp_path):
    stages_dir = tmp_path / "stages"
    release.release(stages=stages_dir, log=lambda *_: None)
    assert release.check(stages=stages_dir) == []
    learner = stages_dir / f"{STAGE1.module}.py"
    learner.write_text(learner.read_text() + "\n# my work\n")
    kept = release.release(stages=stages_dir, log=lambda *_: None)
    assert kept == 1 and learner.read_text().endswith("# my work\n")
    assert release.check(stages=stages_dir) == [learner.name]
    release.release(stages=stages_dir, force=True, log=lambda *_: None)
    backups = list((stages_dir / ".backup").iterdir())
    assert len(backups) == 1 and backups[0].read_text().endswith("# my work\n")
    assert release.check(stages=stages_dir) == []


def test_released_stages_are_in_sync_and_untouched_files_are_not_started():
    assert release.check() == [], "run: python -m grader release"
    for stage in stages.STAGES:
        result = grade_stage(stage, "stages")
        assert result.status == "not started", f"{stage.name}: {result.status}"
        assert result.score == 0 and not result.ok


def test_unfinished_code_is_todo_and_wrong_code_fails(tmp_path):
    folder = _submission(tmp_path, "        m = m_new\n        # END SOLUTION",
                         "        raise NotImplementedError('TODO(1a)')\n        # END SOLUTION")
    result = grade_stage(STAGE1, str(folder), only=["softmax_awkward_lengths", "attention_matches_reference"])
    status = {r.name: r.status for r in result.results}
    assert status == {"softmax_awkward_lengths": "todo", "attention_matches_reference": "pass"}
    assert not result.ok


def test_crash_and_hang_fail_their_check_and_grading_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBOOK_CHECK_TIMEOUT", HANG_TIMEOUT)
    folder = _submission(tmp_path, "    xf = x.float()\n", CRASH_OR_HANG)
    result = grade_stage(STAGE1, str(folder),
                         only=["softmax_awkward_lengths", "softmax_large_values", "attention_matches_reference"])
    status = {r.name: (r.status, r.message) for r in result.results}
    assert status["softmax_awkward_lengths"][0] == "crash" and "abort" in status["softmax_awkward_lengths"][1]
    assert status["softmax_large_values"][0] == "timeout"
    assert status["attention_matches_reference"][0] == "pass"


def test_import_error_is_reported_for_every_check(tmp_path):
    folder = _submission(tmp_path, "import math\n", "import math\ndef broken(:\n")
    result = grade_stage(STAGE1, str(folder))
    assert result.status == "import error"
    assert all(r.status == "crash" and "SyntaxError" in r.message for r in result.results)


def test_cli_lists_stages_for_an_unknown_name_and_exit_codes():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "grader", *args], cwd=ROOT, capture_output=True, text=True)

    bad = run("stage42")
    assert bad.returncode == 2 and "stage1 (stage1_online_softmax)" in bad.stderr
    good = run("stage1", "--solutions", "--only", "softmax_float16")
    assert good.returncode == 0 and "pass" in good.stdout
    assert run("release", "--check").returncode == 0


def test_two_workers_take_the_checks_in_turn_and_report_them_in_order(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBOOK_CHECK_TIMEOUT", HANG_TIMEOUT)
    folder = _submission(tmp_path, "    xf = x.float()\n", CRASH_OR_HANG)
    names = ["softmax_awkward_lengths", "softmax_large_values", "attention_matches_reference", "softmax_float16"]
    shown = []
    result = grade_stage(STAGE1, str(folder), only=names, jobs=2, on_result=lambda r: shown.append(r.name))
    in_order = [c.name for c in STAGE1.checks() if c.name in names]
    assert result.workers == 2 and [r.name for r in result.results] == shown == in_order
    status = {r.name: (r.status, r.message) for r in result.results}
    assert status["softmax_awkward_lengths"][0] == "crash" and "abort" in status["softmax_awkward_lengths"][1]
    assert status["softmax_large_values"][0] == "timeout"
    assert status["attention_matches_reference"][0] == "pass" and status["softmax_float16"][0] == "pass"


def test_an_import_error_is_reported_once_with_several_workers(tmp_path):
    folder = _submission(tmp_path, "import math\n", "import math\ndef broken(:\n")
    result = grade_stage(STAGE1, str(folder), jobs=3)
    assert result.status == "import error" and len(result.results) == len(STAGE1.checks())
    assert len({r.message for r in result.results}) == 1 and "SyntaxError" in result.results[0].message


def test_workbook_jobs_must_be_a_positive_whole_number(monkeypatch):
    from grader.grade import default_jobs
    monkeypatch.setenv("WORKBOOK_JOBS", "3")
    assert default_jobs() == 3
    monkeypatch.setenv("WORKBOOK_JOBS", "0")
    with pytest.raises(ValueError, match="WORKBOOK_JOBS"):
        default_jobs()


def test_a_grading_starts_the_checks_that_took_longest_last_time_first(tmp_path, monkeypatch):
    from grader import grade
    from grader.check import Check
    monkeypatch.setattr(grade, "DURATIONS", tmp_path / "durations.json")
    checks = STAGE1.checks()
    names = [c.name for c in checks]
    assert grade._longest_first(STAGE1, checks) == list(range(len(checks)))   # nothing recorded: as listed
    # The second-to-last check took longest and the first none at all; unrecorded checks come first.
    grade._remember_durations(STAGE1, [grade.CheckResult(n, 1, 1, "pass", "") for n in names[:-1]],
                              {i: 0.1 * i if i != len(names) - 2 else 50.0 for i in range(len(names) - 1)})
    order = grade._longest_first(STAGE1, checks)
    assert order[:2] == [len(names) - 1, len(names) - 2] and order[-1] == 0
    assert sorted(order) == list(range(len(checks)))

    # _run_checks takes them in that order and still reports them in the checks' own order.
    started, shown = [], []

    class Runner:
        start_seconds = 0.0
        compile_seconds = 0.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def run_check(check, runner, seed, **kwargs):
        started.append(check.name)
        runner.start_seconds += 2.0 if len(started) == 1 else 0.0        # the first check starts the worker
        runner.compile_seconds += 1.5 if check.name == "c3" else 0.0      # and c3 compiles kernels
        return grade.CheckResult(check.name, check.points, check.points, "pass", "", seconds=3.0)

    monkeypatch.setattr(grade, "run_check", run_check)
    few = [Check(name=f"c{i}", fn=None) for i in range(4)]
    spent = {}
    results, failed = grade._run_checks(few, Runner, 0, float("inf"), grade.Limits.from_env(), 1,
                                        lambda r: shown.append(r.name), "m", order=[2, 0, 3, 1], spent=spent)
    assert failed is None and started == [few[i].name for i in (2, 0, 3, 1)]
    assert shown == [r.name for r in results] == [c.name for c in few]
    assert spent == {2: 1.0, 0: 3.0, 3: 1.5, 1: 3.0}       # nor the worker's start nor compiling is the check's own


def test_workers_count_the_seconds_triton_spends_compiling(monkeypatch):
    """A worker adds up Triton's compile times (not cache hits) and passes each event on to a listener
    set before it; the grader takes the count from each reply and refuses a reply it did not ask for."""
    import triton

    from grader.isolation import child, outcomes
    from grader.isolation.limits import Limits
    from grader.isolation.runner import Runner
    if not hasattr(getattr(triton, "knobs", None), "compilation"):
        pytest.skip("this Triton has no compile listener")
    from triton.knobs import CompileTimes
    seen = []
    monkeypatch.setattr(triton.knobs.compilation, "listener", lambda **event: seen.append(event["cache_hit"]))
    seconds = child._count_compiles()
    times = CompileTimes(ir_initialization=250_000, lowering_stages=[("ttir", 500_000), ("cubin", 1_000_000)],
                         store_results=250_000)
    triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=times, cache_hit=False)
    triton.knobs.compilation.listener(src=None, metadata={}, metadata_group={}, times=times, cache_hit=True)
    assert seconds == [2.0] and seen == [False, True]

    runner = Runner.__new__(Runner)
    runner._proc, runner.compile_seconds, runner.limits = object(), 0.0, Limits()
    runner._send = lambda data, deadline, timeout: None
    for reply, outcome in [(("ok", 7, 1.25), 7), (("ok", 7, -3.0), 7), (("ok", 7), outcomes.Misbehaved),
                           (("error", "E", "m", "tb"), outcomes.Misbehaved), ("ok", outcomes.Misbehaved)]:
        runner._receive = lambda deadline, timeout, cap, reply=reply: bytearray(child._pack(reply))
        if outcome is outcomes.Misbehaved:
            with pytest.raises(outcomes.Misbehaved, match="a reply it did not ask for"):
                runner.call("f")
        else:
            assert runner.call("f") == outcome
    assert runner.compile_seconds == 1.25                  # a negative count is not believed
