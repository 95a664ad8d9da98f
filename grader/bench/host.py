"""``python -m grader bench host``: the host time per call of solutions/attention_op's ``attention``.

    python -m grader bench host          on a CUDA GPU; prints one line per case, then the GPU time
    python -m grader bench host --repeat 3 --json docs/bench-host-h200.json     every case three times, kept

At a size small enough that the GPU waits for the host (B1 Hq8/Hkv2 N128 D64, causal, window 64,
learned sinks, ``bnhd``), each case runs ``calls`` times, in blocks taken in turn with the other
cases' blocks (each round starting one case later, the garbage collector run between blocks and
off within them); its host time is a block's time per call before it synchronizes, its wall time
the same after, each the median over the blocks.  The cases are the op's entry
(forward and backward, forward, forward under no_grad), the same on its Python path (without
native.py's C++ path), its parts (the forward op through the dispatcher, the bare forward
kernel's launch), stage 9's ``attention`` and PyTorch's SDPA at the same size (no window, no
sinks): the host time an op that autograd calls costs PyTorch itself.  The op's forward and
backward also run with stage 9's kernels in place of the TMA kernels, where the GPU has TMA: the
host time each set costs.
Last, the GPU time of one forward, from a CUDA graph's replay.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time

from kernels import runtime

import torch


def _op():
    """solutions/attention_op, imported once (it registers its torch.library ops)."""
    from kernels.loader import ROOT, load_package
    return load_package(ROOT / "solutions" / "attention_op")


def host_overhead(*, calls: int = 2000, blocks: int = 10, batch=1, heads=8, kv_heads=2, n=128, head_dim=64) -> dict:
    """Host and wall time per call, in microseconds, of solutions/attention_op's ``attention``, of its parts, of
    stage 9's ``attention`` and of SDPA, at a size small enough that the GPU waits for the host.

    Args:
        calls: timed calls per case (after 50 untimed ones), in ``blocks`` blocks taken in turn
            with the other cases' blocks.
        batch, heads, kv_heads, n, head_dim: the shape, (B, N, H, D) with ``heads`` query heads and
            ``kv_heads`` key/value heads, bfloat16 on the current CUDA device.

    Returns:
        ``{case: {"host_us", "wall_us", "host_us_min", "host_us_max"}}``: per call, the median
        block's time before it synchronizes (host) and after (wall), and the fastest and slowest
        block's host time.
    """
    import triton
    op = _op()
    op.native.build(wait=True)                          # the C++ path, where it builds (main() says if not)
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

    def python_path(fn):                                # the op without its C++ path (native.py)
        def run():
            with op.native.off():
                return fn()
        return run

    def fwd_bwd():
        return torch.autograd.grad(ours(), (q, k, v, sinks), do)

    # The forward+backward first: a call key's C++ plan is recorded at its first backward.
    cases = {"attention forward+backward": fwd_bwd,
             "attention forward": lambda: ours(),
             "attention forward, no_grad": no_grad(ours),
             "Python path: forward+backward": python_path(fwd_bwd),
             "Python path: forward": python_path(ours),
             "Python path: forward, no_grad": python_path(no_grad(ours)),
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
    for fn in cases.values():
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    # Blocks of calls taken in turn, case after case, each round starting one case later: a host
    # whose speed drifts during the run (clocks, other processes, autograd's worker thread waking)
    # weighs on every case alike, and no case always follows the same one.  The garbage collector
    # runs between blocks only, so that one case's garbage is not collected in another's time.
    per = max(1, calls // blocks)
    names = list(cases)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    collecting = gc.isenabled()
    try:
        for round_ in range(blocks):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                fn = cases[name]
                gc.collect()
                gc.disable()
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(per):
                    fn()
                host = time.perf_counter() - start
                torch.cuda.synchronize()
                wall = time.perf_counter() - start
                if collecting:
                    gc.enable()
                samples[name].append((host / per * 1e6, wall / per * 1e6))
    finally:
        if collecting:
            gc.enable()
    result = {}
    for name, times in samples.items():
        hosts = sorted(t[0] for t in times)
        walls = sorted(t[1] for t in times)
        result[name] = {"host_us": round(statistics.median(hosts), 1), "wall_us": round(statistics.median(walls), 1),
                        "host_us_min": round(hosts[0], 1), "host_us_max": round(hosts[-1], 1)}
    return result


#: The entry's three calls: (label, the op's case, its Python path's case, SDPA's case).
CALLS = (("forward+backward", "attention forward+backward", "Python path: forward+backward", "SDPA forward+backward"),
         ("forward", "attention forward", "Python path: forward", "SDPA forward"),
         ("forward, no_grad", "attention forward, no_grad", "Python path: forward, no_grad", "SDPA forward, no_grad"))


def summary(doc: dict) -> list[str]:
    """Markdown table rows of a ``--json`` file: per run and call, the median host µs per call of
    the op, of its Python path and of SDPA, and the op's against SDPA's (docs/stage9-notes.md)."""
    lines = []
    for number, run in enumerate(doc["runs"], 1):
        for label, ours, python, sdpa in CALLS:
            lines.append(f"| {number} | {label} | {run[ours]['host_us']:.1f} | {run[python]['host_us']:.1f} | "
                         f"{run[sdpa]['host_us']:.1f} | {run[ours]['host_us'] / run[sdpa]['host_us']:.2f}x |")
    return lines


def main(*, repeat: int = 1, json_path: str | None = None) -> int:
    """Print :func:`host_overhead` (``repeat`` times over) and the GPU time of one forward at the
    same size; with ``json_path``, write every run there with the GPU's name and the versions."""
    if repeat < 1:
        print(f"--repeat must be at least 1, got {repeat}", file=sys.stderr)
        return 2
    if not runtime.ON_GPU:
        print(f"python -m grader bench host times host overhead on a CUDA GPU, and none is visible here "
              f"({runtime.describe()}); the op's tests run on the CPU: tests/test_attention_op.py", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench
    op = _op()
    print(f"{runtime.describe()}, triton {triton.__version__}")
    if op.native.build(wait=True) is None:
        print(f"the op's C++ path is off here ({op.native.failure() or 'WORKBOOK_NATIVE=0 or another Triton'}): "
              "every attention case below is its Python path")
    shape = dict(batch=1, heads=8, kv_heads=2, n=128, head_dim=64)
    runs = []
    for _ in range(repeat):
        runs.append(host_overhead(**shape))
        for name, t in runs[-1].items():
            print(f"{name:<38} host {t['host_us']:7.1f} µs/call ({t['host_us_min']:.1f}-{t['host_us_max']:.1f})   "
                  f"wall {t['wall_us']:7.1f} µs/call   ({shape})")
    q = torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    op.attention(q, k, v, is_causal=True, window=64, enable_gqa=True, layout="bnhd")     # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op.attention(q, k, v, is_causal=True, window=64, enable_gqa=True, layout="bnhd")
    gpu_us = do_bench(graph.replay) * 1e3
    print(f"GPU time of one forward at that size (a CUDA graph's replay): {gpu_us:.1f} µs")
    if json_path:
        import json
        record = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                  "native": op.native.module() is not None, "shape": shape, "graph_forward_gpu_us": round(gpu_us, 1),
                  "runs": runs}
        with open(json_path, "w") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        print(f"wrote {json_path}")
        print("| run | call | op | op, Python path | SDPA | op / SDPA |\n| --- | --- | --- | --- | --- | --- |")
        print("\n".join(summary(record)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
