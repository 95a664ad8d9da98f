"""Given code from an earlier stage (kernels/includes.py): expanded wherever a solution runs or ships."""

import pytest

from grader import stages
from grader.publishing import publish, release
from grader.grade import grade_stage
from grader.testing.mutants import Mutant, build
from kernels import includes
from kernels.loader import ROOT, load_file

EARLIER = '''import math

LOG2E = 1.4426950408889634   # log2(e)
LN2 = 0.6931471805599453
HEAD_DIMS = (16, 256)


def helper(x):
    return 2 * x


# A comment that belongs to the decorated function below.
@staticmethod
def twice(x):
    """Doubles x."""
    # TODO(1a): return twice x.
    # BEGIN SOLUTION
    # Given from now on: the answer of 1a.
    return helper(x)
    # END SOLUTION
'''


def _reader(files):
    return lambda module: files.get(module)


def test_an_include_line_becomes_the_earlier_answer_as_given_code():
    text = "import math\n# include: stage1_a.LOG2E, stage1_a.LN2, stage1_a.twice, stage1_a.helper\nx = 1\n"
    out = includes.expand(text, "stage2_b.py", _reader({"stage1_a": EARLIER}))
    assert "# include:" not in out
    assert "LOG2E = 1.4426950408889634   # log2(e)\nLN2 = 0.6931471805599453\n\n\n# A comment" in out
    assert "@staticmethod\ndef twice(x):" in out and "    return helper(x)\n\n\ndef helper(x):" in out
    assert "TODO(1a)" not in out and "SOLUTION" not in out
    assert "# Given from now on: the answer of 1a." in out          # a comment inside the block stays
    assert out.endswith("    return 2 * x\nx = 1\n")
    assert "HEAD_DIMS" not in out                                   # only what is named


def test_includes_expand_through_every_stage_and_a_file_without_them_is_unchanged():
    files = {"stage1_a": EARLIER, "stage2_b": "# include: stage1_a.helper\n",
             "stage3_c": "# include: stage2_b.helper\n"}
    out = includes.expand(files["stage3_c"], "stage3_c.py", _reader(files))
    assert out == "def helper(x):\n    return 2 * x\n"
    assert includes.expand(EARLIER, "stage1_a.py", _reader({})) == EARLIER
    quoted = '"""How to take code from stage 1:\n\n# include: stage1_a.helper\n"""\n'
    assert includes.expand(quoted, "stage2_b.py", _reader(files)) == quoted


@pytest.mark.parametrize("line, files, message", [
    ("# include: stage1_a.nothing\n", {"stage1_a": EARLIER}, "stage2_b.py:1: include stage1_a.nothing: "
                                                             "stage1_a.py has no top-level nothing"),
    ("# include: stage9_z.f\n", {}, "stage2_b.py:1: include stage9_z.f: there is no stage9_z.py beside stage2_b.py"),
    ("# include: helper\n", {}, "stage2_b.py:1: include 'helper': expected module.name"),
    ("# include: stage1_a.f\n", {"stage1_a": "# include: stage2_b.g\n"}, "a cycle, stage2_b.py -> stage1_a.py -> "
                                                                         "stage2_b.py"),
])
def test_a_wrong_include_names_the_file_line_and_name(line, files, message):
    files = dict(files, stage2_b=line)
    with pytest.raises(includes.IncludeError) as err:
        includes.expand(line, "stage2_b.py", _reader(files))
    assert message in str(err.value)


def test_the_loader_runs_an_included_triton_kernel(tmp_path):
    (tmp_path / "stage1_a.py").write_text(
        "from kernels import runtime  # noqa: F401\nimport triton\nimport triton.language as tl\n\n\n"
        "@triton.jit\ndef _double(X, N: tl.constexpr):\n    offs = tl.arange(0, N)\n"
        "    # TODO(1a): double X in place.\n    # BEGIN SOLUTION stub=pass\n"
        "    tl.store(X + offs, tl.load(X + offs) * 2)\n    # END SOLUTION\n")
    (tmp_path / "stage2_b.py").write_text(
        "import torch\nfrom kernels import runtime\nimport triton\nimport triton.language as tl\n\n"
        "# include: stage1_a._double\n\n\ndef double(x):\n    _double[(1,)](x, N=x.numel())\n    return x\n")
    module = load_file(tmp_path / "stage2_b.py")
    from kernels import runtime
    x = runtime.randn(8, dtype=__import__("torch").float32)
    assert (module.double(x.clone()) == 2 * x).all()
    assert module.__file__ == str(tmp_path / "stage2_b.py")


