"""Fault injection: broken and hostile submissions fail, each with its reason, and grading goes on.

Each submission is stage 1's solution with one edit (stage 1 is plain PyTorch, so a worker starts
and answers in seconds).  Every fault must fail the check it meets with the expected status and a
message naming the cause; a fault that turned into a pass, a traceback or a stopped grader would
fail the test.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from dataclasses import dataclass

from kernels.loader import ROOT

import pytest
import torch

from grader import sanitize, stages
from grader.grade import grade_stage
from grader.isolation.limits import Limits
from grader.testing import mutants

STAGE1 = stages.find("stage1")
# Faults that should be stopped by something other than time get a time limit far beyond what they need
# on the busiest machine, so a slow machine cannot turn their verdict into "timeout"; the two that must
# time out get a short one.
LIMITS = Limits(check_timeout=120, stage_timeout=300, memory_mb=1500, output_kb=256)
HANG_LIMITS = Limits(check_timeout=5, stage_timeout=60, memory_mb=1500, output_kb=256)
QUICK = {"segfault", "mutates_inputs", "imports_solutions", "prints_megabytes"}  # the rest are marked slow
SOFTMAX, ATTENTION = "softmax_float16", "attention_lse_and_scale"   # one and two learner calls
IMPORT = "import math\n"
SOFTMAX_BODY = "    xf = x.float()\n"
RETURN = "    return o, lse\n"


@dataclass
class Fault:
    name: str
    edits: list[tuple[str, str]]  # (old, new) in the solution, each old found exactly once
    check: str
    status: str | tuple[str, ...]  # what the check must report (one of)
    says: tuple[str, ...]         # words its message must hold
    import_error: bool = False    # the stage file does not import at all
    limits: Limits = LIMITS       # the grader's limits for it


def at(old: str, new: str) -> list[tuple[str, str]]:
    return [(old, new)]


SOLUTIONS_FILE = str(ROOT / "solutions" / f"{STAGE1.module}.py")
FAULTS = [
    Fault("hang", at(SOFTMAX_BODY, "    while True:\n        pass\n"), SOFTMAX, "timeout", ("timed out",),
          limits=HANG_LIMITS),
    Fault("abort", at(SOFTMAX_BODY, "    import os\n    os.abort()\n"), SOFTMAX, "crash", ("abort",)),
    Fault("segfault", at(SOFTMAX_BODY, "    import ctypes\n    ctypes.string_at(0)\n"), SOFTMAX, "crash",
          ("segmentation fault", 'stage1_online_softmax.py", line 39 in online_softmax')),
    Fault("exits", at(SOFTMAX_BODY, "    import os\n    os._exit(0)\n"), SOFTMAX, "crash", ("exited with status 0",)),
    Fault("nan", at(RETURN, "    return torch.full_like(o, float('nan')), lse\n"), ATTENTION, "FAIL", ("NaN",)),
    Fault("wrong_shape", at(RETURN, "    return o[:, :, :-1], lse\n"), ATTENTION, "FAIL", ("expected shape",)),
    Fault("wrong_dtype", at(RETURN, "    return o.double(), lse\n"), ATTENTION, "FAIL", ("expected dtype",)),
    # Were the inputs shared with the grader, zeroing q and v would make the reference (computed
    # after the call) agree with this answer.  They are copies, and writing to them fails the check.
    Fault("mutates_inputs", at(RETURN, "    q.zero_(); v.zero_()\n"
                                       "    return torch.zeros_like(o), torch.full_like(lse, math.log(Nk))\n"),
          ATTENTION, "FAIL", ("wrote to its input q", "elements changed")),
    Fault("writes_past_its_output", at(RETURN, "    o.as_strided((o.numel() + 40,), (1,)).fill_(0)\n" + RETURN),
          ATTENTION, "FAIL", ("wrote outside an output", "160 bytes past its end")),
    Fault("fails_at_import", at(IMPORT, IMPORT + "raise RuntimeError('no GPU, no fun')\n"), SOFTMAX, "crash",
          ("could not be imported", "RuntimeError: no GPU, no fun"), import_error=True),
    Fault("syntax_error", at(IMPORT, IMPORT + "def broken(:\n"), SOFTMAX, "crash", ("SyntaxError",),
          import_error=True),
    Fault("hangs_at_import", at(IMPORT, IMPORT + "while True:\n    pass\n"), SOFTMAX, "timeout",
          ("importing the stage file",), import_error=True, limits=HANG_LIMITS),
    Fault("prints_megabytes", at(SOFTMAX_BODY, "    print('x' * 10_000_000)\n" + SOFTMAX_BODY), SOFTMAX, "crash",
          ("printed more than 256 KiB",)),
    # Stopped by the grader's watch on its memory ("crash"), or, on a CPU, refused an allocation
    # by its RLIMIT_DATA first when the machine is busy ("FAIL", can't allocate memory).  Filling
    # 1.5 GB takes well under a second on an idle machine and many on a busy one (it took 11.8 s on
    # a busy two-core one): the time limit (LIMITS) is a backstop out of reach, so the memory limit
    # is what stops it, however slow the machine.
    Fault("hogs_memory", at(SOFTMAX_BODY, "    hoard = [torch.ones(2**26) for _ in range(64)]\n" + SOFTMAX_BODY),
          SOFTMAX, ("crash", "FAIL"), ("memory",)),
    Fault("imports_solutions", at(IMPORT, IMPORT + "from solutions.stage1_online_softmax import online_softmax\n"),
          SOFTMAX, "crash", ("does not let stage code import solutions", "the reference solutions"),
          import_error=True),
    Fault("loads_solutions_by_path", at(RETURN, "    import importlib.util\n"
                                                "    spec = importlib.util.spec_from_file_location("
                                                f"'s', {SOLUTIONS_FILE!r})\n"
                                                "    module = importlib.util.module_from_spec(spec)\n"
                                                "    spec.loader.exec_module(module)\n"
                                                "    return module.flash_attention(q, k, v, block_m=block_m, "
                                                "block_n=block_n, sm_scale=sm_scale)\n"),
          ATTENTION, "FAIL", ("PermissionError", "the reference solutions")),
    Fault("reads_the_tests", at(RETURN, f"    open({str(ROOT / 'tests' / 'wrong' / 'stage1.py')!r}).read()\n" + RETURN),
          ATTENTION, "FAIL", ("PermissionError", "the workbook's tests")),
    Fault("calls_the_reference", at(RETURN, "    from kernels import reference\n"
                                            "    return reference.attention(q, k, v, sm_scale=sm_scale)\n"),
          ATTENTION, "FAIL", ("answer key",)),
    # Patched comparisons change nothing: they run in the worker, and the verdict is made in the
    # grader.  The lse here is in base 2, and must stay wrong.
    Fault("patches_torch", [("import torch\n", "import torch\n"
                                               "torch.allclose = lambda *a, **k: True\n"
                                               "torch.equal = lambda *a, **k: True\n"
                                               "torch.testing.assert_close = lambda *a, **k: None\n"
                                               "torch.Tensor.__eq__ = lambda *a, **k: True\n"),
                            ("m + torch.log(l)\n", "m + torch.log2(l)\n")],
          ATTENTION, "FAIL", ("lse",)),
    Fault("edits_the_checks", at(IMPORT, IMPORT + f"open({str(ROOT / 'grader' / 'checks' / 'stage1.py')!r}, 'a')"
                                                  ".write('# all pass')\n"),
          SOFTMAX, "crash", ("PermissionError", "does not let stage code write"), import_error=True),
    Fault("signals_the_grader", at(SOFTMAX_BODY, "    import os, signal\n    os.kill(os.getppid(), signal.SIGKILL)\n"),
          SOFTMAX, "FAIL", ("signal other processes",)),
    Fault("returns_a_tensor_subclass", [("import torch\n", "import torch\n\n\nclass Agreeable(torch.Tensor):\n"
                                                            "    def __eq__(self, other):\n        return True\n"),
                                        (RETURN, "    return o.as_subclass(Agreeable), lse\n")],
          ATTENTION, "FAIL", ("does not accept",)),
    # What came back is not (o, lse): that check fails and says what it got; the others still score.
    Fault("returns_none", at(RETURN, "    return None\n"), ATTENTION, "FAIL", ("flash_attention returned None",)),
    Fault("returns_three", at(RETURN, "    return o, lse, o\n"), ATTENTION, "FAIL",
          ("flash_attention returned a tuple of 3 (tensor",)),
]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("fault", [pytest.param(f, id=f.name, marks=[] if f.name in QUICK else [pytest.mark.slow])
                                   for f in FAULTS])
def test_fault_fails_with_its_reason(fault, tmp_path):
    guarded = [ROOT / "grader" / "checks" / "stage1.py", ROOT / "tests" / "wrong" / "stage1.py"]
    before = [_sha(p) for p in guarded]
    folder = mutants.build(STAGE1, mutants.Mutant(fault.name, fault.name, edits=fault.edits), tmp_path / "sub")
    result = grade_stage(STAGE1, str(folder), only=[fault.check], limits=fault.limits)
    (r,) = result.results
    assert r.status in (fault.status if isinstance(fault.status, tuple) else (fault.status,)) and r.earned == 0, \
        f"{fault.name}: {r.status}: {r.message}"
    missing = [w for w in fault.says if w not in r.message]
    assert not missing, f"{fault.name}: the message lacks {missing}: {r.message}"
    assert result.status == ("import error" if fault.import_error else "graded")
    assert [_sha(p) for p in guarded] == before, "learner code changed the grader's files"


@pytest.mark.slow
def test_a_hanging_submission_costs_at_most_the_stage_limit(tmp_path):
    hang = "    while True:\n        pass\n"
    edits = [(SOFTMAX_BODY, hang), ("    scale = sm_scale if", hang + "    scale = sm_scale if")]
    folder = mutants.build(STAGE1, mutants.Mutant("hangs", "hangs everywhere", edits=edits), tmp_path / "sub")
    limits = Limits(check_timeout=4, stage_timeout=7, memory_mb=1500, output_kb=256)
    result = grade_stage(STAGE1, str(folder), only=[SOFTMAX, "softmax_large_values", ATTENTION, "attention_bad_input"],
                         limits=limits, jobs=1)
    assert [r.status for r in result.results] == ["timeout"] * 4 and not any(r.earned for r in result.results)
    messages = [r.message for r in result.results]
    if result.status == "import error":
        # Starting the worker and importing the stage file took all of the stage's 7 s (a busy
        # machine): every check says so, and none ran.
        assert all("timed out" in m and ("importing the stage file" in m or "starting the worker" in m)
                   for m in messages), messages
    else:
        # The first check hangs until its 4 s are up (or the stage's 7 s, less what starting the
        # worker took), the second until the stage's 7 s are up, and the others are not started.
        assert re.search(r"timed out after [0-4] s", messages[0]), messages[0]
        for m in messages[2:]:
            assert m.startswith("not run: the checks before it used up the stage's time limit (7 s)"), m


def test_sanitize_runs_the_grading_under_memcheck(tmp_path):
    cmd = sanitize.command("/usr/local/cuda/bin/compute-sanitizer", ["stage3", "--sanitize", "--only", "x"],
                           tmp_path / "s.log")
    assert cmd[1:5] == ["--tool", "memcheck", "--target-processes", "all"]
    assert cmd[-5:] == ["-m", "grader", "stage3", "--only", "x"]
    (tmp_path / "s.log").write_text("========= COMPUTE-SANITIZER\n========= Invalid __global__ write of size 4 bytes\n"
                                    "=========     at _attn_fwd+0x1a0\nnoise\n=========\n"
                                    "========= ERROR SUMMARY: 1 error\n")
    assert [ln.strip("= ") for ln in sanitize.errors(tmp_path / "s.log")] == [
        "COMPUTE-SANITIZER", "Invalid __global__ write of size 4 bytes", "at _attn_fwd+0x1a0", "ERROR SUMMARY: 1 error"]
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, "-m", "grader", "stage1", "--sanitize"], cwd=ROOT, capture_output=True,
                             text=True)
        assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr


def test_a_result_of_the_wrong_shape_fails_only_its_own_check(tmp_path):
    fault = next(f for f in FAULTS if f.name == "returns_none")
    folder = mutants.build(STAGE1, mutants.Mutant(fault.name, fault.name, edits=fault.edits), tmp_path / "sub")
    result = grade_stage(STAGE1, str(folder), only=[SOFTMAX, ATTENTION], limits=LIMITS)
    status = {r.name: r.status for r in result.results}
    assert status == {SOFTMAX: "pass", ATTENTION: "FAIL"}, result.results
