"""A learner's first hour: the printed command works, an edition holds only what it ships, the
notebooks open on Colab, updates say what waits to be merged, and progress trusts the last grading."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kernels.loader import ROOT

import pytest

from grader import COMMAND, edition_info, stages
from grader.__main__ import main
from grader.publishing import bundle, edition, publish, release, update
from grader.results import CheckResult, StageResult

quiet = lambda *_: None  # noqa: E731
S1 = stages.find("stage1")


def _grader(cwd: Path, *args: str, python: tuple[str, ...] = (sys.executable,), env=None):
    return subprocess.run([*python, "-m", "grader", *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env=env)


def _bare_root(tmp_path: Path) -> Path:
    """A copy of the workbook's code (links to it) with no .venv beside it."""
    root = tmp_path / "workbook"
    root.mkdir()
    for name in ("grader", "kernels"):
        (root / name).symlink_to(ROOT / name, target_is_directory=True)
    return root


NO_TORCH = (sys.executable, "-S")     # this Python without site-packages: no torch, as a Python outside .venv


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORKBOOK_REEXEC")}


@pytest.fixture(scope="module")
def no_torch():
    done = subprocess.run([*NO_TORCH, "-c", "import importlib.util as u; print(u.find_spec('torch') is None)"],
                          capture_output=True, text=True, timeout=60)
    if done.stdout.strip() != "True":
        pytest.skip("torch is importable without site-packages here: no Python without torch to start")


# -- the printed command works -------------------------------------------------------------------
def test_without_torch_the_grader_says_how_to_run_it_with_no_traceback(no_torch, tmp_path):
    root = _bare_root(tmp_path)
    for args in (["stage1"], []):
        done = _grader(root, *args, python=NO_TORCH, env=_env())
        text = done.stdout + done.stderr
        assert done.returncode == 2, text
        assert "Traceback" not in text and "ModuleNotFoundError" not in text, text
        assert " ".join([COMMAND, *args]) in text and "bash setup.sh" in text, text


