"""``python -m grader bench host``: the host time per call of solutions/attention_op's ``attention``.

    python -m grader bench host          on a CUDA GPU; prints one line per case, then the GPU time

At a size small enough that the GPU waits for the host (B1 Hq8/Hkv2 N128 D64, causal, window 64,
learned sinks, ``bnhd``), each case runs ``calls`` times in a loop; its host time is the loop's
wall time before it synchronizes, its wall time the same after.  The cases are the op's entry
(forward, forward under no_grad, forward and backward), its parts (the forward op through the
dispatcher, the bare forward kernel's launch), stage 9's ``attention`` and PyTorch's SDPA at the
same size (no window, no sinks): the host time an op that autograd calls costs PyTorch itself.
The op's forward and backward also run with stage 9's kernels in place of the TMA kernels, where
the GPU has TMA: the host time each set costs.
Last, the GPU time of one forward, from a CUDA graph's replay.
"""

from __future__ import annotations

import sys
import time

from kernels import runtime

import torch


def _op():
    """solutions/attention_op, imported once (it registers its torch.library ops)."""
    from kernels.loader import ROOT, load_package
    return load_package(ROOT / "solutions" / "attention_op")


def host_overhead(*, calls: int = 2000, batch=1, heads=8, kv_heads=2, n=128, head_dim=64) -> dict:
    """Host and wall time per call, in microseconds, of solutions/attention_op's ``attention``, of its parts, of
    stage 9's ``attention`` and of SDPA, at a size small enough that the GPU waits for the host.

    Args:
        calls: timed calls per case (after 50 untimed ones).
        batch, heads, kv_heads, n, head_dim: the shape, (B, N, H, D) with ``heads`` query heads and
            ``kv_heads`` key/value heads, bfloat16 on the current CUDA device.

    Returns:
        ``{case: {"host_us": float, "wall_us": float}}``: the loop's time before it synchronizes
        (host) and after (wall), over ``calls``.
    """
    import triton
    op = _op()
    s9 = op.s9
    q = torch.randn(batch, n, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, n, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    sinks = torch.zeros(heads, device="cuda", requires_grad=True)
    do = torch.randn_like(q)
    qt, kt, vt, dot = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v, do))

    def ours():
        return op.attention(q, k, v, is_causal=True, window=64, sinks=sinks, enable_gqa=True, layout="bnhd")

    def stage9():
        return s9.attention(qt, kt, vt, causal=True, window=64, sinks=sinks)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    qb, kb, vb = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    o, lse = op.launch._forward(qb, kb, vb, sinks, True, 64, 0, 0.125)
    tile = op.plans._plan_for(qb, kb, True, 64, 0, True, tma=False)["forward"]     # stage 9's tile
    kernel = s9.flash_forward_kernel.fn[(triton.cdiv(n, tile["BLOCK_M"]), batch * heads)]

    def launch_only():                                  # stage 9's forward kernel into existing outputs
        kernel(qb, kb, vb, o, lse, sinks, lse, *qb.stride(), *kb.stride(), *vb.stride(), *o.stride(),
               heads, heads // kv_heads, n, n, head_dim, 64, 0, 0.125 * s9.LOG2E, CAUSAL=True, HAS_WINDOW=True,
               HAS_SINKS=True, COUNT_VISITS=False, HEAD_DIM_PAD=triton.next_power_of_2(head_dim), **tile)

    def stage9_kernels(fn):                             # the op with stage 9's kernels, not the TMA ones
        def run():
            op.plans.KERNELS = "stage9"
            try:
                return fn()
            finally:
                op.plans.KERNELS = "auto"
        return run

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    cases = {"attention forward": lambda: ours(),
             "attention forward, no_grad": no_grad(ours),
             "attention forward+backward": lambda: torch.autograd.grad(ours(), (q, k, v, sinks), do),
             "attention fwd+bwd, stage 9's kernels": stage9_kernels(
                 lambda: torch.autograd.grad(ours(), (q, k, v, sinks), do)),
             "op forward (dispatcher)": lambda: op.attention_forward(qb, kb, vb, sinks, True, 64, 0, 0.125),
             "forward kernel launch (stage 9's)": launch_only,
             "stage 9 forward": lambda: stage9(),
             "stage 9 forward+backward": lambda: torch.autograd.grad(stage9(), (qt, kt, vt, sinks), dot),
             # PyTorch's own fused attention (no window, no sinks) at the same size: the host time
             # an op that autograd calls costs PyTorch itself
             "SDPA forward": lambda: sdpa(),
             "SDPA forward, no_grad": no_grad(sdpa),
             "SDPA forward+backward": lambda: torch.autograd.grad(sdpa(), (qt, kt, vt), dot)}
    result = {}
    for name, fn in cases.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        host = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        result[name] = {"host_us": round(host / calls * 1e6, 1), "wall_us": round(wall / calls * 1e6, 1)}
    return result


def main() -> int:
    """Print :func:`host_overhead` and the GPU time of one forward at the same size."""
    if not runtime.ON_GPU:
        print(f"python -m grader bench host times host overhead on a CUDA GPU, and none is visible here "
              f"({runtime.describe()}); the op's tests run on the CPU: tests/test_attention_op.py", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench
    op = _op()
    print(f"{runtime.describe()}, triton {triton.__version__}")
    shape = dict(batch=1, heads=8, kv_heads=2, n=128, head_dim=64)
    for name, t in host_overhead(**shape).items():
        print(f"{name:<38} host {t['host_us']:7.1f} µs/call   wall {t['wall_us']:7.1f} µs/call   ({shape})")
    q = torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    op.attention(q, k, v, is_causal=True, window=64, enable_gqa=True, layout="bnhd")     # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.attention(q, k, v, is_causal=True, window=64, enable_gqa=True, layout="bnhd")
    print(f"GPU time of one forward at that size (a CUDA graph's replay): {do_bench(graph.replay) * 1e3:.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
