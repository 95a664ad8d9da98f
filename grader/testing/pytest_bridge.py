"""pytest as a front end onto the grader's checks.

``tests/test_stage3.py`` is two lines::

    from grader.testing.pytest_bridge import stage_tests
    test_check = stage_tests("stage3")

Each check becomes one pytest test, run exactly as ``python -m grader stage3`` runs it: learner
code in a worker process, inputs, reference and comparison in this one.  Which copy is tested
follows ``--source``: the learner's stages/ by default.  This module is also the pytest
plugin that adds that option (pyproject.toml loads it with ``-p grader.testing.pytest_bridge``).
"""

from __future__ import annotations

import atexit
import os
import shutil
from pathlib import Path

from kernels import loader, solution_file

import pytest

from grader import stages
from grader.check import session_seed
from grader.grade import run_check, snapshot_stage
from grader.isolation.outcomes import ImportFailed
from grader.isolation.runner import Runner


def pytest_addoption(parser):
    parser.addoption("--source", default=None,
                     help="stage files to test: 'stages' (yours, the default), 'solutions', or a folder")


def pytest_configure(config):
    source = config.getoption("--source", default=None)
    if source:
        # In the environment, so notebook kernels that nbval starts load the same files.
        os.environ[loader.ENV_VAR] = source


_runners: dict[tuple[str, str], Runner] = {}
_snapshots: list[Path] = []
_SEED = session_seed()


def _runner(stage, source: str) -> Runner:
    """One worker per stage and source, reading a private copy of the stage's files, as grading does
    (the worker may run as another user, who need not be able to read solutions/ itself)."""
    key = (stage.module, source)
    if key not in _runners:
        snapshot = snapshot_stage(stage, source)
        _snapshots.append(snapshot)
        _runners[key] = Runner(stage.module, str(snapshot))
    return _runners[key]


@atexit.register
def _close_all():
    for r in _runners.values():
        r.close()
    for snapshot in _snapshots:
        shutil.rmtree(snapshot, ignore_errors=True)


def stage_tests(name: str):
    stage = stages.find(name)
    params = [pytest.param(c, id=c.name, marks=[pytest.mark.gpu] if c.gpu else []) for c in stage.checks()]

    @pytest.mark.parametrize("check", params)
    def test_check(check):
        source = os.environ.get(loader.ENV_VAR, "stages")
        path = loader.source_dir(source) / f"{stage.module}.py"
        if source != "solutions" and solution_file.is_untouched(path):
            pytest.skip(f"{stage.name} not started: {path.name} is as released")
        try:
            result = run_check(check, _runner(stage, source), _SEED)
        except ImportFailed as exc:
            pytest.fail(f"{path.name} could not be imported: {exc}", pytrace=False)
        if result.status == "not run":
            pytest.skip(result.message)
        if result.status != "pass":
            message = result.message.replace(_runner(stage, source).source, str(path.parent))
            pytest.fail(f"[{result.status}] {message}\n(seed {_SEED}: WORKBOOK_SEED={_SEED} repeats it)",
                        pytrace=False)

    return test_check
