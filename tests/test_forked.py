"""grader/testing/forked.py: workers forked from a process that imported torch, for the slow
wrong-solution sweep, grade exactly as workers the runner starts itself (without isolation)."""

import types

from kernels.loader import ROOT

import pytest

from grader import stages
from grader.grade import grade_stage
from grader.isolation import choice
from grader.testing import forked, mutants

pytestmark = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="this copy of the workbook has no solutions/")
STAGE1 = next(s for s in stages.STAGES if s.name == "stage1")
CHECKS = ["softmax_awkward_lengths", "softmax_minus_inf", "attention_matches_reference"]


@pytest.fixture
def no_isolation(monkeypatch):
    monkeypatch.setenv("WORKBOOK_SEED", "5")           # the same inputs for every grading: the same messages
    monkeypatch.setenv(choice.ENV, "none")
    choice.choose.cache_clear()
    yield
    choice.choose.cache_clear()


def _graded(folder):
    result = grade_stage(STAGE1, str(folder), only=CHECKS)
    return [(r.name, r.status, r.message, r.diagnosis) for r in result.results]


@pytest.mark.parametrize("edits, statuses", [
    ([("l = l * torch.exp(m - m_safe) + torch.exp", "l = l + torch.exp")], {"pass", "FAIL"}),   # a check fails
    ([("    xf = x.float()\n", "    import os\n    os.kill(os.getpid(), 9)\n")], {"pass", "crash"}),   # it dies
    ([], {"pass"}),                                                                              # the reference
], ids=["wrong", "killed", "reference"])
def test_a_forked_worker_grades_as_a_started_one(tmp_path, no_isolation, edits, statuses):
    """Statuses, messages and diagnoses, check by check, are a started worker's, grading after grading."""
    folder = mutants.build(STAGE1, mutants.Mutant("m", "", edits=edits), tmp_path / "stages")
    started = _graded(folder)
    with forked.forked_workers():
        assert forked.choice.choose().name == "none"
        twice = [_graded(folder) for _ in range(2)]
    assert twice[0] == twice[1] == started, (started, twice)
    assert {status for _, status, _, _ in started} == statuses, started


def test_forked_workers_refuse_a_sandbox(monkeypatch):
    monkeypatch.setattr(forked.choice, "choose", lambda: types.SimpleNamespace(name="bubblewrap"))
    with pytest.raises(RuntimeError, match="WORKBOOK_ISOLATION=none"):
        with forked.forked_workers():
            pass


def test_only_a_workers_command_is_forked():
    assert forked._split(["python", "-m", "grader.isolation.child", "3", "4", "5"]) == ([], ["3", "4", "5"])
    wrapped = ["/bin/sh", "-c", "script", "enter-cgroup", "/cg/a", "/cg/b", "--",
               "python", "-m", "grader.isolation.child", "3", "4", "5"]
    assert forked._split(wrapped) == (["/cg/a", "/cg/b"], ["3", "4", "5"])
    assert forked._split(["nvcc", "-c", "x.cu"]) is None
    assert forked._split(["python", "-m", "grader.isolation.child", "3"]) is None
