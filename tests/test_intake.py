"""Submissions as an LMS exports them, a learner's edition.json of any shape, grader failures that
are never a learner's zero, and publishing into a learner's working copy.

- A malformed edition.json in a whole-workbook submission is a note, in a batch and on Gradescope.
- A grader that cannot grade fails Gradescope's run and gives no score; a batch gets no result.
- Publishing into a working copy keeps the learner's solved holes and never refuses for them.
- Intake: a learner's files one folder down, or in a zip, are graded; a zip with a link, an absolute
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

from kernels.loader import ROOT
from kernels.solution_file import expand_file, strip_markers

import pytest

from grader import batch, edition_info
from grader.grade import grade_stage
from grader.publishing import bundle, edition, publish, release
from grader.testing import mutants
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
    (note,) = edition_info.version_notes(str(tmp_path))
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
    solved = strip_markers(expand_file(ROOT / "solutions" / f"{S2.module}.py"))   # the learner's answer
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
    leak = strip_markers(expand_file(ROOT / "solutions" / f"{S3.module}.py")).encode()
    meta = json.loads((dest / "edition.json").read_text())
    meta["files"]["tests/given.py"] = hashlib.sha256(leak).hexdigest()
    (dest / "edition.json").write_text(json.dumps(meta))
    (dest / "tests" / "given.py").write_bytes(leak)
    with pytest.raises(publish.PublishError, match="tests/given.py: holds the answers of stage3"):
        publish.publish(dest, ["stage2"], log=quiet)


# -- intake ---------------------------------------------------------------------------------------
def test_a_learner_one_folder_down_is_graded(tmp_path):
    subs, out = tmp_path / "subs", tmp_path / "out"
    mutants.copy_solution(STAGE1, subs / "lee" / "myproject")                  # an export's folder around theirs
    before = _listing(subs)
    found = batch.learners(subs, out)
    assert [p.name for p in found] == ["lee"] and batch.left_out(subs, out) == []
    lee = found[0]
    assert (lee / FILE).read_text() == SOLUTION and not lee.is_relative_to(subs)
    assert _listing(subs) == before, "intake wrote next to the learner's files"
    result = grade_stage(STAGE1, str(lee), only=[CHECK])
    assert (result.status, result.score) == ("graded", 1), result


def test_a_zip_is_extracted_into_the_batch_folder_and_graded(tmp_path):
    subs, out = tmp_path / "subs", tmp_path / "out"
    _zip(subs / "kim.zip", {"kim/": b"", f"kim/{FILE}": SOLUTION.encode(), "kim/notes.md": b"my notes\n",
                            f"__MACOSX/kim/._{FILE}": b"\0\5\26\7"})
    _zip(subs / "wb.zip", {f"wb-main/stages/{FILE}": SOLUTION.encode(), "wb-main/README.md": b"x"})  # a workbook
    before = _listing(subs)
    found = batch.learners(subs, out)
    assert [p.name for p in found] == ["kim", "wb"] and batch.left_out(subs, out) == []
    for learner in found:
        assert learner.is_relative_to(out) and os.listdir(learner) == [FILE]
        assert (learner / FILE).read_text() == SOLUTION
    assert _listing(subs) == before, "intake wrote next to the learner's files"
    assert batch.learners(subs, out) == found                                  # taken in again: the same
    result = grade_stage(STAGE1, str(found[0]), only=[CHECK])
    assert (result.status, result.score) == ("graded", 1), result


def test_a_zipped_submission_is_dated_by_its_newest_member(tmp_path):
    from grader import intake
    subs, out = tmp_path / "subs", tmp_path / "out"
    _zip(subs / "kim.zip", {FILE: SOLUTION.encode()}, date=(2026, 3, 4, 5, 6, 8))
    _zip(subs / "undated.zip", {FILE: SOLUTION.encode()}, date=(1980, 1, 1, 0, 0, 0))
    os.utime(subs / "undated.zip", (1_700_000_000, 1_700_000_000))
    kim, undated = batch.learners(subs, out)
    local = time.mktime((2026, 3, 4, 5, 6, 8, 0, 0, -1))                       # a zip's dates are local time
    assert intake.submitted(kim) == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(local))
    assert intake.submitted(undated) == "2023-11-14T22:13:20Z"                # no date inside: the zip's own
    assert calendar.timegm(time.strptime(intake.submitted(kim, [STAGE1]), "%Y-%m-%dT%H:%M:%SZ")) == local
    (subs / "empty").mkdir()
    assert intake.submitted(subs / "empty") is None


def _member(name: str, data: bytes, *, mode: int) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.external_attr = mode << 16
    return info, data


def _patched_zip(path: Path, offset: int, fmt: str, value: int) -> Path:
    """A zip of the solution whose central directory entry says ``value`` at ``offset`` (zipfile would
    not write it so): 8 is the flags (bit 0: encrypted), 24 the size the member unpacks to."""
    _zip(path, {FILE: SOLUTION.encode()})
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x01\x02") + offset
    data[at:at + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(data))
    return path


def _refused(subs: Path, kind: str) -> str:
    if kind == "dotdot":
        _zip(subs / "eve.zip", {FILE: SOLUTION.encode(), "../escaped.py": b"print('out')\n"})
        return "'..'"
    if kind == "absolute":
        _zip(subs / "eve.zip", {FILE: SOLUTION.encode(), "/tmp/escaped.py": b"print('out')\n"})
        return "absolute path"
    special = {"link": (stat.S_IFLNK | 0o777, str(ROOT / "solutions" / FILE), "is a symbolic link"),
               "fifo": (stat.S_IFIFO | 0o644, "", "is a FIFO")}
    if kind in special:
        mode, data, why = special[kind]
        subs.mkdir(parents=True)
        with zipfile.ZipFile(subs / "eve.zip", "w") as z:
            z.writestr(*_member(FILE, data.encode(), mode=mode))
        return why
    if kind == "encrypted":
        _patched_zip(subs / "eve.zip", 8, "<H", 0x1)
        return "is encrypted"
    if kind == "too large":                                    # what a zip bomb's directory says
        _patched_zip(subs / "eve.zip", 24, "<I", 3 << 30)
        return "unpacks to 3221225472 bytes"
    subs.mkdir(parents=True)
    with zipfile.ZipFile(subs / "eve.zip", "w") as z:
        for n in range(20_001):
            z.writestr(f"f{n}", b"")
    return "20001 members"


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "link", "fifo", "encrypted", "too large", "too many members"])
def test_an_unsafe_zip_is_refused_with_the_reason(tmp_path, kind):
    subs, out = tmp_path / "subs", tmp_path / "out"
    why = _refused(subs, kind)
    before = _listing(tmp_path)
    assert batch.learners(subs, out) == []
    (line,) = batch.left_out(subs, out)
    assert line.startswith("eve.zip (") and why in line, line
    assert _listing(tmp_path) == before, "a refused zip left something behind"
    assert not Path("/tmp/escaped.py").exists() and not (tmp_path / "escaped.py").exists()


def test_what_intake_cannot_place_is_left_out_with_the_reason(tmp_path):
    subs, out = tmp_path / "subs", tmp_path / "out"
    mutants.copy_solution(STAGE1, subs / "two" / "a")
    mutants.copy_solution(STAGE1, subs / "two" / "b")
    mutants.copy_solution(STAGE1, subs / "deep" / "x" / "y")
    mutants.copy_solution(STAGE1, subs / "both" / "w")
    mutants.copy_solution(STAGE1, subs / "both" / "w" / "stages")
    mutants.copy_solution(STAGE1, subs / "ada")
    _zip(subs / "ada.zip", {FILE: SOLUTION.encode()})
    (subs / "lnk" / "p").mkdir(parents=True)
    (subs / "lnk" / "p" / FILE).symlink_to(ROOT / "solutions" / FILE)
    code = SOLUTION.encode()
    _zip(subs / "ztwo.zip", {f"a/{FILE}": code, f"b/stages/{FILE}": code})
    _zip(subs / "zdeep.zip", {f"a/b/{FILE}": code})
    _zip(subs / "zboth.zip", {FILE: code, f"stages/{FILE}": code})
    (subs / "notes.txt").write_text("not a submission\n")
    assert [p.name for p in batch.learners(subs, out)] == ["ada"]
    why = dict(line.split(" (", 1) for line in batch.left_out(subs, out))
    assert set(why) == {"two", "deep", "both", "lnk", "ada.zip", "notes.txt", "ztwo.zip", "zdeep.zip", "zboth.zip"}
    assert "is a symbolic link" in why["lnk"] and not (out / "intake" / "lnk").exists()
    assert "more than one folder of the zip: a/, b/" in why["ztwo.zip"]
    assert f"too deep, at a/b/{FILE}" in why["zdeep.zip"] and f"two copies of {FILE}" in why["zboth.zip"]
    assert "more than one folder" in why["two"] and "a/, b/" in why["two"]
    assert "too deep" in why["deep"] and f"x/y/{FILE}" in why["deep"]
    assert f"two copies of {FILE}" in why["both"]
    assert "ada/ is there too" in why["ada.zip"]
    assert "not a .zip" in why["notes.txt"]


# -- one upload, unpacked with its project folder (Gradescope) ------------------------------------------
def test_a_single_submission_one_folder_down_is_found(tmp_path):
    """An upload of a zipped project folder unpacks as SUBMISSION/myproject/...: grading one submission
    (``--submission``, as the Gradescope autograder does) finds its stage files there, or in its stages/."""
    from grader.grade import submission_folder
    (tmp_path / "a" / "myproject").mkdir(parents=True)
    (tmp_path / "a" / "myproject" / FILE).write_text(SOLUTION)
    (tmp_path / "a" / "__MACOSX").mkdir()                                  # beside it in zips macOS makes
    assert submission_folder(tmp_path / "a", STAGE1) == tmp_path / "a" / "myproject"
    (tmp_path / "b" / "wb" / "stages").mkdir(parents=True)
    (tmp_path / "b" / "wb" / "stages" / FILE).write_text(SOLUTION)
    assert submission_folder(tmp_path / "b", STAGE1) == tmp_path / "b" / "wb" / "stages"
    (tmp_path / "a" / "other").mkdir()                                     # two folders: which is it? neither
    assert submission_folder(tmp_path / "a", STAGE1) == tmp_path / "a"
    (tmp_path / "c" / "deeper" / "still").mkdir(parents=True)
    (tmp_path / "c" / "deeper" / "still" / FILE).write_text(SOLUTION)
    assert submission_folder(tmp_path / "c", STAGE1) == tmp_path / "c"   # one level, no more


def test_gradescope_grades_a_submission_one_folder_down(tmp_path):
    sub = tmp_path / "submission" / "myproject"
    sub.mkdir(parents=True)
    (sub / FILE).write_text(SOLUTION)
    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "grader", "stage1", "--submission", str(sub.parent), "--only", CHECK,
                           "--format", "gradescope", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    tests = json.loads(out.read_text())["tests"]
    assert [(t["score"], t["max_score"]) for t in tests if t["name"] == f"stage1 / {CHECK}"] == [(1, 1)], tests
