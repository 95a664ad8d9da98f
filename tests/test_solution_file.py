"""Solution files (kernels/solution_file.py): plain Python whose given code from an earlier stage is
an import, expanded wherever a solution ships or runs as the learner's file does."""

import ast
import builtins
import functools
import os
import subprocess
import symtable
import sys

from kernels import solution_file
from kernels.loader import ROOT, load_file

import pytest

from grader import stages
from grader.grade import grade_stage
from grader.publishing import publish, release
from grader.testing.mutants import Mutant, build

SOLUTIONS = ROOT / "solutions"

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


def test_a_given_import_becomes_the_earlier_answer_as_given_code():
    text = ("import math\nfrom solutions.stage1_a import LOG2E, LN2, twice, helper  # given\nx = 1\n")
    out = solution_file.expand(text, "stage2_b.py", _reader({"stage1_a": EARLIER}))
    assert "solutions" not in out and "# given" not in out
    assert "LOG2E = 1.4426950408889634   # log2(e)\nLN2 = 0.6931471805599453\n\n\n# A comment" in out
    assert "@staticmethod\ndef twice(x):" in out and "    return helper(x)\n\n\ndef helper(x):" in out
    assert "TODO(1a)" not in out and "SOLUTION" not in out
    assert "# Given from now on: the answer of 1a." in out          # a comment inside the block stays
    assert out.endswith("    return 2 * x\nx = 1\n")
    assert "HEAD_DIMS" not in out                                   # only what is named


def test_consecutive_given_imports_are_one_block_and_a_parenthesized_one_is_one_statement():
    split = ("from solutions.stage1_a import LOG2E  # given\nfrom solutions.stage1_a import (  # given\n"
             "    LN2, twice,\n)\nfrom solutions.stage1_a import helper  # given\n")
    joined = "from solutions.stage1_a import LOG2E, LN2, twice, helper  # given\n"
    files = {"stage1_a": EARLIER}
    assert (solution_file.expand(split, "stage2_b.py", _reader(files))
            == solution_file.expand(joined, "stage2_b.py", _reader(files)))


def test_given_code_expands_through_every_stage_and_a_file_without_it_is_unchanged():
    files = {"stage1_a": EARLIER, "stage2_b": "from solutions.stage1_a import helper  # given\n",
             "stage3_c": "from solutions.stage2_b import helper  # given\n"}
    out = solution_file.expand(files["stage3_c"], "stage3_c.py", _reader(files))
    assert out == "def helper(x):\n    return 2 * x\n"
    assert solution_file.expand(EARLIER, "stage1_a.py", _reader({})) == EARLIER
    quoted = '"""How to take code from stage 1:\n\nfrom solutions.stage1_a import helper  # given\n"""\n'
    assert solution_file.expand(quoted, "stage2_b.py", _reader(files)) == quoted
    unmarked = "from solutions.stage1_a import helper\n"           # not given code: left to Python
    assert solution_file.expand(unmarked, "stage2_b.py", _reader(files)) == unmarked


@pytest.mark.parametrize("line, files, message", [
    ("from solutions.stage1_a import nothing  # given\n", {"stage1_a": EARLIER},
     "stage2_b.py:1: given stage1_a.nothing: stage1_a.py has no top-level nothing"),
    ("from solutions.stage9_z import f  # given\n", {},
     "stage2_b.py:1: given stage9_z.f: there is no stage9_z.py beside stage2_b.py"),
    ("from solutions import helper  # given\n", {}, "stage2_b.py:1: given code is imported at the top level, by name"),
    ("if True:\n    from solutions.stage1_a import helper  # given\n", {"stage1_a": EARLIER},
     "stage2_b.py:2: given code is imported at the top level"),
    ("from solutions.stage1_a import helper as h  # given\n", {"stage1_a": EARLIER},
     "stage2_b.py:1: given stage1_a.helper: given code keeps its name"),
    ("from solutions.stage1_a import f  # given\n", {"stage1_a": "from solutions.stage2_b import g  # given\n"},
     "a cycle, stage2_b.py -> stage1_a.py -> stage2_b.py"),
])
def test_a_wrong_given_import_names_the_file_line_and_name(line, files, message):
    files = dict(files, stage2_b=line)
    with pytest.raises(solution_file.GivenCodeError) as err:
        solution_file.expand(line, "stage2_b.py", _reader(files))
    assert message in str(err.value)


