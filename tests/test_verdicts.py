"""Honest statuses: an unfilled hole is todo wherever it is, named by its label at its current line."""

import re

from kernels import runtime, solution_file
from kernels.loader import ROOT
from kernels.solution_file import BEGIN, END, render

import pytest

from grader import holes, stages
from grader.grade import grade_stage
from grader.publishing import release
from grader.results import format_result

STAGE1, STAGE3 = stages.find("stage1"), stages.find("stage3")


def _partly_done(stage, tmp_path, unfilled: set[str], *, lines_above: int = 0):
    """The stage file as a learner who filled every TODO except ``unfilled`` would have it.

    Made by release itself: the solution with the markers of the filled holes removed, rendered.
    ``lines_above`` comment lines go at the top, as a learner's notes would.
    """
    name = f"{stage.module}.py"
    lines = (ROOT / "solutions" / name).read_text().splitlines(keepends=True)
    out, label, keep_markers, inside = [], None, True, False
    for line in lines:
        found = re.search(r"TODO\(\w+\)", line)
        if found and line.lstrip().startswith("#"):
            label = found.group(0)[5:-1]
        if BEGIN.match(line):
            keep_markers, inside = (label in unfilled or label is None), True
            if not keep_markers:
                continue
        elif END.match(line) and inside:
            inside, label = False, None
            if not keep_markers:
                continue
        out.append(line)
    text = render("".join(out), name)
    text = "".join(f"# my note {i}\n" for i in range(lines_above)) + text
    folder = tmp_path / "sub"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder, text


def _line_of(text, label):
    return next(i for i, ln in enumerate(text.splitlines(), 1) if f"TODO({label})" in ln)


def test_the_released_files_have_their_holes_and_the_solutions_none():
    for stage in stages.STAGES:
        released = holes.find(ROOT / "stages", stage).unfilled
        assert released, f"{stage.name}: no hole found in the released file"
        assert all(h.label.startswith("TODO(") for h in released)
        assert holes.find(ROOT / "solutions", stage).unfilled == []


def test_holes_follow_the_learners_edits(tmp_path):
    folder, text = _partly_done(STAGE3, tmp_path, {"3b"}, lines_above=7)
    found = holes.find(folder, STAGE3).unfilled
    assert [(h.label, h.line, h.function) for h in found] == \
        [("TODO(3b)", _line_of(text, "3b"), "_flash_forward_kernel")]
    plain, _ = _partly_done(STAGE3, tmp_path / "plain", {"3b"})
    assert found[0].line == holes.find(plain, STAGE3).unfilled[0].line + 7
    # the wrapper reaches its kernel; padding_waste does not
    assert holes.find(folder, STAGE3).reached_by({"flash_attention"}) == found
    assert holes.find(folder, STAGE3).reached_by({"padding_waste"}) == []


def test_a_filled_hole_is_no_longer_one(tmp_path):
    folder, text = _partly_done(STAGE3, tmp_path, {"3b"})
    (folder / f"{STAGE3.module}.py").write_text(text.replace("        pass\n\n    # TODO(3c)",
                                                             "        k = 1\n\n    # TODO(3c)"))
    assert holes.find(folder, STAGE3).unfilled == []


def test_a_kernel_hole_is_todo_with_its_current_line_and_validation_waits(tmp_path):
    folder, text = _partly_done(STAGE3, tmp_path, {"3b"}, lines_above=5)
    result = grade_stage(STAGE3, str(folder), only=["unequal_lengths", "padding_waste_values", "bad_input"])
    got = {r.name: r for r in result.results}
    line = _line_of(text, "3b")
    assert got["unequal_lengths"].status == "todo"
    assert f"TODO(3b) at {STAGE3.module}.py line {line} in _flash_forward_kernel" in got["unequal_lengths"].message
    assert "hint" not in got["unequal_lengths"].message         # no invented explanation
    assert got["padding_waste_values"].status == "pass"
    assert got["bad_input"].status == "todo" and got["bad_input"].earned == 0
    assert "bad input counts once flash_attention is written" in got["bad_input"].message


