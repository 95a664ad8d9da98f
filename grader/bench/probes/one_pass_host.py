"""Probe: what the one-pass wgmma backward costs the host, against the TMA backward, per training call.

The op's plan times backwards on the GPU alone.  The one pass's keys stay on the Python path
(native.py cannot repeat them) and in a compiled graph it is an opaque op that runs Python, so
where the GPU work is short the host decides.  For the attention of ``python -m grader bench
train``'s layers (bfloat16, (B, N, H, D) views, GQA, causal or a 128-key window) this times one
eager forward plus backward through ``solutions/attention_op``, C++ path built, with each kernel
set forced (``plans.KERNELS``: "wgmma" for the wgmma forward and the one pass, "tma" for the TMA
kernels; the one pass keeps the whole call, forward too, on the Python path): host
milliseconds per call (queued behind a spin of the GPU, so that the GPU never waits) and GPU
milliseconds per call (the host kept ahead the same way).

    python grader/bench/probes/one_pass_host.py [--json PATH]            (an sm_90 GPU and nvcc)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels import runtime  # noqa: E402,F401  (decides TRITON_INTERPRET first)
from kernels.loader import ROOT, load_package  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

# (name, batch, query heads, K/V heads, N, window): bench train's b8n1024 and b2n4096 layers.
SHAPES = [("b8n1024", 8, 8, 2, 1024, None), ("b8n1024 W128", 8, 8, 2, 1024, 128),
          ("b2n4096", 2, 8, 2, 4096, None), ("b2n4096 W128", 2, 8, 2, 4096, 128)]
CALLS = 20


def measure(op, b, hq, hkv, n, window) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, n, hq, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    k, v = (torch.randn(b, n, hkv, 64, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
            for _ in range(2))
    do = torch.randn_like(q)

    def call():
        o = op.attention(q, k, v, is_causal=True, window=window, enable_gqa=True, layout="bnhd")
        torch.autograd.grad(o, (q, k, v), do)
    for _ in range(5):
        call()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)                 # ~0.2 s of the GPU's clock: the host runs ahead
    start = time.perf_counter()
    for _ in range(CALLS):
        call()
    host = (time.perf_counter() - start) / CALLS * 1e3
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(400_000_000)
    begin.record()
    for _ in range(CALLS):
        call()
    end.record()
    end.synchronize()
    return dict(host_ms=round(host, 4), gpu_ms=round(begin.elapsed_time(end) / CALLS, 4))


def summary(rows: list[dict]) -> list[str]:
    """A markdown table: a row a case, host and GPU milliseconds per call with each backward."""
    lines = ["| case | TMA: host / GPU ms | one pass: host / GPU ms |", "| --- | --- | --- |"]
    for case in dict.fromkeys(r["case"] for r in rows):
        of = {r["backward"]: r for r in rows if r["case"] == case}
        cells = [f"{of[b]['host_ms']:.3f} / {of[b]['gpu_ms']:.3f}" for b in ("TMA", "one pass")]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "one-pass-host.json"))
    args = parser.parse_args()
    op = load_package(ROOT / "solutions" / "attention_op")
    op.native.build(wait=True)
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               native=op.native.module() is not None, rows=[])
    print(doc["gpu"], doc["torch"], "triton", doc["triton"], "C++ path", doc["native"], flush=True)
    for name, b, hq, hkv, n, window in SHAPES:
        for kernels in ("tma", "wgmma"):
            op.plans.KERNELS = kernels
            row = dict(case=name, backward="one pass" if kernels == "wgmma" else "TMA",   # and their forwards
                       **measure(op, b, hq, hkv, n, window))
            doc["rows"].append(row)
            print(f"{name:14s} {row['backward']:9s} host {row['host_ms']:.3f} ms  GPU {row['gpu_ms']:.3f} ms",
                  flush=True)
    op.plans.KERNELS = "auto"
    with open(args.json, "w") as f:
        json.dump(doc, f, indent=1)
    print("\n".join(summary(doc["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
