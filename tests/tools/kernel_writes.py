"""What Inductor takes each of the op's kernels to write: prints ``{kernel: [written arguments]}`` as JSON.

    python tests/tools/kernel_writes.py [SOLUTIONS_DIR]

``torch.compile`` learns which tensors a kernel launched through ``wrap_triton`` writes by reading
the kernel's Triton IR (``torch._higher_order_ops.triton_kernel_wrap``).  A tensor it wrongly takes
for written is cloned before the kernel and copied back after it, and CUDA graphs are skipped when
that tensor is a graph input.  This asks the same analysis about every kernel solutions/attention_op
launches (stage 9's and the TMA kernels), on the CPU: Triton builds the IR for a named GPU with a
stand-in driver.  It must run in a process of its own: kernels.runtime turns on Triton's
interpreter without a GPU, and here the kernels must stay real ``@triton.jit`` functions, as
tests/tools/compile_targets.py arranges.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_targets  # turns the interpreter off; its stand-in driver serves here too
import torch
from triton.runtime import driver

ROOT = compile_targets.ROOT


def writes(kernel, tensors: dict, scalars: dict) -> list[str]:
    """The arguments the analysis takes ``kernel`` to write, by name."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    kwargs = {name: x for name, x in {**tensors, **scalars}.items() if name in kernel.arg_names}
    for name in kernel.arg_names:                     # the strides, in the kernel's order: 1s will do
        kwargs.setdefault(name, 1)
    if hasattr(wrap, "identify_accessed_tensors"):                   # torch 2.12 and later
        return sorted(d.name for d in wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes)
    return sorted(wrap.identify_mutated_tensors(kernel, kwargs, {}))   # torch 2.11


def main(solutions: Path) -> dict:
    driver.set_active(compile_targets._RecordingDriver())          # builds IR for an H100
    from kernels.loader import load_file
    s9 = load_file(solutions / "stage9_backward.py")
    b, hq, hkv, n, d = 1, 8, 2, 128, 64
    q, do, o, dq = (torch.empty(b, hq, n, d, dtype=torch.bfloat16) for _ in range(4))
    k, v, dk, dv = (torch.empty(b, hkv, n, d, dtype=torch.bfloat16) for _ in range(4))
    lse, delta = torch.empty(b, hq, n), torch.empty(b, hq, n)
    sinks, part = torch.empty(hq), torch.empty(b, hq, 1)
    shape = dict(N_Q=n, N_K=n, HEAD_DIM=d, WINDOW=64, SINK_TOKENS=0, CAUSAL=True, HAS_WINDOW=True,
                 COUNT_VISITS=False, HEAD_DIM_PAD=d, BLOCK_M=64, BLOCK_N=64)
    return {
        "forward": writes(s9.flash_forward_kernel.fn, dict(Q=q, K=k, V=v, O=o, LSE=lse, SINKS=sinks, VISITS=lse),
                          dict(shape, H=hq, GROUP=hq // hkv, qk_scale=0.18, HAS_SINKS=True)),
        "preprocess": writes(s9.bwd_preprocess_kernel, dict(O=o, DO=do, LSE=lse, DELTA=delta, SINKS=sinks,
                                                            DSINKS_PART=part),
                             dict(H=hq, N_Q=n, HEAD_DIM=d, BLOCK_M=128, HEAD_DIM_PAD=d, HAS_SINKS=True)),
        "dkdv": writes(s9.bwd_dkdv_kernel.fn, dict(Q=q, K=k, V=v, DO=do, DK=dk, DV=dv, LSE=lse, DELTA=delta,
                                                   VISITS=delta),
                       dict(shape, H_Q=hq, H_KV=hkv, GROUP=hq // hkv, sm_scale=0.125, qk_scale=0.18)),
        "dq": writes(s9.bwd_dq_kernel.fn, dict(Q=q, K=k, V=v, DO=do, DQ=dq, LSE=lse, DELTA=delta, VISITS=delta),
                     dict(shape, H_Q=hq, GROUP=hq // hkv, sm_scale=0.125, qk_scale=0.18)),
        **tma_writes(solutions, q, k, v, o, lse, sinks, do, dq, dk, dv, delta),
    }


def tma_writes(solutions: Path, q, k, v, o, lse, sinks, do, dq, dk, dv, delta) -> dict:
    """The same for the TMA kernels, which make their descriptors from the tensors they are given."""
    from kernels.loader import load_file
    fwd, bwd = load_file(solutions / "fast_forward_tma.py"), load_file(solutions / "fast_backward_tma.py")
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    sizes = dict(B=b, H_Q=hq, GROUP=hq // hkv, N_Q=n, N_K=n, WINDOW=64, SINK_TOKENS=0, CAUSAL=True, HAS_WINDOW=True,
                 HEAD_DIM_PAD=d, BLOCK_M=64, BLOCK_N=64, sm_scale=0.125, qk_scale=0.18)

    def strides(kernel) -> dict:                      # every stride a multiple of 16 bytes, as a descriptor needs
        return {name: 64 for name in kernel.fn.arg_names if name.startswith("stride_") or name == "STAT_STRIDE"}
    return {
        "tma_forward": writes(fwd._tma_forward_kernel.fn, dict(Q=q, K=k, V=v, O=o, LSE=lse, SINKS=sinks),
                              dict(sizes, **strides(fwd._tma_forward_kernel), HAS_SINK_TOKENS=False, HAS_SINKS=True,
                                   PACK=4, HOST_DESC=False)),     # made in the kernel (traced_launches.py: the other)
        "tma_dkdv": writes(bwd._tma_dkdv_kernel.fn, dict(Q=q, DO=do, LSE=lse, DELTA=delta, K=k, V=v, DK=dk, DV=dv),
                           dict(sizes, **strides(bwd._tma_dkdv_kernel), H_KV=hkv, HOST_DESC=False)),
        "tma_dq": writes(bwd._tma_dq_kernel.fn, dict(K=k, V=v, Q=q, DO=do, DQ=dq, LSE=lse, DELTA=delta),
                         dict(sizes, **strides(bwd._tma_dq_kernel), PACK=4, HOST_DESC=False)),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "solutions")))
