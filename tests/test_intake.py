"""Submissions as an LMS exports them, grader failures that are never a learner's zero, and
publishing into a learner's working copy.

Intake: a learner's files one folder down, or in a zip, are graded; a zip with a link, an absolute
path, a ``..`` or too much in it is refused with the reason, and nothing of it is written anywhere.
"""

from __future__ import annotations

import calendar
import csv
import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from grader import batch
from grader.grade import grade_stage
from grader.publishing import bundle, edition, publish, release
from grader.testing import mutants
from kernels.includes import expand_file
from kernels.loader import ROOT
from tests.test_batch import FILE, SOLUTION, STAGE1
from tests.test_bundle import quiet
from tests.test_edition import S1, S2, S3, _copy, through3  # noqa: F401 - through3 is a fixture

CHECK = "softmax_float16"           # one quick check: enough to show the file was found and graded


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _zip(path: Path, members: dict[str, bytes], *, date=(2026, 3, 4, 5, 6, 8)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(zipfile.ZipInfo(name, date_time=date), data)
    return path


# -- malformed edition.json -----------------------------------------------------------------------
MALFORMED = {"a list": b"[1]", "a string": b'"0.1.0"', "null": b"null", "a number version": b'{"version": 5}',
             "invalid UTF-8": b'{"version": "\xff\xfe"}', "deeply nested": b"[" * 100_000 + b"]" * 100_000,
             "huge": b'{"version": "' + b"9" * (2 << 20) + b'"}'}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_a_malformed_edition_json_is_a_note(tmp_path, kind):
    (tmp_path / "edition.json").write_bytes(MALFORMED[kind])
    (note,) = edition.version_notes(str(tmp_path))
    assert "edition.json is not one an edition writes" in note and "graded all the same" in note
    assert len(note) < 400
    if not MALFORMED[kind].startswith(b"{"):
        assert edition.read(tmp_path) is None                                # not an edition, and no error


def _whole_workbook(folder: Path, manifest: bytes) -> Path:
    """A learner's whole workbook with stage 1 as released (quick to grade: "not started")."""
    (folder / "stages").mkdir(parents=True)
    (folder / "stages" / FILE).write_text(release.rendered()[FILE])
    (folder / "edition.json").write_bytes(manifest)
    return folder


@pytest.mark.slow
def test_a_batch_row_for_a_workbook_with_a_malformed_edition_json(tmp_path):
    subs, out = tmp_path / "subs", tmp_path / "out"
    _whole_workbook(subs / "ann", b"[1]")
    done = subprocess.run([sys.executable, "-m", "grader", "batch", str(subs), "--stages", "stage1", "--out",
                           str(out), "--isolation", "none", "--seed", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    with open(out / "gradebook.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["learner"], r["status"]) for r in rows] == [("ann", "not started")], done.stderr
    assert "error" not in json.loads((out / "learners" / "ann" / "stage1.json").read_text())


# -- Gradescope -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def autograder(tmp_path_factory):
    home = tmp_path_factory.mktemp("gs") / "autograder"         # stands for Gradescope's /autograder
    bundle.build(home / "source", autograder=["stage1"], log=quiet)
    return home


def _run_autograder(home: Path, submission: Path, **env) -> tuple[subprocess.CompletedProcess, dict | None]:
    shutil.rmtree(home / "submission", ignore_errors=True)
    shutil.copytree(submission, home / "submission")
    run = subprocess.run([shutil.which("bash"), str(home / "source" / "run_autograder")], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "AUTOGRADER": str(home), "PYTHON": sys.executable,
                                                      **env})
    path = home / "results" / "results.json"
    return run, (json.loads(path.read_text()) if path.exists() else None)


def test_gradescope_grades_a_workbook_with_a_malformed_edition_json(autograder, tmp_path):
    run, results = _run_autograder(autograder, _whole_workbook(tmp_path / "sub", b"[1]"))
    assert run.returncode == 0 and results is not None, run.stderr
    assert results["score"] == 0 and results["tests"][0]["name"] == "stage1: not started"
    assert "edition.json is not one an edition writes" in results["output"]


def _no_setpriv(folder: Path) -> str:
    """A PATH with what run_autograder runs but not setpriv: isolation 'user' cannot work there."""
    folder.mkdir()
    for tool in ("mkdir", "rm"):
        (folder / tool).symlink_to(subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True,
                                                  text=True, check=True).stdout.strip())
    return str(folder)


def test_a_grader_failure_on_gradescope_is_no_score(autograder, tmp_path):
    submission = mutants.copy_solution(STAGE1, tmp_path / "sub")
    path = _no_setpriv(tmp_path / "bin")
    run, results = _run_autograder(autograder, submission, PATH=path, WORKBOOK_ISOLATION="user")
    assert run.returncode != 0, "a grader failure must fail the autograder's run"
    assert results is not None and "score" not in results and "tests" not in results, results
    assert results["output"].startswith("The autograder failed") and "not your score" in results["output"]
    assert "isolation 'user' is not available" in results["output"] and results["extra_data"]["autograder_failed"]
    # A grader that stops before it writes anything (an error of its own, here a limit it cannot read, or
    # no Python at all) is the same failure, said by the script.
    for env, status in (({"WORKBOOK_STAGE_TIMEOUT": "abc"}, 1), ({"PYTHON": str(tmp_path / "no-python")}, 127)):
        run, results = _run_autograder(autograder, submission, **env)
        assert run.returncode == status and results is not None and "score" not in results, (env, results)
        assert results["output"].startswith("The autograder failed") and f"exit status {status}" in results["output"]
    # What a batch runs gets no result either, so its record says the grading failed (and is retried).
    done = subprocess.run([sys.executable, "-m", "grader", "stage1", "--submission", str(submission), "--format",
                           "json", "--out", str(tmp_path / "r.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PATH=path, WORKBOOK_ISOLATION="user"))
    assert done.returncode == 3, done.stderr
    assert set(json.loads((tmp_path / "r.json").read_text())) == {"error"}


# -- publishing into a working copy ---------------------------------------------------------------
def test_publishing_into_a_working_copy_with_a_solved_hole(through3, tmp_path):  # noqa: F811
    dest = _copy(through3, tmp_path / "edition")
    solved = publish.strip_markers(expand_file(ROOT / "solutions" / f"{S2.module}.py"))   # the learner's answer
    (dest / "stages" / f"{S2.module}.py").write_text(solved)
    (dest / "published").mkdir()
    (dest / "published" / f"{S1.name}.md").write_text("my own notes on stage 1\n")
    publish.publish(dest, ["stage1"], log=quiet)
    assert edition.read(dest)["published"] == ["stage1"]
    assert (dest / "stages" / f"{S2.module}.py").read_text() == solved                    # theirs, untouched
    assert (dest / "published" / f"{S1.name}.md").read_text() == "my own notes on stage 1\n"
    assert (dest / "published" / f"{S1.name}.md.new").read_bytes() == \
        (ROOT / "solutions" / "notes" / f"{S1.name}.md").read_bytes()
    assert (dest / "published" / f"{S1.module}.py").exists()
    # What the edition wrote is searched as before: a file it wrote (its SHA-256 in edition.json) that
    # holds stage 3's answers, not published, is refused.
    leak = publish.strip_markers(expand_file(ROOT / "solutions" / f"{S3.module}.py")).encode()
    meta = json.loads((dest / "edition.json").read_text())
    meta["files"]["tests/given.py"] = hashlib.sha256(leak).hexdigest()
    (dest / "edition.json").write_text(json.dumps(meta))
    (dest / "tests" / "given.py").write_bytes(leak)
    with pytest.raises(publish.PublishError, match="tests/given.py: holds the answers of stage3"):
        publish.publish(dest, ["stage2"], log=quiet)