def test_a_raising_stub_is_todo_at_its_current_line_not_the_released_one(tmp_path):
    folder, text = _partly_done(STAGE1, tmp_path, {"1c"}, lines_above=3)
    result = grade_stage(STAGE1, str(folder), only=["softmax_float16", "attention_matches_reference",
                                                    "attention_bad_input"])
    got = {r.name: r for r in result.results}
    assert got["softmax_float16"].status == "pass"
    assert got["attention_matches_reference"].status == "todo"
    assert f"TODO(1c) at {STAGE1.module}.py line {_line_of(text, '1c')}" in got["attention_matches_reference"].message
    assert got["attention_bad_input"].status == "todo" and got["attention_bad_input"].earned == 0


def test_an_import_error_is_shown_once(tmp_path):
    folder, text = _partly_done(STAGE1, tmp_path, set())
    (folder / f"{STAGE1.module}.py").write_text(text.replace("import math\n", "import math\ndef broken(:\n", 1))
    result = grade_stage(STAGE1, str(folder))
    shown = format_result(STAGE1, result)
    assert result.status == "import error"
    assert shown.count("SyntaxError") == 1, shown
    broken = next(i for i, ln in enumerate(text.splitlines(), 1) if ln == "import math") + 1
    assert f"line {broken}" in shown, shown
    assert "<frozen" not in shown, shown                  # no frame of Python's import machinery


def test_a_kernel_error_points_at_the_kernel_line_not_the_launch(tmp_path):
    text = (ROOT / "solutions" / f"{STAGE3.module}.py").read_text()
    good = "s = tl.dot(q, tl.trans(k)) * qk_scale"
    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / f"{STAGE3.module}.py").write_text(text.replace(good, "s = tl.dot(q, kk) * qk_scale"))
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if good in ln)
    result = grade_stage(STAGE3, str(folder), only=["unequal_lengths"])
    message = result.results[0].message
    assert result.results[0].status == "FAIL"
    assert f"line {line}, in _flash_forward_kernel: s = tl.dot(q, kk)" in message, message
    assert "hint" not in message
    # An error raised deep inside triton.language (an arange of a runtime value) still points at the
    # kernel line, however many of Triton's frames lie between it and either end of the traceback.
    good = "offs_d = tl.arange(0, HEAD_DIM_PAD)"
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if good in ln)
    (folder / f"{STAGE3.module}.py").write_text(text.replace(good, "offs_d = tl.arange(0, HEAD_DIM)"))
    message = grade_stage(STAGE3, str(folder), only=["unequal_lengths"]).results[0].message
    assert f"line {line}, in _flash_forward_kernel: offs_d = tl.arange(0, HEAD_DIM)" in message, message


def test_a_gpu_compile_error_is_mapped_to_its_file_line():
    import ast

    from triton.compiler.errors import CompilationError

    from grader import locate
    text = (ROOT / "solutions" / f"{STAGE3.module}.py").read_text()
    lines = text.splitlines()
    def_line = next(i for i, ln in enumerate(lines, 1) if ln.startswith("def _flash_forward_kernel("))
    bad = next(i for i, ln in enumerate(lines, 1) if "s = tl.dot(q, tl.trans(k)) * qk_scale" in ln)
    src = "\n".join(lines[def_line - 1:])                   # Triton's src starts at the def line
    node = ast.Name(id="k", lineno=bad - def_line + 1, col_offset=8)
    message = str(CompilationError(src, node, "incompatible dimensions"))
    got = locate.compile_error(message, text, f"{STAGE3.module}.py")
    assert got == (f"the kernel does not compile: incompatible dimensions ({STAGE3.module}.py line {bad}, in "
                   f"_flash_forward_kernel: {lines[bad - 1].strip()})")


def _cli(*args):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "grader", *args], cwd=ROOT, capture_output=True, text=True)


def test_cli_refuses_an_unknown_check_and_lists_the_real_ones():
    bad = _cli("stage1", "--solutions", "--only", "softmax_float16", "--only", "softmax_fp16")
    assert bad.returncode == 2
    assert "no check named 'softmax_fp16'" in bad.stderr and "softmax_float16" in bad.stderr
    assert "grading" not in bad.stdout                      # nothing ran


def test_cli_list_and_stage_help_name_every_check_with_points_and_gpu():
    listing = _cli("stage3", "--list")
    assert listing.returncode == 0
    for c in STAGE3.checks():
        row = next((ln for ln in listing.stdout.splitlines() if ln.split()[:1] == [c.name]), None)
        assert (row is not None) != c.hidden, c.name
        if row:
            assert row.split()[1] == str(c.points) and ("GPU only" in row) == c.gpu
    helped = _cli("stage3", "--help")
    assert helped.returncode == 0 and "stages/stage3_flash_forward.py" in helped.stdout
    assert all(c.name in helped.stdout for c in STAGE3.checks() if not c.hidden)


