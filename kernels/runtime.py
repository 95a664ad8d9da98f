"""Where the workbook runs: a CUDA GPU, or Triton's CPU interpreter.

The decision is made once, when this module is first imported, and it must happen
before Triton is imported: Triton reads ``TRITON_INTERPRET`` at import time.  Every
stage file therefore starts with ``from kernels import runtime`` and only then
``import triton``.

    ON_GPU      True when a CUDA GPU is visible and TRITON_INTERPRET is not forced.
    DEVICE      torch.device("cuda") or torch.device("cpu"): where tensors live.
    INTERPRET   True when Triton kernels run in the interpreter (on the CPU).
    HAS_TRITON  False where Triton is not installed: it has builds for Linux only, so on macOS
                and native Windows stages 2, 3 and 5-9 cannot run (see docs/platforms.md).

Force the interpreter on a GPU machine with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import warnings

import torch

#: Triton publishes builds for Linux (x86-64 and arm64) only; ``find_spec`` looks without importing.
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def no_triton_help() -> str:
    """What to do when Triton is missing: a different path on macOS and Windows, a reinstall on Linux."""
    if sys.platform.startswith("linux"):
        return ("Triton is not installed in this environment. Run `bash setup.sh` again (it installs the tested "
                "torch and triton pair), or `python -m grader doctor` to see what is missing.")
    system = {"darwin": "macOS", "win32": "Windows"}.get(sys.platform, sys.platform)
    return (f"Triton has no build for {system}: it runs on Linux only. Stage 1, and stage 4's plan and "
            "emulation, run here; for the Triton stages (2, 3 and 5-9) use one of the supported paths: "
            "the dev container (VS Code or Codespaces: 'Reopen in Container'), WSL2 on Windows, or Colab "
            "(the 'Open in Colab' link at the top of each notebook). docs/platforms.md walks through each.")


class _NoTritonFinder:
    """Last on ``sys.meta_path`` where Triton is missing: ``import triton`` then says why and what to do.

    A probe, ``importlib.util.find_spec("triton")``, still just gets None: libraries ask that to
    decide whether Triton is there (torch does, when it starts CUDA), and must hear "no", not an error.
    """

    @staticmethod
    def find_spec(name, path=None, target=None):
        if (name == "triton" or name.startswith("triton.")) and not _probing():
            raise ModuleNotFoundError(f"No module named 'triton'. {no_triton_help()}", name=name)
        return None


def _probing() -> bool:
    """Whether the module search under way comes from ``importlib.util.find_spec``, not an import."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        if frame.f_code.co_name == "find_spec" and frame.f_code.co_filename == "<frozen importlib.util>":
            return True
        frame = frame.f_back
    return False


if not HAS_TRITON and not any(type(f).__name__ == "_NoTritonFinder" for f in sys.meta_path):
    sys.meta_path.append(_NoTritonFinder())

_forced = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
ON_GPU: bool = torch.cuda.is_available() and not _forced
INTERPRET: bool = not ON_GPU
DEVICE: torch.device = torch.device("cuda" if ON_GPU else "cpu")

