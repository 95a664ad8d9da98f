"""Probe: what descriptors made on the host give the op under ``torch.compile``.

docs/hopper-notes.md, section 22, gave the TMA kernels descriptors made on the host in eager
calls; a compiled graph kept descriptors made in the kernel, because torch's tracing of the ops'
bodies kept a host descriptor as a constant.  launch.py's ``op_launch`` now passes each one into
the graph as its tensor and tile, and the graph makes the descriptor when it runs.  This times
the op compiled (``torch.compile(fullgraph=True, dynamic=False)``) both ways, at the stage 9
bench's windowed cases (B4 Hq32/Hkv8 N8192 D64) and at bench train's windowed layer of each
size (learned sinks, (B, N, H, D) as the model hands them over), bfloat16, causal:

    forward (no_grad) and forward plus backward (``torch.autograd.grad``), each the median of
    ``triton.testing.do_bench`` and the GPU time of the op's kernels a call (PyTorch's profiler),
    with the graph making the descriptors (``graph``) or the kernels making their own
    (``kernel``); each compiled output is compared with the eager call's (``err``).

    python grader/bench/probes/compiled_descriptors.py          (a Hopper GPU; writes $OUT/probe-compiled.json)
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels import runtime  # noqa: E402,F401  (decides TRITON_INTERPRET before triton is imported)
from kernels.loader import ROOT, load_package  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from triton.testing import do_bench  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
op = load_package(ROOT / "solutions" / "attention_op")
CASES = [  # name, B, Hq, Hkv, N, window, sinks
    ("bench W128", 4, 32, 8, 8192, 128, False),
    ("bench W128 sinks", 4, 32, 8, 8192, 128, True),
    ("bench W1024", 4, 32, 8, 8192, 1024, False),
    ("train b8n1024 layer", 8, 8, 2, 1024, 128, True),
    ("train b2n4096 layer", 2, 8, 2, 4096, 128, True),
    ("train large layer", 1, 32, 4, 4096, 128, True),
]


def kernel_ms(fn, calls=10) -> float:
    """The GPU time of the CUDA kernels one call of ``fn`` launches, from the profiler."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / 1000 / calls


def main() -> list[dict]:
    from grader.bench.train import compile_caches_off
    compile_caches_off()          # the two forms differ inside the op, where these caches' keys do not look
    rows = []
    for name, b, hq, hkv, n, window, sinks_on in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, n, hq, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
        k, v = (torch.randn(b, n, hkv, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                for _ in range(2))
        sinks = torch.randn(hq, device="cuda", requires_grad=True) if sinks_on else None
        do = torch.randn_like(q)
        inputs = (q, k, v) + ((sinks,) if sinks_on else ())

        def f(q, k, v, sinks):
            return op.attention(q, k, v, is_causal=True, window=window, sinks=sinks, enable_gqa=True, layout="bnhd")
        with torch.no_grad():
            want = f(q, k, v, sinks)
        for form, on in (("kernel", False), ("graph", True)):
            op.launch._GRAPH_DESCRIPTORS = on
            torch._dynamo.reset()
            compiled = torch.compile(f, fullgraph=True, dynamic=False)

            def forward():
                with torch.no_grad():
                    return compiled(q, k, v, sinks)

            def both():
                return torch.autograd.grad(compiled(q, k, v, sinks), inputs, do)
            err = (forward().float() - want.float()).abs().max().item()
            both()
            row = dict(case=name, form=form, err=err,
                       forward_ms=do_bench(forward, warmup=20, rep=100, return_mode="median"),
                       both_ms=do_bench(both, warmup=20, rep=100, return_mode="median"),
                       forward_kernels_ms=kernel_ms(forward), both_kernels_ms=kernel_ms(both))
            rows.append(row)
            print(f"{name:22s} {form:6s} fwd {row['forward_ms']:.4f} ms (kernels {row['forward_kernels_ms']:.4f})  "
                  f"fwd+bwd {row['both_ms']:.4f} ms (kernels {row['both_kernels_ms']:.4f})  err {err:.1e}", flush=True)
        doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   command="python grader/bench/probes/compiled_descriptors.py", rows=rows)
        with open(os.path.join(OUT, "probe-compiled.json"), "w") as out:
            json.dump(doc, out, indent=1)
    op.launch._GRAPH_DESCRIPTORS = None
    return rows


def summary(rows: list[dict]) -> list[str]:
    """A markdown table: per case, the kernels' GPU time a call made in the kernel and made by the
    graph, forward and forward plus backward, each form's speed, and the wall times."""
    get = {(r["case"], r["form"]): r for r in rows}
    lines = ["| case | forward kernels, made in the kernel ms | made by the graph ms | speed | fwd+bwd kernels, "
             "in the kernel ms | by the graph ms | speed | forward wall ms, kernel / graph | fwd+bwd wall ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for case in dict.fromkeys(r["case"] for r in rows):
        a, g = get[case, "kernel"], get[case, "graph"]
        lines.append(f"| {case} | {a['forward_kernels_ms']:.4f} | {g['forward_kernels_ms']:.4f} | "
                     f"{a['forward_kernels_ms'] / g['forward_kernels_ms']:.2f}x | {a['both_kernels_ms']:.4f} | "
                     f"{g['both_kernels_ms']:.4f} | {a['both_kernels_ms'] / g['both_kernels_ms']:.2f}x | "
                     f"{a['forward_ms']:.3f} / {g['forward_ms']:.3f} | {a['both_ms']:.3f} / {g['both_ms']:.3f} |")
    return lines


if __name__ == "__main__":
    began = time.time()
    rows = main()
    print()
    print("\n".join(summary(rows)))
    print(f"done in {time.time() - began:.0f} s")