def test_progress_caches_by_content_and_names_the_next_stage(tmp_path, monkeypatch):
    import io

    from grader import progress
    monkeypatch.setattr(progress, "CACHE", tmp_path / "cache")
    folder, text = _partly_done(STAGE1, tmp_path, {"1d"})
    first, second = io.StringIO(), io.StringIO()
    assert progress.progress(str(folder), out=first) == 1
    assert "grading stage1 (9 checks)" in first.getvalue() and "from .grader-cache" not in first.getvalue()
    assert "next: stage1: fill in what the 4 todo check(s) above name (" in first.getvalue()
    assert f"notebooks/{STAGE1.notebook}" in first.getvalue()
    progress.progress(str(folder), out=second)
    assert "grading stage1" not in second.getvalue() and "1 stage(s) unchanged" in second.getvalue()

    def table(out):
        return [ln for ln in out.getvalue().splitlines() if ln.startswith("  stage1 ")]

    assert table(first) == table(second)
    (folder / f"{STAGE1.module}.py").write_text(text + "\n# an edit\n")     # new content: graded again
    third = io.StringIO()
    progress.progress(str(folder), out=third)
    assert "grading stage1" in third.getvalue()


def test_progress_over_stages_not_started_probes_nothing_and_renders_each_file_once(tmp_path, monkeypatch):
    """A stage left as released is "not started" from its bytes alone: no sandbox is probed, and
    deciding it renders that one stage file, not the whole release (which took seconds per stage)."""
    import io

    from grader import grade, progress
    folder = tmp_path / "stages"
    folder.mkdir()
    for name, text in release.rendered().items():          # every stage file as release writes it
        (folder / name).write_text(text)
    monkeypatch.setattr(progress, "CACHE", tmp_path / "cache")
    monkeypatch.setattr(grade.choice, "choose", lambda *a, **k: pytest.fail("probed a sandbox for nothing"))
    rendered = []
    real = solution_file.render
    monkeypatch.setattr(solution_file, "render", lambda text, name: rendered.append(name) or real(text, name))
    out = io.StringIO()
    assert progress.progress(str(folder), out=out) == 0
    assert all(f"  {s.name} " in out.getvalue() for s in stages.STAGES) and "not started" in out.getvalue()
    names = [f"{s.module}.py" for s in stages.STAGES]
    assert sorted(rendered) == sorted(names * 2)        # once in progress, once in grade_stage: no more


def test_without_solutions_a_todo_above_a_stub_is_a_hole(tmp_path):
    # A learner's bundle has no solutions/: holes are then TODO comments right above a stub release writes.
    name = f"{STAGE3.module}.py"
    text = (ROOT / "stages" / name).read_text()
    with_solutions = [label for label, _ in holes.unfilled_in(text, name)]
    without = holes.unfilled_in(text, name, solutions=tmp_path / "no-solutions")
    assert [label for label, _ in without] == with_solutions == ["TODO(3d)", "TODO(3a)", "TODO(3b)", "TODO(3c)"]
    assert [line for _, line in without] == [_line_of(text, x) for x in ("3d", "3a", "3b", "3c")]
    filled = text.replace("        pass\n\n    # TODO(3c)", "        acc += 1\n\n    # TODO(3c)")
    assert "TODO(3b)" not in [label for label, _ in holes.unfilled_in(filled, name, solutions=tmp_path / "none")]


def test_stubs_name_their_todo_and_copies_released_with_line_numbers_still_count_as_unfilled():
    # A stub says which TODO it stands for, which stays true however the file is edited above it;
    # copies released when stubs gave a line number ("fill in the TODO at line N") keep their holes.
    name = f"{STAGE1.module}.py"
    text = (ROOT / "stages" / name).read_text()
    assert 'raise NotImplementedError("stage1_online_softmax.py: TODO(1a) is not written yet")' in text
    assert "at line" not in text
    old_style = re.sub(r'"(stage1_online_softmax\.py): TODO\(\w+\) is not written yet"',
                       r'"\1: fill in the TODO at line 999"', text)
    assert old_style != text
    assert holes.unfilled_in(old_style, name) == holes.unfilled_in(text, name) != []


