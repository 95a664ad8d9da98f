"""A learner's first hour: what the grader, --compare and the notebooks show before and while they write code.

Each test here pins down one thing a learner met and should not have: a point for code they had not
written, a hole that does not exist, a message that names the grader's file instead of theirs.
"""

from __future__ import annotations

from kernels.loader import ROOT
from kernels.solution_file import BEGIN, END, expand_file, label_above, render

import pytest

from grader import compare, holes, stages
from grader.publishing import publish
from grader.results import CheckResult, StageResult

needs_solutions = pytest.mark.skipif(not (ROOT / "solutions").is_dir(), reason="this copy has no solutions/")


# -- --compare: the holes it shows are the holes the learner has ---------------------------------

@needs_solutions
@pytest.mark.parametrize("name", [n for s in stages.STAGES for n in s.files()])
def test_published_holes_are_the_released_holes(name):
    """--compare's holes (publish.holes) and the grader's (holes.unfilled_in) agree, label by label: a
    solution-only block such as a __main__ is no hole, whatever TODO comes before it."""
    text = expand_file(ROOT / "solutions" / name)
    shown = [h["todo"] for h in publish.holes(text)]
    released = [label for label, _ in holes.unfilled_in(render(text, name), name)]
    assert shown == released


@needs_solutions
def test_compare_finds_every_hole_of_a_file_as_released(tmp_path):
    stage = stages.find("stage1")
    for rel, data in publish.files_of(stage).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    learner = tmp_path / "stages"
    learner.mkdir()
    (learner / f"{stage.module}.py").write_text(render(expand_file(ROOT / "solutions" / f"{stage.module}.py"),
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


# -- messages ---------------------------------------------------------------------------------------

def test_a_syntax_error_is_shown_once_at_the_learners_line(tmp_path):
    """The table and Gradescope's results show a syntax error once, at the learner's file and line, with the
    line itself; never a line of the grader's own loader."""
    from grader import formats
    from grader.grade import grade_stage
    from grader.results import format_result
    stage = stages.find("stage1")
    text = (ROOT / "stages" / f"{stage.module}.py").read_text()
    broken = text.replace("def online_softmax(", "def online_softmax(x:(", 1)
    line = next(i for i, ln in enumerate(broken.splitlines(), 1) if ln.startswith("def online_softmax(x:("))
    (tmp_path / f"{stage.module}.py").write_text(broken)
    result = grade_stage(stage, str(tmp_path))
    assert result.status == "import error"
    shown = format_result(stage, result, width=120)
    assert shown.count("SyntaxError") == 1 and f"line {line}" in shown, shown
    assert "def online_softmax(x:(" in shown and "loader.py" not in shown, shown
    tests = formats.gradescope([(stage, result)])["tests"]
    assert sum("SyntaxError" in t["output"] for t in tests) == 1, tests
    assert sum(t["max_score"] for t in tests) == result.max_score


def test_messages_wrap_to_the_terminals_width(monkeypatch):
    from grader.results import format_result
    stage = stages.find("stage1")
    cause = ("likely cause, TODO(1c): acc is not rescaled when the running max grows: acc = acc * alpha + p @ v, "
             "alpha = exp(m_old - m_new)")
    result = StageResult(stage.name, "stages", "graded", results=[
        CheckResult("attention_matches_reference", 2, 0, "FAIL", f"{cause}\no: max error 0.8 > allowed 3e-06")])
    monkeypatch.setenv("COLUMNS", "200")
    wide = format_result(stage, result).splitlines()
    assert any(ln.rstrip().endswith(cause) for ln in wide), wide      # the cause on one line, beside its check
    assert max(map(len, wide)) <= 200
    monkeypatch.setenv("COLUMNS", "72")
    narrow = format_result(stage, result).splitlines()
    assert max(map(len, narrow)) <= 72, narrow
    under = narrow[narrow.index(next(ln for ln in narrow if "attention_matches_reference" in ln)) + 1]
    assert under.strip().startswith("likely cause, TODO(1c):"), narrow     # the cause first, on its own line


def _scaled_wrong(scale):
    from kernels import reference, tolerance

    import torch
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    o, lse = reference.attention(q, k, v, sm_scale=scale)
    refs = (reference.attention(q, k, v), reference.attention(q, k, v, compute_dtype=torch.float32))
    allowed = tuple(tolerance.compare(x, r, b, name="x").allowed for x, r, b in zip((o, lse), *refs))
    return o.float(), lse.float(), q, k, v, allowed


def test_wrong_scale_reads_well_and_gives_exp2_advice_only_where_there_is_exp2():
    from grader import diagnose
    wrong_scale = diagnose.cause("wrong_scale")
    o, lse, q, k, v, allowed = _scaled_wrong(1.0)
    without = diagnose.attention(o, lse, q, k, v, {}, allowed=allowed, exp2=False)
    assert without.cause == "wrong_scale", without
    said = wrong_scale.read(without.message, form="")             # the message without advice about exp2
    assert said and said["used"] == "no scale at all: scores are q.k, unscaled", without.message
    assert "exp2" not in without.message and "log2(e)" not in without.message, without.message
    with_exp2 = diagnose.attention(o, lse, q, k, v, {}, allowed=allowed, exp2=True)
    assert with_exp2.cause == "wrong_scale" and wrong_scale.read(with_exp2.message, form="exp2"), with_exp2.message
    assert not diagnose.uses_exp2("stage1_online_softmax") and not diagnose.uses_exp2("stage2_first_triton")
    assert diagnose.uses_exp2("stage3_flash_forward") and diagnose.uses_exp2("stage9_backward")


# -- a diagnosis names its hole ---------------------------------------------------------------------

def _hole_labels(stage) -> set[str]:
    found = set()
    for name in stage.files():
        text = expand_file(ROOT / "solutions" / name)
        found |= {label for label, _ in holes.unfilled_in(render(text, name), name)}
    return found


def _hole_around(text: str, needle: str) -> str | None:
    """The TODO label of the solution block ``needle`` sits in, or None when it is in given code."""
    lines, label, inside = text.splitlines(), None, False
    for i, line in enumerate(lines[:text[:text.index(needle)].count("\n") + 1]):
        if BEGIN.match(line):
            inside, label = True, label_above(lines[:i])
        elif END.match(line):
            inside = False
    return label if inside else None


@needs_solutions
def test_every_diagnosis_label_is_a_hole_of_its_stage():
    import re

    from grader import diagnose
    for stage in stages.STAGES:
        labels = {lab for cause in diagnose.CAUSES.values() for lab in cause.labels(stage.number)}
        named = {m for lab in labels for m in re.findall(r"TODO\(\w+\)", lab)}
        assert named <= _hole_labels(stage), (stage.name, named - _hole_labels(stage))


@needs_solutions
@pytest.mark.parametrize("stage", [s.name for s in stages.STAGES])
def test_a_wrong_solution_is_diagnosed_in_the_hole_it_changed(stage):
    """Each wrong solution of tests/wrong whose edits lie in holes: the hole its diagnosis names is one it edited."""
    import importlib

    from grader import diagnose
    stage = stages.find(stage)
    for mutant in importlib.import_module(f"tests.wrong.{stage.name}").MUTANTS:
        if not mutant.diagnosis:
            continue
        text = expand_file(ROOT / "solutions" / f"{stage.module}{mutant.file}")
        edited = {_hole_around(text, old) for old, _ in mutant.edits}
        if None in edited:
            continue                       # it changes given code: no hole of the learner's to name
        named = diagnose.cause(mutant.diagnosis).labels(stage.number)
        assert all(any(label in n for n in named) for label in edited), (mutant.name, mutant.diagnosis, edited, named)


@needs_solutions
def test_the_grader_names_the_hole_of_the_likely_cause(tmp_path):
    import importlib

    from grader import diagnose
    from grader.grade import grade_stage
    from grader.testing import mutants
    stage = stages.find("stage1")
    mutant = next(m for m in importlib.import_module("tests.wrong.stage1").MUTANTS
                  if m.name == "attention_acc_not_rescaled")
    folder = mutants.build(stage, mutant, tmp_path / "sub")
    (r,) = grade_stage(stage, str(folder), only=["attention_matches_reference"], jobs=1).results
    assert r.status == "FAIL" and r.diagnosis == "acc_not_rescaled", r
    assert r.message.startswith("likely cause, TODO(1c): ") and diagnose.named(r.message) == "acc_not_rescaled", \
        r.message


# -- notebooks time the learner's kernel, never the instructors' ------------------------------------

def _bench_calls(notebook: str):
    """Each ``bench.run(...)`` call in a notebook's code cells: (its stage, the providers it would build)."""
    import ast
    import json

    from grader import bench
    found = []
    for cell in json.loads((ROOT / "notebooks" / notebook).read_text())["cells"]:
        code = "\n".join(ln for ln in "".join(cell["source"]).splitlines() if not ln.lstrip().startswith(("%", "!")))
        if cell["cell_type"] != "code" or "bench" not in code:
            continue
        tree = ast.parse(code)
        names = {n.targets[0].id: n.value for n in ast.walk(tree)
                 if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)}
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "bench.run":
                stage = ast.literal_eval(call.args[0])
                given = next((kw.value for kw in call.keywords if kw.arg == "providers"), None)
                given = names.get(given.id, given) if isinstance(given, ast.Name) else given
                providers = (eval(compile(ast.Expression(given), notebook, "eval"), {"bench": bench})
                             if given is not None else bench.cases.PROVIDERS.get(stage, bench.cases.DEFAULT_PROVIDERS))
                found.append((stage, list(providers)))
    return found


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")))
def test_a_notebooks_benchmark_builds_only_the_learners_kernel_and_pytorchs(notebook):
    from grader import bench
    for stage, providers in _bench_calls(notebook):
        assert providers and set(providers) <= set(bench.cases.LEARNER_PROVIDERS), (notebook, stage, providers)
    if notebook.startswith("04_"):
        assert [stage for stage, _ in _bench_calls(notebook)] == ["stage4"]      # the call is found at all


@needs_solutions
def test_stage4_checks_of_given_code_earn_nothing_before_the_learners_code_is_written(tmp_path):
    """block_schedule is given code, and the .cu as released compiles: their checks count once the
    emulation and the kernel's holes are written, not for the file as released."""
    from grader.grade import grade_stage
    stage = stages.find("stage4")
    for name in stage.files():
        (tmp_path / name).write_text((ROOT / "stages" / name).read_text())
    with open(tmp_path / f"{stage.module}.py", "a") as f:
        f.write("\n# started\n")
    result = grade_stage(stage, str(tmp_path), only=["schedule_visits_exactly_the_needed_tiles",
                                                      "cuda_source_compiles"], jobs=1)
    got = {r.name: r for r in result.results}
    assert not any(r.earned for r in result.results), result.results
    assert got["schedule_visits_exactly_the_needed_tiles"].status == "todo"
    assert "TODO(4e)" in got["schedule_visits_exactly_the_needed_tiles"].message
    assert got["cuda_source_compiles"].status in ("todo", "not run")      # "not run" where nvcc is missing
