"""Where the workbook runs: a CUDA GPU, or Triton's CPU interpreter.

The decision is made once, when this module is first imported, and it must happen
before Triton is imported: Triton reads ``TRITON_INTERPRET`` at import time.  Every
stage file therefore starts with ``from kernels import runtime`` and only then
``import triton``.

    ON_GPU      True when a CUDA GPU is visible and TRITON_INTERPRET is not forced.
    DEVICE      torch.device("cuda") or torch.device("cpu"): where tensors live.
    INTERPRET   True when Triton kernels run in the interpreter (on the CPU).

Force the interpreter on a GPU machine with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

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


def check_dtype(dtype: torch.dtype, *, name: str = "q") -> None:
    """Refuse dtypes the current device cannot run, with a message that says why."""
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


def manual_seed(seed: int) -> torch.Generator:
    """A CPU generator: inputs are drawn on the CPU so a seed means the same numbers everywhere."""
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, dtype: torch.dtype = torch.float32, generator: torch.Generator | None = None,
          device: torch.device | None = None) -> torch.Tensor:
    """Standard normal numbers drawn on the CPU, then moved to ``device`` (default: DEVICE)."""
    x = torch.randn(*shape, generator=generator, dtype=torch.float32)
    return x.to(device=device or DEVICE, dtype=dtype)
