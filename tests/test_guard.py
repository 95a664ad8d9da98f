"""The worker's defences (grader/isolation/guard.py), tested here in-process without installing them.

``guard.install`` is never called in this process: an audit hook cannot be removed.  The
decisions it would take are made by plain methods, tested directly; tests/test_faults.py sees
them work inside real workers.
"""

from __future__ import annotations

import os
import site
import sys

from kernels.loader import ROOT

import pytest
import torch

from grader.check import check
from grader.isolation.guard import (
    Guard,
    _RefuseImports,
    changed_inputs,
    check_canaries,
    poisoned_allocations,
    snapshot_inputs,
)

GUARD = Guard(ROOT)


@pytest.mark.parametrize("path,what", [
    (ROOT / "solutions" / "stage1_online_softmax.py", "reference solutions"),
    (ROOT / "tests" / "wrong" / "stage1.py", "tests"),
    (ROOT / "grader" / "checks" / "hidden" / "stage1.py", "checks"),
    (ROOT / "kernels" / "reference.py", "answer key"),
    ("/proc/1/mem", "another process"),
])
def test_answer_keys_cannot_be_read(path, what):
    assert what in GUARD.read_refusal(str(path))
    assert "read" in GUARD._refusal("open", (str(path), "r", os.O_RDONLY))


def test_learner_code_reads_what_it_needs():
    for path in (ROOT / "kernels" / "masks.py", ROOT / "grader" / "isolation" / "child.py",
                 f"/proc/{os.getpid()}/status", "/tmp/anything"):
        assert GUARD._refusal("open", (str(path), "r", os.O_RDONLY)) is None
    # the folder the stage is loaded from is readable even where it would be private (grading solutions/)
    assert Guard(ROOT, readable=[ROOT / "solutions"]).read_refusal(str(ROOT / "solutions" / "x.py")) is None


def test_the_workbook_and_python_cannot_be_written():
    targets = [ROOT / "kernels" / "tolerance.py", ROOT / "grader" / "checks" / "stage1.py",
               os.path.join(site.getsitepackages()[0], "torch", "__init__.py"), os.path.join(sys.prefix, "x.pth")]
    for path in targets:
        assert GUARD._refusal("open", (str(path), "w", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)), path
        assert GUARD._refusal("os.remove", (str(path), None)), path
    assert GUARD._refusal("os.rename", ("/tmp/a", str(ROOT / "kernels" / "reference.py"), None, None))
    assert GUARD._refusal("shutil.copyfile", ("/tmp/evil.py", str(ROOT / "kernels" / "masks.py")))
    assert GUARD._refusal("shutil.copyfile", (str(ROOT / "kernels" / "masks.py"), "/tmp/build/masks.py")) is None
    assert GUARD._refusal("shutil.copyfile", (str(ROOT / "solutions" / "x.py"), "/tmp/x.py"))
    for path in (ROOT / "build" / "ext.so", ROOT / ".grader-cache" / "k", "/tmp/workbook-build/x.o"):
        assert GUARD._refusal("open", (str(path), "w", os.O_WRONLY | os.O_CREAT)) is None, path


def test_batch_folders_are_private_and_protected(tmp_path):
    subs, out = tmp_path / "submissions", tmp_path / "out"
    guard = Guard(ROOT, private=[subs], protected=[out])
    assert "another submission" in guard.read_refusal(str(subs / "ada" / "stage1_online_softmax.py"))
    assert guard._refusal("open", (str(out / "ada" / "stage1.json"), "w", os.O_WRONLY))
    assert guard._refusal("open", (str(tmp_path / "elsewhere"), "w", os.O_WRONLY)) is None


def test_signals_and_forks():
    assert GUARD._refusal("os.kill", (os.getppid(), 9))
    assert GUARD._refusal("os.kill", (-1, 9))
    assert GUARD._refusal("os.fork", ())
    assert GUARD._refusal("os.kill", (os.getpid(), 0)) is None


def test_imports_from_private_folders_are_refused():
    finder = _RefuseImports(GUARD)
    for name in ("solutions", "tests"):
        with pytest.raises(ImportError, match="does not let stage code import"):
            finder.find_spec(name)
    with pytest.raises(ImportError, match="grader's checks"):
        finder.find_spec("grader.checks.stage1", [str(ROOT / "grader" / "checks")])
    assert finder.find_spec("json") is None and finder.find_spec("kernels.masks", [str(ROOT / "kernels")]) is None


def test_outputs_are_poisoned_and_fenced():
    q = torch.randn(2, 7, 3, 4).transpose(1, 2)  # non-contiguous: empty_like keeps its strides
    guards: list = []
    empty = torch.empty
    with poisoned_allocations(guards):
        o = torch.empty_like(q)
        lse = torch.empty(2, 3, 7)
        n = torch.empty(5, dtype=torch.int32)
    assert o.stride() == torch.empty_like(q).stride() and o.isnan().all() and lse.isnan().all()
    assert (n == -7777).all()
    o.copy_(q)
    lse.fill_(1.0)
    assert check_canaries(guards) is None
    lse.as_strided((lse.numel() + 3,), (1,)).fill_(0)  # three floats past the end
    message = check_canaries(guards)
    assert "12 bytes past its end" in message and "(2, 3, 7) float32" in message and "torch.empty" in message
    assert torch.empty is empty  # the patches are undone


def test_tensors_allocated_while_torch_compile_traces_get_no_canaries():
    """torch.compile allocates fake tensors while it traces (an operator's fake implementation calls
    torch.empty_like): they have no memory to fence, and reading canaries from them later raised
    DynamicOutputShapeException for nonzero() in a compiled check on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    guards: list = []
    with poisoned_allocations(guards), FakeTensorMode() as mode:
        fake = torch.empty_like(mode.from_tensor(torch.randn(3, 4)))
    assert type(fake) is not torch.Tensor and guards == []
    assert check_canaries(guards) is None


def test_writing_to_an_input_is_named():
    def flash_attention(q, k, v, *, scale=1.0):
        k[0, 1] = 5.0
        return q

    q, k, v = torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3)
    snaps = snapshot_inputs(flash_attention, (q, k, v), {})
    assert changed_inputs("flash_attention", snaps) is None
    flash_attention(q, k, v)
    message = changed_inputs("flash_attention", snaps)
    assert "wrote to its input k" in message and "1 of 6 elements" in message and "(0, 1)" in message
    x = torch.tensor([float("nan"), float("-inf")])
    assert changed_inputs("f", snapshot_inputs(lambda x: x, (x,), {})) is None  # NaN and -inf compare equal


def test_hidden_checks_live_only_in_the_hidden_folder():
    def probe(ctx):
        pass

    with pytest.raises(ValueError, match="grader/checks/hidden"):
        check(hidden=True)(probe)
    probe.__module__ = "grader.checks.hidden.stage99"
    with pytest.raises(ValueError, match="hidden=True"):
        check()(probe)