def test_release_refuses_a_learner_file_that_would_import_the_solutions(tmp_path):
    (tmp_path / "stage1_a.py").write_text(EARLIER)
    (tmp_path / "stage2_b.py").write_text("from solutions.stage1_a import helper\n")
    with pytest.raises(solution_file.GivenCodeError, match="stage2_b.py:1: import of solutions.stage1_a"):
        release.rendered(tmp_path)


def test_the_loader_runs_a_given_triton_kernel(tmp_path):
    (tmp_path / "stage1_a.py").write_text(
        "from kernels import runtime  # noqa: F401\nimport triton\nimport triton.language as tl\n\n\n"
        "@triton.jit\ndef _double(X, N: tl.constexpr):\n    offs = tl.arange(0, N)\n"
        "    # TODO(1a): double X in place.\n    # BEGIN SOLUTION stub=pass\n"
        "    tl.store(X + offs, tl.load(X + offs) * 2)\n    # END SOLUTION\n")
    (tmp_path / "stage2_b.py").write_text(
        "import torch\nfrom kernels import runtime\nimport triton\nimport triton.language as tl\n\n"
        "from solutions.stage1_a import _double  # given\n\n\ndef double(x):\n    _double[(1,)](x, N=x.numel())\n"
        "    return x\n")
    module = load_file(tmp_path / "stage2_b.py")
    from kernels import runtime
    x = runtime.randn(8, dtype=__import__("torch").float32)
    assert (module.double(x.clone()) == 2 * x).all()
    assert module.__file__ == str(tmp_path / "stage2_b.py")


def test_release_gives_stage5s_answers_to_stage6_and_asks_only_for_its_own():
    learner = release.rendered()["stage6_gqa.py"]
    assert "from solutions" not in learner and "# given" not in learner and "SOLUTION" not in learner
    assert "full_hi = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N" in learner   # 5b, given
    assert "TODO(5" not in learner and "TODO(6a)" in learner and "h_kv = h // GROUP" not in learner
    assert release.check() == []


