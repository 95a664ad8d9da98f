"""kernels/runtime.py: the interpreter hook that patches triton.language once per launch."""

from kernels import runtime

import pytest
import torch
import triton  # after kernels.runtime
import triton.language as tl

pytestmark = pytest.mark.skipif(not runtime.INTERPRET, reason="the hook is for Triton's CPU interpreter")


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _helper_calls_kernel(X, OUT, CALLS: tl.constexpr):
    offs = tl.arange(0, 16)
    x = tl.load(X + offs)
    for _ in tl.static_range(CALLS):
        x = _twice(x)
    tl.store(OUT + offs, x)


def _patches_per_launch(monkeypatch, calls: int) -> int:
    from triton.runtime import interpreter
    count = 0
    real = interpreter._patch_builtin

    def counting(*args, **kwargs):
        nonlocal count
        count += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(interpreter, "_patch_builtin", counting)
    x = torch.randn(16)
    out = torch.full((16,), float("nan"))
    _helper_calls_kernel[(1,)](x, out, CALLS=calls)
    assert torch.equal(out, x * 2.0 ** calls), "a kernel calling a @triton.jit helper computed the wrong thing"
    return count


def test_helpers_do_not_repatch_the_language(monkeypatch):
    assert runtime.quicken_interpreter(), "the hook did not install: Triton's interpreter changed its layout"
    once, five = _patches_per_launch(monkeypatch, 1), _patches_per_launch(monkeypatch, 5)
    assert once > 0 and five == once, (f"triton.language was patched {once} times for a launch with one helper "
                                       f"call and {five} with five: each helper call repeats the launch's work")


def test_the_language_is_restored_after_a_launch():
    _helper_calls_kernel[(1,)](torch.randn(16), torch.empty(16), CALLS=2)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.core.tensor.__add__), \
        "after a launch triton.language must hold its own builtins again, for the next launch to patch"


def test_loading_a_stage_file_installs_the_hook():
    """The hook comes with the loader (kernels/loader.py), which every test, notebook and worker uses."""
    import subprocess
    import sys

    from kernels.loader import ROOT
    code = ("from kernels import loader; loader.load_stage('stage2', 'solutions'); "
            "from triton.runtime import interpreter; print(getattr(interpreter._patch_lang, '_workbook_once', False))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True", done.stdout + done.stderr


def test_tma_scratch_gives_triton_an_allocator_only_where_none_is_set(monkeypatch):
    """Kernels that make TMA descriptors need scratch memory at launch; runtime.tma_scratch() lends
    PyTorch's allocator to every thread where the program set none, and keeps one it did set."""
    import threading

    import triton
    from triton.runtime import _allocation

    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setattr(_allocation, "_allocator", _allocation._allocator)      # restored afterwards
    _allocation._allocator.set(_allocation.NullAllocator())
    runtime.tma_scratch()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_allocation._allocator.get()))
    thread.start()
    thread.join()
    assert _allocation._allocator.get() is runtime._scratch and seen == [runtime._scratch]   # autograd's too

    def mine(size, alignment, stream):
        return None
    triton.set_allocator(mine)
    runtime.tma_scratch()
    assert _allocation._allocator.get() is mine