def test_release_gives_stage5s_answers_to_stage6_and_asks_only_for_its_own():
    learner = release.rendered()["stage6_gqa.py"]
    assert "# include:" not in learner and "SOLUTION" not in learner
    assert "full_hi = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N" in learner   # 5b, given
    assert "TODO(5" not in learner and "TODO(6a)" in learner and "h_kv = h // GROUP" not in learner
    assert release.check() == []


def test_a_stage_built_from_includes_is_graded_mutated_and_published_expanded(tmp_path):
    stage6 = stages.find("stage6")
    result = grade_stage(stage6, "solutions", only=["gqa_groups"])
    assert [r.status for r in result.results] == ["pass"], result.results
    mutant = Mutant("unsafe", "edits code stage 6 includes from stage 5",
                    edits=[('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new")])
    text = (build(stage6, mutant, tmp_path / "m") / f"{stage6.module}.py").read_text()
    assert "    m_safe = m_new  " in text and "# include:" not in text
    published = publish.files_of(stage6)[f"published/{stage6.module}.py"].decode()
    assert "# include:" not in published and "def _key_blocks(" in published and "SOLUTION" not in published
    assert "# include:" in (ROOT / "solutions" / f"{stage6.module}.py").read_text()


def test_progress_grades_a_stage_again_when_the_code_it_includes_changes(tmp_path):
    from grader import progress
    stage6 = stages.find("stage6")
    for name in ("stage3_flash_forward.py", "stage5_causal.py", f"{stage6.module}.py"):
        (tmp_path / name).write_text((ROOT / "solutions" / name).read_text())
    before = progress._key(stage6, str(tmp_path), "v")
    stage5 = tmp_path / "stage5_causal.py"
    stage5.write_text(stage5.read_text().replace("-inf - 0 is not", "-inf - 0 is a plain -inf"))
    assert progress._key(stage6, str(tmp_path), "v") != before


def test_instructor_files_use_only_the_public_names_of_a_learner_file():
    """attention_op (a package: its modules read as one text) and the TMA variants launch stage 9's
    kernels through the names stage 9 makes public (a learner's copy keeps them), never through its
    private ones."""
    import re
    stage9 = load_file(ROOT / "solutions" / "stage9_backward.py")
    for kernel in ("flash_forward_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"):
        assert getattr(stage9, kernel) is getattr(stage9, f"_{kernel}")
    for name in ("attention_op", "fast_forward_tma.py", "fast_backward_tma.py"):
        path = ROOT / "solutions" / name
        text = "\n".join(p.read_text() for p in sorted(path.glob("*.py"))) if path.is_dir() else path.read_text()
        modules = re.findall(r"^(\w+) = load_file\([^\n]*\"(stage\d\w*)\.py\"\)", text, re.M)
        assert modules or name == "fast_forward_tma.py", name
        for var, _ in modules:
            assert not re.search(rf"\b{var}\._[a-z]", text), f"{name} uses a private name of {var}"
        assert not re.search(r"load_file\([^\n]*\"stage\d\w*\.py\"\)\._", text), name


def test_the_feature_diff_of_stage5_and_stage6_is_the_gqa_feature():
    """What stage 6 adds to stage 5, as given code: the K/V head of a query head, and the lines that use
    GROUP, with nothing of stage 5's TODO paragraphs or solution markers, and no helper rewritten."""
    diff = includes.feature_diff(ROOT / "solutions" / "stage5_causal.py", ROOT / "solutions" / "stage6_gqa.py")
    changed = [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert "+    h_kv = h // GROUP" in changed
    assert not any("TODO" in line or "SOLUTION" in line for line in changed)
    assert not any(line.startswith(("-def ", "+def ")) for line in changed), "a helper changed between the stages"
    assert len(changed) < 80, "\n".join(changed)
    for earlier, later in (("stage6_gqa", "stage7_sliding_window"), ("stage7_sliding_window", "stage8_sinks")):
        diff = includes.feature_diff(ROOT / "solutions" / f"{earlier}.py", ROOT / "solutions" / f"{later}.py")
        assert not any("SOLUTION" in line for line in diff), later