def test_a_stage_built_from_given_code_is_graded_mutated_and_published_expanded(tmp_path):
    stage6 = stages.find("stage6")
    result = grade_stage(stage6, "solutions", only=["gqa_groups"])
    assert [r.status for r in result.results] == ["pass"], result.results
    mutant = Mutant("unsafe", "edits code stage 6 takes from stage 5",
                    edits=[('m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new")])
    text = (build(stage6, mutant, tmp_path / "m") / f"{stage6.module}.py").read_text()
    assert "    m_safe = m_new  " in text and "# given" not in text
    published = publish.files_of(stage6)[f"published/{stage6.module}.py"].decode()
    assert "# given" not in published and "def _key_blocks(" in published and "SOLUTION" not in published
    assert "# given" in (SOLUTIONS / f"{stage6.module}.py").read_text()


def test_progress_grades_a_stage_again_when_its_given_code_changes(tmp_path):
    from grader import progress
    stage6 = stages.find("stage6")
    for name in ("stage3_flash_forward.py", "stage5_causal.py", f"{stage6.module}.py"):
        (tmp_path / name).write_text((SOLUTIONS / name).read_text())
    before = progress._key(stage6, str(tmp_path), "v")
    stage5 = tmp_path / "stage5_causal.py"
    stage5.write_text(stage5.read_text().replace("-inf - 0 is not", "-inf - 0 is a plain -inf"))
    assert progress._key(stage6, str(tmp_path), "v") != before


def test_instructor_files_use_only_the_public_names_of_a_learner_file():
    """attention_op (a package: its modules read as one text) and the TMA variants launch stage 9's
    kernels through the names stage 9 makes public (a learner's copy keeps them), never through its
    private ones."""
    import re
    stage9 = load_file(SOLUTIONS / "stage9_backward.py")
    for kernel in ("flash_forward_kernel", "bwd_preprocess_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"):
        assert getattr(stage9, kernel) is getattr(stage9, f"_{kernel}")
    for name in ("attention_op", "fast_forward_tma.py", "fast_backward_tma.py"):
        path = SOLUTIONS / name
        text = "\n".join(p.read_text() for p in sorted(path.glob("*.py"))) if path.is_dir() else path.read_text()
        modules = re.findall(r"^(\w+) = load_file\([^\n]*\"(stage\d\w*)\.py\"\)", text, re.M)
        assert modules or name == "fast_forward_tma.py", name
        for var, _ in modules:
            assert not re.search(rf"\b{var}\._[a-z]", text), f"{name} uses a private name of {var}"
        assert not re.search(r"load_file\([^\n]*\"stage\d\w*\.py\"\)\._", text), name


def test_the_feature_diff_of_stage5_and_stage6_is_the_gqa_feature():
    """What stage 6 adds to stage 5, as given code: the K/V head of a query head, and the lines that use
    GROUP, with nothing of stage 5's TODO paragraphs or solution markers, and no helper rewritten."""
    diff = solution_file.feature_diff(SOLUTIONS / "stage5_causal.py", SOLUTIONS / "stage6_gqa.py")
    changed = [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert "+    h_kv = h // GROUP" in changed
    assert not any("TODO" in line or "SOLUTION" in line for line in changed)
    assert not any(line.startswith(("-def ", "+def ")) for line in changed), "a helper changed between the stages"
    assert len(changed) < 80, "\n".join(changed)
    for earlier, later in (("stage6_gqa", "stage7_sliding_window"), ("stage7_sliding_window", "stage8_sinks")):
        diff = solution_file.feature_diff(SOLUTIONS / f"{earlier}.py", SOLUTIONS / f"{later}.py")
        assert not any("SOLUTION" in line for line in diff), later


# -- an import and its expansion mean the same ----------------------------------------------------
# Imported, given code finds its globals in the module that defines it; expanded, in the file that
# takes it.  The two agree when every global name the given code uses is bound to the same thing in
# both: the same definition (followed through given imports to the file that writes it), the same
# imported module or name, or a builtin that neither file rebinds.

@functools.lru_cache(maxsize=None)
def _bindings(folder, module: str) -> dict[str, frozenset]:
    """Top-level name of <folder>/<module>.py -> what binds it: ("def", module, name) for a definition
    (a given import's, from the file that writes it), ("import", module, name) for other imports."""
    text = (folder / f"{module}.py").read_text()
    given = {g.first: g for g in solution_file.given_imports(text, f"{module}.py")}
    found: dict[str, set] = {}

    def visit(body):
        for node in body:
            if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
                continue                                # the file's own benchmark: not its namespace
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                for part in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                             *[h.body for h in getattr(node, "handlers", [])]):
                    visit(part)
            elif isinstance(node, ast.ImportFrom) and node.lineno in given:
                for name in given[node.lineno].names:
                    origin = _bindings(folder, given[node.lineno].module).get(name, {("missing", module, name)})
                    found.setdefault(name, set()).update(origin)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    bound = alias.asname or alias.name.split(".")[0]
                    what = alias.name if alias.asname or isinstance(node, ast.ImportFrom) else bound
                    found.setdefault(bound, set()).add(("import", getattr(node, "module", None), what))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(node.name, set()).add(("def", module, node.name))
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                        found.setdefault(name, set()).add(("def", module, name))

    visit(ast.parse(text).body)
    return {name: frozenset(origin) for name, origin in found.items()}


def _globals_used(folder, module: str, name: str) -> set[str]:
    """The global names the definition of ``name`` in <folder>/<module>.py uses: in its body (nested
    functions too), its decorators and default values, or an assignment's value."""
    text = (folder / f"{module}.py").read_text()
    tables = {(t.get_name(), t.get_lineno()): t for t in symtable.symtable(text, module, "exec").get_children()}
    used = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            todo = [tables[(name, node.lineno)]]
            while todo:
                table = todo.pop()
                used |= {s.get_name() for s in table.get_symbols() if s.is_global() and s.is_referenced()}
                todo += table.get_children()
            outer = list(node.decorator_list) + (
                node.bases + [k.value for k in node.keywords] if isinstance(node, ast.ClassDef)
                else node.args.defaults + [d for d in node.args.kw_defaults if d is not None])
            used |= {n.id for part in outer for n in ast.walk(part) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if name in {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}:
                used |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    return used


def _late_bound(path) -> list[str]:
    """Each global name that the given code of the solution file ``path`` uses and that file binds
    otherwise than the file that writes the code."""
    folder, taker = path.parent, path.stem
    problems = []
    for given in solution_file.given_imports(path.read_text(), path.name):
        for name in given.names:
            ((kind, writer, _),) = _bindings(folder, given.module)[name]
            assert kind == "def", f"{taker}: given {given.module}.{name} is not defined in a solution file"
            for used in sorted(_globals_used(folder, writer, name)):
                there, here = _bindings(folder, writer).get(used), _bindings(folder, taker).get(used)
                if there is None and here is None and hasattr(builtins, used):
                    continue
                if there != here:
                    problems.append(f"{taker}: given {given.module}.{name} (written in {writer}) uses {used}, "
                                    f"which is {sorted(there or ['unbound'])} there but {sorted(here or ['unbound'])} "
                                    f"in {taker}")
    return problems


def test_given_code_uses_no_name_the_file_that_takes_it_binds_otherwise():
    """Otherwise a plain import and the learner's (expanded) file would run different code: what
    differs between stages, such as the kernel a helper launches, is an argument instead."""
    files = [p for p in sorted(SOLUTIONS.glob("stage*.py")) if solution_file.has_given_code(p.read_text())]
    assert len(files) >= 5
    problems = [line for path in files for line in _late_bound(path)]
    assert not problems, "\n".join(problems)


def test_the_late_binding_check_sees_a_helper_that_names_the_stages_own_kernel(tmp_path):
    """Stage 5's _launch_setup, as it was when it named _flash_forward_kernel instead of taking it:
    every later stage defines its own, which the expansion launched and an import would not."""
    (tmp_path / "stage5_x.py").write_text("def _kernel():\n    pass\n\n\ndef _launch():\n    return _kernel\n")
    (tmp_path / "stage6_y.py").write_text("from solutions.stage5_x import _launch  # given\n\n\n"
                                          "def _kernel():\n    pass\n")
    (problem,) = _late_bound(tmp_path / "stage6_y.py")
    assert "given stage5_x._launch (written in stage5_x) uses _kernel" in problem
    (tmp_path / "stage7_z.py").write_text("from solutions.stage5_x import _launch  # given\n")
    (problem,) = _late_bound(tmp_path / "stage7_z.py")           # and one the expansion would not find
    assert "uses _kernel, which is [('def', 'stage5_x', '_kernel')] there but ['unbound'] in stage7_z" in problem


# -- solution files are plain Python ---------------------------------------------------------------
_SMALL = """
import sys, torch
from kernels import reference, runtime
q, k, v = (runtime.randn(1, 2, 40, 16, dtype=torch.float32) for _ in range(3))
o_ref, lse_ref = reference.attention(q, k, v, causal=True)
tol = 1e-4 if runtime.INTERPRET else 1e-2      # a GPU's float32 dots may round through TF32
"""
_CALLS = {
    "stage5_causal": "from solutions.stage5_causal import flash_attention\n"
                     "o, lse = flash_attention(q, k, v, causal=True)\n"
                     "assert flash_attention.__module__ == 'solutions.stage5_causal'\n"
                     "assert (o.double() - o_ref).abs().max() < tol and (lse.double() - lse_ref).abs().max() < tol\n",
    "stage6_gqa": "from solutions.stage6_gqa import flash_attention\n",
    "stage7_sliding_window": "from solutions.stage7_sliding_window import flash_attention\n",
    "stage8_sinks": "from solutions.stage8_sinks import flash_attention\n"
                    "sinks = torch.tensor([-1.0, 2.0], device=q.device)\n"
                    "o, lse = flash_attention(q, k[:, :1], v[:, :1], causal=True, window=9, sink_tokens=3, "
                    "sinks=sinks)\n"
                    "o_ref, lse_ref = reference.attention(q, k[:, :1], v[:, :1], causal=True, window=9, "
                    "sink_tokens=3, sinks=sinks)\n"
                    "assert (o.double() - o_ref).abs().max() < tol and (lse.double() - lse_ref).abs().max() < tol\n",
    "stage9_backward": "from solutions.stage9_backward import attention\n"
                       "do = runtime.randn(1, 2, 40, 16, dtype=torch.float32)\n"
                       "leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]\n"
                       "o = attention(*leaves, causal=True, window=9)\n"
                       "o.backward(do)\n"
                       "ref = reference.attention_grads(q, k, v, do, causal=True, window=9)\n"
                       "assert (o.double() - ref[0]).abs().max() < tol\n"
                       "for leaf, grad in zip(leaves, ref[1:4]):\n"
                       "    assert (leaf.grad.double() - grad).abs().max() < 10 * tol\n",
}


@pytest.mark.parametrize("module", sorted(_CALLS))
def test_a_solution_imports_and_runs_as_plain_python(module):
    """``python -c "from solutions.stage5_causal import flash_attention"``, then a call, in a fresh
    Python (on the CPU, Triton's interpreter): no loader, no expansion, the file as it is."""
    script = _SMALL + _CALLS[module] + (
        "assert not [m for m in sys.modules if m.startswith('workbook_')], 'loaded through kernels.loader'\n"
        f"assert sys.modules['solutions.{module}'].__file__ == {str(SOLUTIONS / (module + '.py'))!r}\n")
    env = dict(os.environ, PYTHONPATH="")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