def _mutant(stage_name: str, name: str):
    """The wrong solution ``name`` of tests/wrong/<stage>.py."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(f"wrong_{stage_name}", ROOT / "tests" / "wrong" / f"{stage_name}.py")
    wrong = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wrong)
    return next(m for m in wrong.MUTANTS if m.name == name)


def test_notebooks_get_the_graders_diagnosis(tmp_path):
    from kernels import loader

    import torch

    from grader import diagnose
    from grader.testing import mutants
    stage = stages.find("stage5")
    mutant = _mutant("stage5", "top_left_alignment")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).to(runtime.DEVICE) for n in (17, 129, 129))
    for folder, expected in ((mutants.build(stage, mutant, tmp_path / "wrong"), "causal_top_left"),
                             (ROOT / "solutions", None)):
        module = loader.load_file(folder / f"{stage.module}.py")
        o, lse = module.flash_attention(q, k, v, causal=True, block_m=16, block_n=32)
        cause = diagnose.explain_attention(o, lse, q, k, v, block_m=16, block_n=32, causal=True)
        assert (diagnose.named(cause) == expected) if expected else cause == "", cause


def test_padding_columns_are_named_even_when_the_read_past_the_end_is_nan():
    """Loading q and k without the head-dim mask reads the next row's numbers into the padding columns,
    and the last head reads past the tensor: when what lies there is NaN, the cause is still named."""
    from kernels import reference

    import torch

    from grader import diagnose
    g = torch.Generator().manual_seed(3)
    B, H, N, D, PAD = 1, 3, 8, 24, 32
    q, k, v = (torch.randn(B, H, N, D, generator=g, dtype=torch.float64) for _ in range(3))

    def padded(t):          # each row read PAD wide from the flat buffer, NaN past its end
        flat = torch.cat([t.flatten(), torch.full((PAD,), float("nan"), dtype=t.dtype)])
        rows = torch.stack([flat[r * D: r * D + PAD] for r in range(B * H * N)])
        return rows.view(B, H, N, PAD)

    qp, kp = padded(q), padded(k)
    vp = torch.cat([v, torch.zeros(B, H, N, PAD - D, dtype=v.dtype)], dim=-1)
    o, lse = reference.attention(qp, kp, vp, sm_scale=D ** -0.5)
    o = o[..., :D].float()
    lse = lse.float()
    assert torch.isnan(o[0, -1]).any() and not torch.isnan(o[0, :-1]).any()
    cause = diagnose.explain_attention(o, lse, q.float(), k.float(), v.float())
    said = diagnose.cause("padding_columns_unmasked").read(cause)
    assert said and (said["first"], said["last"]) == ("24", "31"), cause
    # NaN in a head that reads nothing past the end is not put down to the padding columns
    o[0, 0, 0, 0] = float("nan")
    cause = diagnose.explain_attention(o, lse, q.float(), k.float(), v.float())
    assert cause.startswith("likely cause: ") and diagnose.cause("nan").read(cause, form=""), cause


def test_on_a_gpu_older_than_sm_80_its_checks_are_not_run_not_failed(monkeypatch):
    """A T4 (sm_75) has no bfloat16 and no mma.sync.m16n8k16: those checks say so instead of failing."""
    from kernels import runtime

    from grader import grade
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setattr(runtime, "capability", lambda: (7, 5))

    called = []

    class NoRunner:         # neither check may reach learner code
        last_call, stage, source = None, "stage4_variable_block", "solutions"

        def call(self, fn_name, *args, **kwargs):
            called.append(fn_name)
            raise RuntimeError("no kernel here")

    by_name = {c.name: c for s in ("stage3", "stage4") for c in stages.find(s).checks()}
    kernel = grade.run_check(by_name["kernel_head_dims"], NoRunner(), seed=0)
    assert kernel.status == "not run" and kernel.message == "needs an sm_80 or newer GPU; this one is sm_75"
    bf16 = grade.run_check(by_name["gpu_bfloat16"], NoRunner(), seed=0)
    assert bf16.status == "not run" and "needs bfloat16" in bf16.message and "sm_75" in bf16.message
    assert called == []
    monkeypatch.setattr(runtime, "capability", lambda: (9, 0))
    monkeypatch.setattr(runtime, "has_bfloat16", lambda: True)
    grade.run_check(by_name["kernel_head_dims"], NoRunner(), seed=0)
    assert called == ["flash_attention"]


def _autograd(q, k, v, do, sinks=None, **opts):
    """dq, dk, dv, dsinks of the float64 reference by autograd: the answer the diagnosis must agree with."""

    from kernels import reference
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    s = sinks.detach().double().requires_grad_(True) if sinks is not None else None
    o, _ = reference.attention(*leaves, sinks=s, **opts)
    o.backward(do.double())
    return (*(t.grad for t in leaves), s.grad if s is not None else None)


def test_gradient_diagnoses_name_the_mistake_and_blame_nothing_on_right_answers():
    import torch

    from grader import diagnose
    g = torch.Generator().manual_seed(5)
    B, Hq, Hkv, N, D = 1, 4, 2, 24, 16
    q, do = (torch.randn(B, Hq, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, N, D, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(Hq, generator=g, dtype=torch.float64)
    opts = dict(causal=True, window=9, sinks=sinks)
    dq, dk, dv, ds = _autograd(q, k, v, do, **opts)
    allowed = {n: 1e-9 for n in ("dq", "dk", "dv", "dsinks")}

    def cause(**wrong):
        got = dict(dict(dq=dq, dk=dk, dv=dv, dsinks=ds), **wrong)
        found = diagnose.gradients(got, q, k, v, do, opts, allowed=allowed)
        return found.cause if found else None

    assert cause() is None
    scale = D ** -0.5
    assert cause(dq=dq / scale) == "dq_unscaled"
    assert cause(dsinks=-ds) == "dsinks_sign_flipped"
    assert cause(dsinks=torch.zeros_like(ds)) == "dsinks_left_out"
    first = do.clone()
    first[:, 1::2] = 0                         # only the first query head of each group of two
    _, dk1, dv1, _ = _autograd(q, k, v, first, **opts)
    assert cause(dk=dk1, dv=dv1) == "gqa_first_head_only"
    assert cause(dq=dq * 1.5) is None          # a mistake it does not know: no cause is invented


def test_notebooks_get_the_graders_diagnosis_of_gradients(tmp_path):
    """Notebook 09's check cells name the cause of wrong gradients as the grader does, and none for right ones."""
    from kernels import loader

    import torch

    from grader import diagnose
    from grader.testing import mutants
    stage = stages.find("stage9")
    mutant = _mutant("stage9", "tiled_dq_unscaled")
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, h, 30, 16, generator=g).to(runtime.DEVICE) for h in (4, 2, 2, 4))
    sinks = torch.randn(4, generator=g).to(runtime.DEVICE)            # the kernels run where a learner's do
    opts = dict(causal=True, window=7, sink_tokens=2)
    for folder, expected in ((mutants.build(stage, mutant, tmp_path / "wrong"), "dq_unscaled"),
                             (ROOT / "solutions", None)):
        module = loader.load_file(folder / f"{stage.module}.py")
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
        module.tiled_attention(*leaves[:3], sinks=leaves[3], **opts).backward(do)
        cause = diagnose.explain_gradients([t.grad for t in leaves], q, k, v, do, sinks=sinks, **opts)
        if expected:
            assert cause.startswith("likely cause:") and diagnose.named(cause) == expected, cause
        else:
            assert cause == "", cause


def test_an_all_nan_softmax_is_never_written_unless_its_rows_hold_nothing_but_minus_inf():
    """NaN everywhere is the grader's fill, never overwritten; but a row of -inf alone gives NaN by a
    missing m_safe, so there the masked-tile cause is named instead."""
    import torch

    from grader import diagnose
    x = torch.randn(3, 40)
    assert diagnose.softmax(torch.full_like(x, float("nan")), x, allowed=1e-6).cause == "nan_unwritten"
    masked = torch.full((1, 17), float("-inf"))
    got = diagnose.softmax(torch.full_like(masked, float("nan")), masked, allowed=1e-6)
    assert got.cause == "nan_masked_tile", got


def test_list_says_which_checks_given_code_alone_passes():
    from grader import grade_stages, stages
    stage4 = stages.find("stage4")
    given = [c for c in stage4.checks() if c.given and not c.hidden]
    assert given, "stage 4 has checks that given code alone passes"
    rows = {ln.split()[0]: ln for ln in grade_stages.check_list(stage4).splitlines()[2:] if ln.startswith("  ")}
    for c in stage4.checks():
        if not c.hidden:
            assert ("given code passes it" in rows[c.name]) == c.given, c.name
