"""Hidden checks, the learner's bundle (``release --to``) and the Gradescope autograder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kernels import solution_file
from kernels.loader import ROOT

import pytest

from grader import formats, stages
from grader.grade import grade_stage
from grader.publishing import bundle, edition, release
from grader.results import format_result
from grader.testing import mutants

STAGE1 = stages.find("stage1")
FILE = f"{STAGE1.module}.py"
HIDDEN = [c for c in STAGE1.checks() if c.hidden]
PUBLIC_MAX = sum(c.points for c in STAGE1.checks() if not c.hidden)
quiet = lambda *_: None  # noqa: E731


def _run(cwd, *args, **env):
    return subprocess.run([sys.executable, "-m", "grader", *args], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, **env))


def test_hidden_checks_count_but_are_never_named_to_the_learner(tmp_path):
    assert HIDDEN, "stage 1 keeps an example hidden check in grader/checks/hidden/stage1.py"
    hidden = HIDDEN[0]
    wrong = mutants.Mutant("drops_last_block", "drops a partial last key block",
                           edits=[("for j0 in range(0, Nk, block_n):",
                                   "for j0 in range(0, Nk - block_n + 1, block_n):")])
    folder = mutants.build(STAGE1, wrong, tmp_path / "sub")
    result = grade_stage(STAGE1, str(folder), only=[hidden.name, "softmax_float16"])
    verdict = {r.name: r for r in result.results}
    assert verdict[hidden.name].status == "FAIL" and verdict[hidden.name].hidden
    assert result.score == 1 and result.max_score == 1 + hidden.points
    learner_facing = [format_result(STAGE1, result), json.dumps(formats.gradescope([(STAGE1, result)]))]
    for text in learner_facing:
        assert f"1 hidden check: 0/{hidden.points} points" in text
        assert hidden.name not in text and hidden.hint[:30] not in text
        assert verdict[hidden.name].message.split("\n")[0][:40] not in text
    assert hidden.name in json.dumps(formats.detail([(STAGE1, result)]))  # the instructor's record


@pytest.mark.slow
def test_the_learner_bundle_has_no_solutions_and_no_hidden_checks(tmp_path):
    dest = bundle.build(tmp_path / "workbook", log=quiet)
    assert not (dest / "solutions").exists() and not (dest / "tests" / "wrong").exists()
    assert not (dest / "grader" / "checks" / "hidden").exists()
    assert (dest / "tests" / "test_stage1.py").exists() and not (dest / "tests" / "test_wrong_solutions.py").exists()
    assert {p.name: p.read_text() for p in (dest / "stages").glob("stage*")} == release.rendered()
    meta = edition.read(dest)
    assert edition.audit(edition.on_disk(dest, meta), set(range(1, 10)), edition.answer_keys(),
                         {c.name for c in HIDDEN}) == []
    # It runs on its own (setup.sh's commands included): a fresh copy is "not started", and the
    # solution passes every check it holds.
    for command in (["release", "--check"], ["stage1", "--solutions"]):
        assert _run(dest, *command).returncode == 0, command
    fresh = _run(dest, "stage1")
    assert fresh.returncode == 1 and "not started" in fresh.stdout, fresh.stdout + fresh.stderr
    (dest / "stages" / FILE).write_text((ROOT / "solutions" / FILE).read_text())
    done = _run(dest, "stage1", "--format", "json")
    assert done.returncode == 0, done.stderr
    graded = json.loads(done.stdout)["stages"][0]
    assert graded["score"] == graded["max_score"] == PUBLIC_MAX and not any(r["hidden"] for r in graded["results"])


def test_a_bundle_that_would_leak_is_refused(tmp_path):
    solution = (ROOT / "solutions" / FILE).read_text()
    contents = {"notebooks/x.ipynb": json.dumps({"cells": [{"source": ["# BEGIN SOLUTION\n", "x = 1\n"]}]}).encode(),
                "README.md": f"try {HIDDEN[0].name}".encode(),
                "docs/answers.py": solution_file.render(solution, FILE).encode() + b"\n" + solution.encode(),
                "tests/wrong/stage1.py": b"", "extra/solutions/a.py": b""}
    problems = edition.audit(contents, set(), edition.answer_keys(), {HIDDEN[0].name})
    assert any("solution block" in p for p in problems) and any("hidden" in p for p in problems)
    assert any("answers of stage1" in p for p in problems)
    assert any("wrong solution" in p for p in problems) and any("solutions folder" in p for p in problems)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(bundle.BundleError, match="holds no edition"):
        bundle.build(tmp_path / "full", log=quiet)


@pytest.mark.slow
def test_the_gradescope_autograder_grades_a_submission(tmp_path):
    home = tmp_path / "autograder"          # stands for Gradescope's /autograder
    source = bundle.build(home / "source", autograder=["stage1"], log=quiet)
    assert (home / "source.zip").exists() and (source / "grader" / "checks" / "hidden" / "stage1.py").exists()
    assert not (source / "solutions").exists()
    assert 'STAGES="stage1"' in (source / "run_autograder").read_text()
    submission = mutants.copy_solution(STAGE1, home / "submission")
    run = subprocess.run(["bash", str(source / "run_autograder")], capture_output=True, text=True,
                         env=dict(os.environ, AUTOGRADER=str(home), PYTHON=sys.executable))
    assert run.returncode == 0, run.stderr
    results = json.loads((home / "results" / "results.json").read_text())
    assert results["score"] == PUBLIC_MAX + sum(c.points for c in HIDDEN)
    names = [t["name"] for t in results["tests"]]
    assert "stage1 / hidden checks" in names and not any(c.name in json.dumps(results) for c in HIDDEN)
    assert all(t["status"] == "passed" for t in results["tests"]) and submission.exists()
    version = edition.read(source)["version"]
    assert f"Graded by workbook edition {version} (autograder)" in results["output"]
    # A learner who hands in a whole copy of another edition is told so.
    (submission / "edition.json").write_text(json.dumps({"version": "0.0.1+older", "files": {}}))
    run = subprocess.run(["bash", str(source / "run_autograder")], capture_output=True, text=True,
                         env=dict(os.environ, AUTOGRADER=str(home), PYTHON=sys.executable))
    output = json.loads((home / "results" / "results.json").read_text())["output"]
    assert "Your copy is edition 0.0.1+older; this grader is " + version in output
