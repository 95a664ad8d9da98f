"""Every stage's deliberately wrong solutions (tests/wrong/stageN.py) must be rejected by its checks.

The first of each stage is graded as a learner's file is, in the sandbox.  The rest (``-m slow``)
test the checks, not the sandbox, so their workers are forked from a process that imported torch
once (grader/testing/forked.py), without isolation: starting a worker of its own was most of
their time.
"""

import importlib.util
from pathlib import Path

from kernels import runtime

import pytest

from grader import stages
from grader.grade import grade_stage
from grader.isolation import choice
from grader.testing import forked, mutants

WRONG = Path(__file__).parent / "wrong"


def _mutants():
    for stage in stages.STAGES:
        path = WRONG / f"{stage.name}.py"
        if not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(f"wrong_{stage.name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for i, m in enumerate(module.MUTANTS):
            # The first of each stage runs in the quick run; the rest with -m slow (CI runs both).
            yield pytest.param(stage, m, id=f"{stage.name}-{m.name}", marks=[pytest.mark.slow] if i else [])


def test_every_stage_has_three_wrong_solutions():
    for stage in stages.STAGES:
        count = sum(1 for p in _mutants() if p.values[0] is stage)
        assert count >= 3, f"{stage.name} has {count} wrong solutions in tests/wrong/; expected at least 3"


def test_diagnosed_wrong_solutions_name_a_known_cause():
    from grader import diagnose
    named = [(p.values[1].name, p.values[1].diagnosis) for p in _mutants() if p.values[1].diagnosis]
    assert len(named) >= 40, f"only {len(named)} wrong solutions name the diagnosis they must get"
    unknown = [(n, d) for n, d in named if d not in diagnose.CAUSES]
    assert not unknown, f"diagnoses that grader.diagnose.CAUSES does not know: {unknown}"


@pytest.fixture
def workers(request, monkeypatch):
    """The sandbox for the quick run's wrong solutions; forked workers without one for the rest."""
    if request.node.get_closest_marker("slow") is None:
        yield
        return
    monkeypatch.setenv(choice.ENV, "none")
    choice.choose.cache_clear()
    try:
        with forked.forked_workers():
            yield
    finally:
        choice.choose.cache_clear()


@pytest.mark.parametrize("stage,mutant", list(_mutants()))
def test_wrong_solution_is_rejected(stage, mutant, tmp_path, monkeypatch, workers):
    monkeypatch.setenv("WORKBOOK_STRICT_DIAGNOSIS", "1")     # a diagnosis that fails to compute fails the test
    names = {c.name for c in stage.checks()}
    assert mutant.caught_by and set(mutant.caught_by) <= names, \
        f"mutant {mutant.name} must name the checks that catch it, from {sorted(names)}"
    folder = mutants.build(stage, mutant, tmp_path / "stages")
    result = grade_stage(stage, str(folder), only=mutant.caught_by)
    if all(r.status == "not run" for r in result.results):
        pytest.skip("the checks that catch this mutant need a CUDA GPU")
    # caught_by names the checks that catch the mutant.  On a CPU every one of them that runs must
    # reject it.  On a GPU the small-shape checks run with the GPU's large tiles, where a mutant
    # can hide inside one tile; there the real-size checks it names must catch it instead.
    rejected = [r.name for r in result.results if r.status not in ("pass", "not run")]
    passed = [r.name for r in result.results if r.status == "pass"]
    missed = passed if not runtime.ON_GPU else ([] if rejected else passed)
    assert not missed, f"{mutant.name} ({mutant.why}) passed {missed}: those checks cannot tell it is wrong"
    # The diagnosis it names is the first cause given by a check that rejects it (or one these inputs
    # cannot tell from it), and no rejecting check blames another cause.
    failed = [r for r in result.results if r.status == "FAIL"]
    if mutant.diagnosis and failed:
        named = [r for r in failed if mutant.diagnosis in [r.diagnosis, *r.also]]
        blamed = [(r.name, r.diagnosis) for r in failed if r.diagnosis and r not in named]
        assert named, f"{mutant.name}: no check diagnosed {mutant.diagnosis!r}: " + \
            "; ".join(f"{r.name}: {r.diagnosis or 'no diagnosis'}" for r in failed)
        assert not blamed, f"{mutant.name} ({mutant.why}) was blamed on {blamed}, not {mutant.diagnosis!r}"
    elif not mutant.diagnosis and not runtime.ON_GPU:     # GPU-only mutants are named from a GPU run
        blamed = [(r.name, r.diagnosis) for r in failed if r.diagnosis]
        assert not blamed, f"{mutant.name} ({mutant.why}) names no diagnosis but got {blamed}: name it"
