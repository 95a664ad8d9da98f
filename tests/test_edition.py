"""Editions: what a learner receives, publishing stage by stage, updating in place, --compare."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kernels.loader import ROOT

import pytest

from grader import compare, stages
from grader.publishing import bundle, edition, publish, release
from grader.results import CheckResult, StageResult

quiet = lambda *_: None  # noqa: E731
S1, S2, S3 = (stages.find(f"stage{n}") for n in (1, 2, 3))


@pytest.fixture(scope="module")
def through3(tmp_path_factory):
    return bundle.build(tmp_path_factory.mktemp("e") / "edition", through="stage3", log=quiet)


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def test_an_edition_ships_the_stages_through_n_and_teaches_from_a_clean_slate(through3):
    meta = edition.read(through3)
    assert meta["through"] == "stage3" and meta["published"] == [] and meta["kind"] == "learner"
    assert meta["version"].startswith("0.") and len(meta["commit"]) >= 12
    assert sorted(p.name for p in (through3 / "stages").glob("stage*")) == [f"{s.module}.py" for s in (S1, S2, S3)]
    assert sorted(p.name for p in (through3 / "notebooks").iterdir()) == [s.notebook for s in (S1, S2, S3)]
    for nb in (through3 / "notebooks").iterdir():
        cells = json.loads(nb.read_text())["cells"]
        assert all(not c.get("outputs") for c in cells if c["cell_type"] == "code"), f"{nb.name} kept outputs"
    readme = (through3 / "README.md").read_text()
    assert len(readme.encode()) < 8192 and "solutions/" not in readme and "TFLOP" not in readme
    assert "Stages 4-9 arrive in a later edition" in readme
    for absent in ("solutions", "tests/wrong", "grader/checks/hidden", "docs/bench-h100.json", "grader/gradescope",
                   "grader/bench/probes"):
        assert not (through3 / absent).exists(), absent
    assert edition.audit(edition.on_disk(through3, meta), set(), edition.answer_keys(),
                         bundle.hidden_check_names()) == []
    # what release wrote for stage 1 is what the grader calls "not started"
    manifest = json.loads((through3 / "stages" / release.MANIFEST).read_text())
    assert set(manifest) == {f"{s.module}.py" for s in (S1, S2, S3)}


def test_the_edition_says_its_version(through3):
    done = subprocess.run([sys.executable, "-m", "grader"], cwd=through3, capture_output=True, text=True,
                          timeout=300)
    meta = edition.read(through3)
    assert f"workbook edition {meta['version']}, stages through stage3" in done.stdout, done.stdout + done.stderr


def test_publishing_one_stage_adds_that_stage_alone(through3, tmp_path):
    dest = _copy(through3, tmp_path / "edition")
    publish.publish(dest, ["stage2"], log=quiet)
    meta = edition.read(dest)
    assert meta["published"] == ["stage2"]
    published = sorted(p.name for p in (dest / "published").iterdir())
    assert published == ["stage2.holes.json", "stage2.md", S2.module + ".py"]
    text = (dest / "published" / f"{S2.module}.py").read_text()
    assert "BEGIN SOLUTION" not in text and "raise NotImplementedError" not in text
    assert (dest / "published" / "stage2.md").read_bytes() == (ROOT / "solutions" / "notes" / "stage2.md").read_bytes()
    assert (dest / "notebooks" / "02_first_triton.solution.ipynb").exists()
    assert not (dest / "notebooks" / "03_flash_forward.solution.ipynb").exists()
    keys = edition.answer_keys()
    assert edition.answers_in(text, keys) == {2}
    assert edition.audit(edition.on_disk(dest, meta), {2}, keys) == []
    # what was published, and nothing else, is what the audit now allows
    assert any("stage2" in p for p in edition.audit(edition.on_disk(dest, meta), set(), keys))


def test_publishing_a_stage_whose_given_code_reveals_another_is_refused(through3, tmp_path):
    dest = _copy(through3, tmp_path / "edition")
    before = edition.read(dest)
    with pytest.raises(publish.PublishError, match="answers of stage3"):
        publish.publish(dest, ["stage5"], log=quiet)        # stage 5 is built on stage 3's answers
    assert edition.read(dest) == before and not (dest / "published").exists()
    publish.publish(dest, ["stage3", "stage5"], log=quiet)  # together, nothing is given away unasked
    assert edition.read(dest)["published"] == ["stage3", "stage5"]


def test_an_edition_updates_in_place_without_losing_an_edit(through3, tmp_path, monkeypatch):
    dest = _copy(through3, tmp_path / "edition")
    mine = "# my own notes\n"
    (dest / "stages" / f"{S1.module}.py").write_text(mine)                 # the learner's work
    nb1 = dest / "notebooks" / S1.notebook
    nb1.write_text(nb1.read_text().replace('"cells": [', '"cells": [{"cell_type": "markdown", "metadata": {}, '
                                                        '"source": ["my cell"]},', 1))
    edited_nb = nb1.read_bytes()

    def revised(notebook: bytes) -> bytes:   # the instructor revises every notebook
        nb = json.loads(edition_cleared(notebook))
        nb["cells"][0]["source"] = ["revised\n"] + list(nb["cells"][0]["source"])
        return (json.dumps(nb, indent=1) + "\n").encode()

    edition_cleared = edition.cleared
    monkeypatch.setattr(edition, "cleared", revised)
    lines: list[str] = []
    bundle.build(dest, log=lines.append)
    assert (dest / "stages" / f"{S1.module}.py").read_text() == mine          # untouched, and no .new:
    assert not (dest / "stages" / f"{S1.module}.py.new").exists()             # its release did not change
    assert nb1.read_bytes() == edited_nb and b"revised" in (dest / "notebooks" / (S1.notebook + ".new")).read_bytes()
    assert b"revised" in (dest / "notebooks" / S2.notebook).read_bytes()     # not edited: replaced
    assert any(ln.startswith("kept") and S1.notebook in ln for ln in lines)
    assert any(ln.startswith("updated") and S2.notebook in ln for ln in lines)
    again: list[str] = []
    bundle.build(dest, log=again.append)
    assert not [ln for ln in again if ln.startswith(("kept", "updated", "added", "removed"))], again


def test_a_learner_takes_a_new_edition_in(tmp_path):
    first = bundle.build(tmp_path / "first", through="stage1", log=quiet)
    learner = _copy(first, tmp_path / "learner")
    (learner / "stages" / f"{S1.module}.py").write_text("# started\n")
    second = bundle.build(tmp_path / "second", through="stage2", log=quiet)
    done = subprocess.run([sys.executable, "-m", "grader", "update", "--from", str(second)], cwd=learner,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (learner / "stages" / f"{S2.module}.py").exists() and (learner / "notebooks" / S2.notebook).exists()
    assert (learner / "stages" / f"{S1.module}.py").read_text() == "# started\n"
    assert edition.read(learner)["through"] == "stage2"


def _result(stage, **statuses) -> StageResult:
    return StageResult(stage.name, "stages", "graded", results=[
        CheckResult(name, 1, int(st == "pass"), st, calls=["weighted_row_sum"]) for name, st in statuses.items()])


def test_compare_waits_for_publication_then_shows_each_hole(through3, tmp_path):
    dest = _copy(through3, tmp_path / "edition")
    result = _result(S2, weighted_row_sum_awkward_sizes="FAIL")
    assert "not published yet" in compare.compare(S2, result, dest / "stages", root=dest)
    publish.publish(dest, ["stage2"], log=quiet)
    shown = compare.compare(S2, result, dest / "stages", root=dest)
    holes = json.loads((dest / "published" / "stage2.holes.json").read_text())
    assert [h["todo"] for h in holes] == ["TODO(2a)", "TODO(2b)", "TODO(2c)", "TODO(2d)", "TODO(2e)", "TODO(2f)"]
    for hole in holes:
        assert hole["todo"] in shown
    # the learner's file is still as released: each hole shows its stub beside the reference
    assert "raise NotImplementedError" in shown or "| pass" in shown
    assert "weighted_row_sum_awkward_sizes FAIL" in shown
    first = holes[0]["reference"].strip().splitlines()[0].strip()
    assert first in shown


def test_a_folder_that_is_not_an_edition_is_never_written_into(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("")
    with pytest.raises(bundle.BundleError, match="holds no edition"):
        bundle.build(tmp_path / "other", log=quiet)
    with pytest.raises(publish.PublishError, match="no learner's edition"):
        publish.publish(tmp_path / "other", ["stage1"], log=quiet)
    assert os.listdir(tmp_path / "other") == ["x"]