if INTERPRET:
    if "triton" in sys.modules and not _forced:
        warnings.warn(
            "triton was imported before kernels.runtime, so TRITON_INTERPRET=1 came too late: "
            "import kernels.runtime first (every stage file does).",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["TRITON_INTERPRET"] = "1"


def quicken_interpreter() -> bool:
    """Let the interpreter patch ``triton.language`` once per launch, not once per helper call.

    To run a kernel, the interpreter swaps every builtin of ``triton.language`` (``tl.load``,
    ``tl.dot``, ...) for a NumPy version, and puts the originals back when the launch ends.  It
    also redoes that swap, a walk over every member of several modules, each time the kernel
    calls one of its ``@triton.jit`` helpers, although the launch has already done it: with the
    many helpers of stages 5-9 that walk is a large share of the CPU time of grading a stage.  This
    skips it when the modules a helper sees are already swapped (their ``load`` is no longer
    the builtin), and leaves everything else to Triton.  Returns whether the hook is in place
    (False on a GPU, before Triton is imported, or with a Triton whose interpreter is laid out
    differently: it then runs as it is).  kernels/loader.py calls it once a stage file has imported
    Triton; it is never what imports Triton (tests/tools/compile_targets.py turns the interpreter off
    after importing this module).
    """
    if not INTERPRET or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or scope is None or is_builtin is None:
        return False
    if getattr(original, "_workbook_once", False):
        return True

    def patch_lang(fn):
        langs = [m for m in fn.__globals__.values() if isinstance(m, type(tl)) and m in (tl, tl.core)]
        if langs and not any(is_builtin(getattr(m, "load", None)) for m in langs):
            return scope()                  # already swapped by the launch: nothing to do
        return original(fn)

    patch_lang._workbook_once = True
    interpreter._patch_lang = patch_lang
    return True


#: dtypes the Triton stages accept here.  The interpreter computes bfloat16 dots on raw
#: bit patterns (an upstream bug), so bfloat16 is GPU-only.
DTYPES: tuple[torch.dtype, ...] = (
    (torch.float16, torch.bfloat16, torch.float32) if ON_GPU else (torch.float16, torch.float32)
)


def describe() -> str:
    """One line saying where kernels run, for notebooks and the grader's header."""
    if ON_GPU:
        return f"GPU: {torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU: Triton interpreter (torch {torch.__version__}, no CUDA GPU visible)"


def capability() -> tuple[int, int] | None:
    """The GPU's compute capability, (9, 0) for an H100; None on the CPU.  Asked on first use, not at
    import: querying the device starts CUDA, which a process about to fork must not have done."""
    return torch.cuda.get_device_capability() if ON_GPU else None


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Scratch memory for one launch, from PyTorch's caching allocator (Triton's allocator protocol)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_scratch() -> None:
    """Let Triton allocate the scratch memory of kernels that make TMA descriptors on the GPU.

    A kernel that calls ``tl.make_tensor_descriptor`` writes each descriptor to global memory,
    which Triton asks an allocator for at every launch; it has none unless the program set one
    (``triton.set_allocator``).  That setting is a context variable, seen only by the thread that
    made it, and autograd runs a backward, a compiled graph's too, in threads of its own.  So
    where no allocator is set this makes PyTorch's caching allocator the default of every thread;
    an allocator the program sets still takes precedence.  The TMA kernels call it before they
    launch.
    """
    if not ON_GPU:
        return
    import contextvars

    from triton.runtime import _allocation
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        _allocation._allocator = contextvars.ContextVar("_allocator", default=_scratch)


def has_bfloat16() -> bool:
    """bfloat16 tensor cores: sm_80 (A100, RTX 30) and newer.  A T4 (sm_75) has float16 only."""
    return ON_GPU and capability() >= (8, 0)


def check_dtype(dtype: torch.dtype, *, name: str = "q") -> None:
    """Refuse dtypes the current device cannot run, with a message that says why."""
    if dtype == torch.bfloat16 and ON_GPU and not has_bfloat16():
        major, minor = capability()
        raise TypeError(
            f"{name}.dtype is torch.bfloat16, which needs an sm_80 or newer GPU (A100, RTX 30 and later); "
            f"{torch.cuda.get_device_name()} is sm_{major}{minor} and has float16 tensor cores only. "
            "Use torch.float16 (or torch.float32) here."
        )
    if dtype in DTYPES:
        return
    if dtype == torch.bfloat16:
        raise TypeError(
            f"{name}.dtype is torch.bfloat16, which needs a CUDA GPU: Triton's CPU interpreter "
            "computes bfloat16 dot products on raw bit patterns and returns wrong numbers. "
            "Use torch.float16 or torch.float32 on the CPU."
        )
    raise TypeError(
        f"{name}.dtype is {dtype}; expected one of {', '.join(str(d) for d in DTYPES)}"
    )


def pick(*, cpu, gpu):
    """Choose a size for the current device: small for the interpreter, real on a GPU.

    >>> seq_lens = pick(cpu=[17, 128], gpu=[1023, 4096])
    """
    return gpu if ON_GPU else cpu


_libraries = itertools.count()


def op_library(stage: str) -> str:
    """A fresh ``torch.library`` namespace for a stage file's operators, such as ``"stage9_0"``.

    PyTorch registers an operator name once per process, and one process may load a stage file
    more than once (a notebook cell run again, the grader's checks, your file beside the reference).
    """
    return f"{stage}_{next(_libraries)}"


def manual_seed(seed: int) -> torch.Generator:
    """A CPU generator: inputs are drawn on the CPU so a seed means the same numbers everywhere."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
          device: torch.device | None = None) -> torch.Tensor:
    """Standard normal numbers drawn on the CPU, then moved to ``device`` (default: DEVICE)."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float32)
    return x.to(device=device or DEVICE, dtype=dtype)