def test_python_m_grader_starts_again_under_the_workbooks_venv(no_torch, tmp_path):
    if sys.prefix == sys.base_prefix:
        pytest.skip("the tests do not run in a virtual environment: no .venv to start again under")
    root = _bare_root(tmp_path)
    (root / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    done = _grader(root, "stage1", "--list", python=NO_TORCH, env=_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"stage1 ({S1.module}.py" in done.stdout and S1.checks()[0].name in done.stdout


def _commands(text: str) -> list[str]:
    return re.findall(r"(?:python -m grader|\./workbook|!workbook)[^\n`]*", text)


def test_every_place_a_learner_reads_prints_the_one_command():
    from grader import grade_stages
    readme = (ROOT / "README.md").read_text()
    learner = readme.split("## How a learner works", 1)[1].split("\n## ", 1)[0]
    places = {"README.md (How a learner works)": learner,
              "docs/instructor.md": (ROOT / "docs" / "instructor.md").read_text(),
              "the learner's README": bundle.learner_readme(stages.STAGES[:3]),
              "the progress view's next line": progress_next_lines(),
              "./workbook stage1 --help": grade_stages.stage_help("stage1")}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        printed = [o.get("text", "") for c in cells for o in c.get("outputs", [])]        # stream outputs
        places[path.name] = "\n".join(["".join(c["source"]) for c in cells] + ["".join(x) for x in printed])
    for where, text in places.items():
        found = _commands(text)
        assert found, f"{where} prints no command"
        wrong = [c for c in found if "python -m grader" in c]
        assert not wrong, f"{where} prints {wrong}: print {COMMAND} ..., which works without activating .venv"
    last = "".join(json.loads((ROOT / "notebooks" / S1.notebook).read_text())["cells"][-1]["source"])
    assert f"{COMMAND} stage1" in last


def progress_next_lines() -> str:
    from grader import progress
    not_started = StageResult(S1.name, "stages", "not started")
    failing = StageResult(S1.name, "stages", "graded", results=[CheckResult("x", 1, 0, "FAIL")])
    return "\n".join(progress.next_step([(S1, r, "", False)]) for r in (not_started, failing))


def test_the_top_level_list_names_every_stage_and_its_checks(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for stage in stages.STAGES:
        assert f"{stage.name} ({stage.module}.py" in out
        assert all(c.name in out for c in stage.checks() if not c.hidden)


# -- editions ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def through3(tmp_path_factory):
    return bundle.build(tmp_path_factory.mktemp("first-hour") / "edition", through="stage3", repo="acme/attn",
                        log=quiet)


def test_an_edition_through_stage3_holds_stages_1_to_3_and_says_when_the_rest_arrives(through3):
    later = [s for s in stages.ALL if s.number > 3]
    for stage in later:
        for rel in (f"tests/test_{stage.name}.py", f"grader/checks/{stage.name}.py", f"notebooks/{stage.notebook}",
                    f"stages/{stage.module}.py"):
            assert not (through3 / rel).exists(), rel
    assert (through3 / "tests" / "test_stage3.py").exists() and (through3 / "grader" / "checks" / "stage3.py").exists()
    assert not (through3 / "tests" / "test_bench_train.py").exists()      # it needs docs/training.md
    done = _grader(through3, "stage5")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "not in this edition yet" in done.stderr and f"{COMMAND} update --from" in done.stderr, done.stderr
    assert "05_causal.ipynb" not in done.stdout + done.stderr
    rows = _grader(through3)
    assert rows.returncode == 0, rows.stdout + rows.stderr               # nothing started: nothing failed
    assert "stage3 " in rows.stdout and "stage4 " not in rows.stdout and "stage9 " not in rows.stdout, rows.stdout


def test_the_tests_an_edition_ships_pass_in_it(through3):
    """Every test it ships but the stages' own, which grade the learner's unfinished files."""
    tests = sorted(f"tests/{p.name}" for p in (through3 / "tests").glob("test_*.py")
                   if not p.name.startswith("test_stage"))
    assert tests, "the edition ships no test besides the stages'"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=through3,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_a_new_edition_needs_through(tmp_path, capsys):
    dest = tmp_path / "course"
    assert bundle.main(to=str(dest)) == 2
    assert "--through stageN" in capsys.readouterr().err
    assert not dest.exists()


def test_release_points_the_notebooks_at_the_editions_repository(through3, tmp_path):
    for path in (through3 / "notebooks").glob("*.ipynb"):
        text = path.read_text()
        assert bundle.PLACEHOLDER not in text, path.name
        assert f"colab.research.google.com/github/acme/attn/blob/main/notebooks/{path.name}" in text
        assert 'WORKBOOK_REPO = \\"https://github.com/acme/attn\\"' in text
    assert edition.read(through3)["repository"] == "acme/attn"
    published = shutil.copytree(through3, tmp_path / "published", symlinks=True)
    publish.publish(published, ["stage2"], log=quiet)
    solution = (published / "notebooks" / "02_first_triton.solution.ipynb").read_text()
    assert "github/acme/attn/blob/main" in solution and bundle.PLACEHOLDER not in solution
    clone = tmp_path / "clone"                      # a clone of the edition's repository: its origin says it
    subprocess.run(["git", "init", "-q", str(clone)], check=True, timeout=60)
    subprocess.run(["git", "-C", str(clone), "remote", "add", "origin", "git@github.com:my-org/course.git"],
                   check=True, timeout=60)
    bundle.build(clone, through="stage1", log=quiet)
    assert "github/my-org/course/blob/main" in (clone / "notebooks" / S1.notebook).read_text()
    lines: list[str] = []
    bundle.build(tmp_path / "nowhere", through="stage1", log=lines.append)
    assert any(ln.startswith("WARNING") and bundle.PLACEHOLDER in ln and "--repo" in ln for ln in lines), lines
    with pytest.raises(ValueError, match="--repo"):
        bundle.build(tmp_path / "bad", through="stage1", repo="https://github.com/x", log=quiet)


def test_an_editions_version_changes_with_what_it_holds(tmp_path, monkeypatch):
    dest = bundle.build(tmp_path / "e", through="stage2", log=quiet)
    before = edition.read(dest)["version"]
    publish.publish(dest, ["stage1"], log=quiet)
    assert edition.read(dest)["version"] != before
    clean = {"version": "0.1.0+abcdef123456", "commit": "abcdef1234567890"}
    dirty = {"version": "0.1.0+abcdef123456", "commit": "abcdef1234567890+changes"}
    monkeypatch.setattr(edition_info, "source_version", lambda *_: clean)
    v_clean = edition.read(bundle.build(tmp_path / "clean", through="stage1", log=quiet))["version"]
    monkeypatch.setattr(edition_info, "source_version", lambda *_: dirty)
    v_dirty = edition.read(bundle.build(tmp_path / "dirty", through="stage1", log=quiet))["version"]
    original = release.rendered
    monkeypatch.setattr(release, "rendered", lambda *a: {k: v + "# changed\n" for k, v in original(*a).items()})
    v_dirtier = edition.read(bundle.build(tmp_path / "dirtier", through="stage1", log=quiet))["version"]
    assert len({v_clean, v_dirty, v_dirtier}) == 3, (v_clean, v_dirty, v_dirtier)



# -- updates that wait ---------------------------------------------------------------------------
V1 = "def f():\n    return 1\n\n\ndef g():\n    return 2\n\n\ndef h():\n    return 3\n"


def _copy_with_a_new(tmp_path: Path, mine: str, new: str) -> Path:
    """A copy whose stages/s.py the learner changed (``mine``) while an update brought ``new``."""
    dest = tmp_path / "copy"
    edition.write(dest, {"stages/s.py": V1.encode()}, {"version": "1"}, log=quiet)
    (dest / "stages" / "s.py").write_text(mine)
    edition.write(dest, {"stages/s.py": new.encode()}, {"version": "2"}, log=quiet)
    assert (dest / "stages" / "s.py.new").read_text() == new
    return dest


@pytest.mark.skipif(shutil.which("git") is None, reason="the three-way merge uses git merge-file")
def test_update_merge_takes_the_new_version_in_and_keeps_the_learners_changes(tmp_path):
    mine = V1.replace("return 3", "return 30")
    dest = _copy_with_a_new(tmp_path, mine, V1.replace("return 1", "return 10"))
    assert edition_info.pending(dest) == ["stages/s.py"]
    assert f"{COMMAND} update --merge stages/s.py" in edition_info.pending_note(dest)
    lines: list[str] = []
    assert update.merge(str(dest / "stages" / "s.py"), root=dest, out=lines.append) == 0, lines
    merged = (dest / "stages" / "s.py").read_text()
    assert "return 10" in merged and "return 30" in merged and "return 2\n" in merged
    assert not (dest / "stages" / "s.py.new").exists() and edition_info.pending_note(dest) == ""
    backups = list((dest / ".edition" / "backup" / "stages").iterdir())
    assert [b.read_text() for b in backups] == [mine]
    # a later edition: the merge starts from the version the last merge took in, and keeps both backups
    edition.write(dest, {"stages/s.py": V1.replace("return 1", "return 10").replace("return 2", "return 200")
                         .encode()}, {"version": "3"}, log=quiet)
    assert update.merge("stages/s.py", root=dest, out=lines.append) == 2          # not from this folder
    assert update.merge(str(dest / "stages" / "s.py"), root=dest, out=lines.append) == 0, lines
    assert (dest / "stages" / "s.py").read_text() == V1.replace("return 1", "return 10").replace(
        "return 2", "return 200").replace("return 3", "return 30")
    assert sorted(b.read_text() for b in (dest / ".edition" / "backup" / "stages").iterdir()) == sorted([mine, merged])


@pytest.mark.skipif(shutil.which("git") is None, reason="the three-way merge uses git merge-file")
def test_update_merge_marks_a_conflict_and_without_a_base_shows_the_difference(tmp_path):
    dest = _copy_with_a_new(tmp_path, V1.replace("return 2", "return 20"), V1.replace("return 2", "return 22"))
    lines: list[str] = []
    assert update.merge(str(dest / "stages" / "s.py.new"), root=dest, out=lines.append) == 1
    merged = (dest / "stages" / "s.py").read_text()
    assert "<<<<<<< your version" in merged and "return 20" in merged and "return 22" in merged
    assert "1 conflict" in lines[-1]
    other = _copy_with_a_new(tmp_path / "b", "# mine\n" + V1, V1.replace("return 2", "return 22"))
    shutil.rmtree(other / ".edition" / "base")
    lines = []
    assert update.merge(str(other / "stages" / "s.py"), root=other, out=lines.append) == 1
    assert "+    return 22" in "".join(lines) and (other / "stages" / "s.py.new").exists()
    assert (other / "stages" / "s.py").read_text() == "# mine\n" + V1          # nothing changed
    assert update.merge(str(other / "stages" / "t.py"), root=other, out=lines.append) == 2


def test_progress_and_grading_name_what_waits_to_be_merged(through3, tmp_path):
    dest = tmp_path / "learner"
    shutil.copytree(through3, dest, symlinks=True)
    rel = f"notebooks/{S1.notebook}"
    (dest / (rel + edition.NEW)).write_bytes((dest / rel).read_bytes())
    for args in ([], ["stage2"]):
        done = _grader(dest, *args)
        assert f"{COMMAND} update --merge {rel}" in done.stdout, (args, done.stdout + done.stderr)


# -- progress trusts the last grading ------------------------------------------------------------
def test_progress_shows_the_last_grading_of_an_unchanged_stage(tmp_path, monkeypatch, capsys):
    from grader import grade, progress
    monkeypatch.setattr(progress, "CACHE", tmp_path / "cache")
    graded = StageResult(S1.name, "stages", "graded", seed=7,
                         results=[CheckResult(c.name, c.points, c.points, "pass") for c in S1.checks()])
    monkeypatch.setattr(grade, "grade_stage", lambda stage, source, **kw: graded)
    assert main(["stage1"]) == 0
    calls = []

    def regrade(stage, source, **kw):
        calls.append(stage.name)
        return StageResult(stage.name, source, "not started")

    monkeypatch.setattr(progress, "grade_stage", regrade)
    capsys.readouterr()
    progress.progress("stages")
    out = capsys.readouterr().out
    assert S1.name not in calls, out
    assert re.search(r"stage1 .* done", out) and "1 stage(s) unchanged since they were last graded" in out, out


# -- docs ----------------------------------------------------------------------------------------
def test_gradescope_doc_says_where_the_isolation_is_named():
    text = " ".join((ROOT / "docs" / "gradescope.md").read_text().split())
    assert "named in the output of `run_autograder`" not in text     # run_autograder prints nothing of it
    assert "Learner code isolated by" in text
    from grader import formats
    result = StageResult(S1.name, "stages", "graded", isolation="bubblewrap",
                         results=[CheckResult("x", 1, 1, "pass")])
    assert "Learner code isolated by: bubblewrap." in formats.gradescope([(S1, result)])["output"]


@pytest.mark.parametrize("manifest", [{"version": "2026.1"}, {"files": {}}, {"version": 3, "files": []}])
def test_update_from_a_folder_whose_edition_json_is_incomplete_is_refused(tmp_path, capsys, manifest):
    (tmp_path / edition_info.MANIFEST).write_text(json.dumps(manifest))
    assert update.main(source=str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "is not an edition's" in err and "nothing was changed" in err and str(tmp_path) in err
