"""Probe: how near cuDNN does stage 4's hand-written Hopper forward come at D64 and D128?

solutions/fast_variable_block_wgmma.cu is a CUDA forward built as FlashAttention-3 builds its own:
wgmma, a producer warpgroup feeding a TMA ring, consumer warpgroups that overlap one block's softmax
with the next block's product (no ping-pong between them). Stage 4 times it at head dims that are
not powers of two; this probe times it at the dense cases of the other probes, at its planned tile
and a few others, beside SDPA's cuDNN backend and the TMA forward (solutions/fast_forward_tma.py),
each checked against float32 SDPA first.

    python grader/bench/probes/wgmma_forward.py [--json FILE]      (an sm_90 GPU and nvcc)

docs/hopper-notes.md says what it measured.
"""
import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, os.getcwd())
from kernels.loader import ROOT, load_file  # noqa: E402

import torch  # noqa: E402

# (block_n, consumer warpgroups, stages) per head dim, timed beside the kernel's own plan
OTHERS = {64: [(128, 2, 2), (64, 3, 2), (128, 2, 3), (192, 2, 2)],
          128: [(128, 2, 2), (64, 3, 2), (128, 2, 3), (80, 3, 2), (112, 2, 2), (64, 3, 3)]}


def configs(wgmma, head_dim: int) -> list[tuple[int, int, int]]:
    """The kernel's planned configuration for ``head_dim`` (its tiles; timed without turns, as it
    ran before it had them: wgmma_schedule.py times them), then the others."""
    plan = tuple(wgmma.plan(head_dim))[:3]
    return [plan] + [c for c in OTHERS[head_dim] if c != plan]


def summary(rows: list[dict]) -> list[str]:
    """A markdown table: per case, cuDNN's TFLOP/s, the TMA forward's and the wgmma kernel's best
    configuration, each also as a speed against cuDNN."""
    lines = ["| case | cuDNN | TMA forward | wgmma, best configuration |", "| --- | --- | --- | --- |"]
    for case in dict.fromkeys(r["case"] for r in rows):
        of = [r for r in rows if r["case"] == case and "tflops" in r]
        cudnn = next(r["tflops"] for r in of if r["provider"] == "cudnn")
        tma = next(r["tflops"] for r in of if r["provider"] == "tma")
        best = max((r for r in of if r["provider"].startswith("wgmma")), key=lambda r: r["tflops"])
        lines.append(f"| {case} | {cudnn:.0f} | {tma:.0f} ({tma / cudnn:.2f}x) | {best['tflops']:.0f} "
                     f"({best['tflops'] / cudnn:.2f}x; {best['provider'].removeprefix('wgmma ')}) |")
    return lines


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "wgmma-forward.json"))
    args = parser.parse_args()
    wgmma = load_file(ROOT / "solutions" / "fast_variable_block_wgmma.py")
    tma = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    with ThreadPoolExecutor(8) as pool:                       # nvcc, once per configuration, in parallel
        list(pool.map(lambda job: wgmma._kernel(*job), [(d, *c) for d in OTHERS for c in configs(wgmma, d)]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from warp_specialized_dense import dense_cases, save_rows
    rows = []
    for D, causal, (q, k, v), flops, ref in dense_cases():
        case = f"B4 H16 N4096 D{D}" + (" causal" if causal else "")

        def record(name, fn, o):
            err = ((o.float() - ref).norm() / ref.norm()).item()
            if not err < 1e-2:
                rows.append(dict(case=case, provider=name, error=f"relative error {err:.1e} against float32 SDPA"))
                return
            ms = do_bench(fn, rep=200, return_mode="median")
            rows.append(dict(case=case, provider=name, ms=ms, tflops=round(flops / ms / 1e9, 1), err=err))
            print(f"{case} {name}: {flops / ms / 1e9:.0f} TFLOP/s (err {err:.1e})", flush=True)

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            record("cudnn", sdpa, sdpa())
        def fast():
            return tma.flash_attention(q, k, v, causal=causal)
        record("tma", fast, fast()[0])
        for bn, wg, st in configs(wgmma, D):
            def run(bn=bn, wg=wg, st=st):
                return wgmma.flash_attention(q, k, v, causal=causal, block_n=bn, warpgroups=wg, stages=st,
                                             pingpong=False)
            record(f"wgmma {bn}/{wg}wg/{st}s", run, run()[0])
    save_rows(args.json, rows)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
