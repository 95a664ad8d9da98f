"""A learner's first hour: what the grader, --compare and the notebooks show before and while they write code.

Each test here pins down one thing a learner met and should not have: a point for code they had not
written, a hole that does not exist, a message that names the grader's file instead of theirs.
"""

from __future__ import annotations

import pytest

from grader import holes, stages
from grader.grade import CheckResult, StageResult
from grader.publishing import compare, publish, release
from kernels.includes import expand_file
from kernels.loader import ROOT

needs_solutions = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="this copy has no solutions/")


# -- --compare: the holes it shows are the holes the learner has ---------------------------------

@needs_solutions
@pytest.mark.parametrize("name", [n for s in stages.STAGES for n in s.files()])
def test_published_holes_are_the_released_holes(name):
    """--compare's holes (publish.holes) and the grader's (holes.unfilled_in) agree, label by label: a
    solution-only block such as a __main__ is no hole, whatever TODO comes before it."""
    text = expand_file(ROOT / "solutions" / name)
    shown = [h["todo"] for h in publish.holes(text)]
    released = [label for label, _ in holes.unfilled_in(release.render(text, name), name)]
    assert shown == released


@needs_solutions
def test_compare_finds_every_hole_of_a_file_as_released(tmp_path):
    stage = stages.find("stage1")
    for rel, data in publish.files_of(stage).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    learner = tmp_path / "stages"
    learner.mkdir()
    (learner / f"{stage.module}.py").write_text(release.render(expand_file(ROOT / "solutions" / f"{stage.module}.py"),
                                                               f"{stage.module}.py"))
    result = StageResult(stage.name, "stages", "graded", results=[
        CheckResult("online_softmax_rows", 1, 0, "todo", calls=["online_softmax"])])
    shown = compare.compare(stage, result, learner, root=tmp_path)
    assert "could not find this hole" not in shown, shown
    assert [line.split()[0] for line in shown.splitlines() if line.startswith("  TODO(")] == \
        ["TODO(1a)", "TODO(1b)", "TODO(1c)", "TODO(1d)"]


# -- stage 9: no point for given code ---------------------------------------------------------------

@needs_solutions
def test_stage9_checks_of_given_code_earn_nothing_before_the_backward_is_written(tmp_path):
    """The released stage 9 file, started (TODO 9a written, say) but with TODO 9b-9d still empty: the
    checks whose subject is given code (the kernels' loops, the autograd.Function) earn nothing."""
    from grader.grade import grade_stage
    stage = stages.find("stage9")
    released = (ROOT / "stages" / f"{stage.module}.py").read_text()
    assert [label for label, _ in holes.unfilled_in(released, f"{stage.module}.py")][1:4] == \
        ["TODO(9b)", "TODO(9c)", "TODO(9d)"]
    (tmp_path / f"{stage.module}.py").write_text(released + "\n# started: TODO 9b-9d are next\n")
    result = grade_stage(stage, str(tmp_path), only=["backward_skips_blocks", "saves_nothing_quadratic"], jobs=1)
    assert result.status == "graded"
    got = {r.name: (r.earned, r.status) for r in result.results}
    assert got == {"backward_skips_blocks": (0, "todo"), "saves_nothing_quadratic": (0, "todo")}, result.results
    assert all("TODO(9b)" in r.message for r in result.results), [r.message for r in result.results]


def _run_cells(notebook: str, until: str, source: str, monkeypatch) -> str:
    """Run a notebook's code cells in this process, from its first after the Colab set-up through the
    first one that holds ``until``, against ``source``'s stage files; return what they printed."""
    import contextlib
    import io
    import json
    import matplotlib
    matplotlib.use("Agg")
    monkeypatch.setenv("WORKBOOK_SOURCE", source)
    cells = [c for c in json.loads((ROOT / "notebooks" / notebook).read_text())["cells"] if c["cell_type"] == "code"]
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cell in cells[1:]:
            code = "".join(cell["source"])
            exec(compile("\n".join(ln for ln in code.splitlines() if not ln.startswith("%")), notebook, "exec"),
                 namespace)
            if until in code:
                return out.getvalue()
    raise AssertionError(f"{notebook} has no cell with {until!r}")


@needs_solutions
def test_notebook9_says_nothing_passed_about_tiles_before_the_kernels_are_written(monkeypatch):
    printed = _run_cells("09_backward.ipynb", "def tiles_with_pairs", "stages", monkeypatch)
    tiles = [line for line in printed.splitlines() if "tiles with a visible pair" in line]
    assert len(tiles) == 4, printed
    assert all("not written yet" in line and "TODO(9b)" in line for line in tiles), tiles
