"""Probe: where the one-pass backward's time goes, kernel by kernel, against cuDNN's, as the
sequence grows at a fixed amount of work.

Sections 13-15 of docs/hopper-notes.md left the one pass (solutions/fast_backward_wgmma.cu, the
op's backward on Hopper) at 0.92-0.99x cuDNN's backward on the dense B4 H16 N4096 cases, and
further behind on the causal ones than on the dense ones.  A call of it is four kernels: stage 9's
preprocess (delta), zeroing the float32 dQ, the one pass, and putting dQ back in rows; a thread
block of the one pass owns 128 keys and walks the query blocks that see them, so its fixed costs
(bringing K and V in, filling the ring, writing dK and dV) are spread over Nq / 64 steps, half as
many under a causal mask.  This probe times, for head dims 64 and 128, causal or not, at
N = 1024 .. 8192 with B x N^2 held at B4 N4096's (H16, bfloat16):

    one-pass    solutions/fast_backward_wgmma.py's flash_attention_backward, as the op calls it
    cudnn       SDPA's cuDNN backend, ``torch.autograd.grad`` of its output

each call's median time (``triton.testing.do_bench``) and, from the PyTorch profiler over a few
calls, each kernel's share: the largest kernel ("main") and the rest.  A fixed cost a thread block
shows as a main kernel slower at short sequences than at long ones for the same work.

    python grader/bench/probes/backward_parts.py [--lengths 1024,2048] [--run NAME] [--append] [--json PATH]
                                                                   (an sm_90 GPU and nvcc; $OUT or /tmp)

``--append`` adds this run's rows, named ``--run``, to those of the JSON already at ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from kernels import runtime  # noqa: E402,F401  (decides TRITON_INTERPRET before triton is imported)
from kernels.loader import ROOT, load_file  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

HERE = Path(__file__).resolve().parent
_fused = load_file(HERE / "fused_dq_backward.py")     # bench() and _error(): every probe times the same way
PROFILED_CALLS = 5


def cases(lengths=(1024, 2048, 4096, 8192)):
    """``(d, causal, n, name, (q, k, v, do), flops)``: B x N^2 = 4 x 4096^2, H16, bfloat16; FLOPs
    over the visible pairs, five products (2.5x the forward's)."""
    for d in (64, 128):
        for causal in (False, True):
            for n in lengths:
                b = 4 * (4096 // n) ** 2 if n <= 4096 else max(1, 4 * 4096 * 4096 // (n * n))
                gen = torch.Generator(device="cuda").manual_seed(0)
                inputs = tuple(torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                               for _ in range(4))
                flops = 4 * b * 16 * d * (n * (n + 1) // 2 if causal else n * n) * 5 // 2
                yield d, causal, n, f"B{b} H16 N{n} D{d}{' causal' if causal else ''}", inputs, flops


def kernel_ms(fn, calls: int = PROFILED_CALLS) -> dict[str, float]:
    """GPU milliseconds a call of ``fn`` spends in each kernel (by name), from the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None)
        if total is None:
            total = event.cuda_time_total
        if total > 0:
            out[event.key] = out.get(event.key, 0.0) + total / 1000 / calls
    return out


def summary(rows: list[dict]) -> list[str]:
    """A markdown table: a row a run, case and provider, with the call's time, the main kernel's
    and the rest's, the main kernel's TFLOP/s, and the call's speed against cuDNN's in the same run."""
    lines = ["| run | case | provider | call ms | main kernel ms | other kernels ms | main TFLOP/s | against cuDNN |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    cudnn = {(r["run"], r["case"]): r["ms"] for r in rows if r["provider"] == "cudnn"}
    for r in rows:
        of = cudnn.get((r["run"], r["case"]))
        ratio = f"{of / r['ms']:.2f}x" if r["provider"] != "cudnn" and of else "–"
        lines.append(f"| {r['run']} | {r['case']} | {r['provider']} | {r['ms']:.3f} | {r['main_ms']:.3f} | "
                     f"{r['other_ms']:.3f} | {r['main_tflops']:.0f} | {ratio} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "backward-parts.json"))
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="sequence lengths, comma-separated")
    parser.add_argument("--run", default="run", help="this run's name in the JSON")
    parser.add_argument("--append", action="store_true", help="keep the rows already in --json")
    args = parser.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    runtime.tma_scratch()
    tma_f = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    fast = load_file(ROOT / "solutions" / "fast_backward_wgmma.py")
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python grader/bench/probes/backward_parts.py " + " ".join(sys.argv[1:]), rows=[])
    if args.append and Path(args.json).exists():
        doc["rows"] = json.loads(Path(args.json).read_text())["rows"]
    print(doc["gpu"], doc["torch"], "triton", doc["triton"], flush=True)
    for d, causal, n, name, (q, k, v, do), flops in cases(lengths):
        start = time.time()
        o, lse = tma_f.flash_attention(q, k, v, causal=causal)
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            oo = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        want = torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True)
        err = _fused._error(fast.flash_attention_backward(q, k, v, o, lse, do, causal=causal)[:3], want)
        providers = {
            "one-pass": lambda: fast.flash_attention_backward(q, k, v, o, lse, do, causal=causal),
            "cudnn": lambda: torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True),
        }
        print(name, f"(one pass against cuDNN's gradients: {err:.1e})", flush=True)
        for provider, fn in providers.items():
            ms = _fused.bench(fn)
            parts = kernel_ms(fn)
            main_name = max(parts, key=parts.get)
            row = dict(run=args.run, case=name, d=d, causal=causal, n=n, provider=provider, ms=ms, kernels=parts,
                       main=main_name, main_ms=parts[main_name], other_ms=sum(parts.values()) - parts[main_name],
                       main_tflops=flops / parts[main_name] / 1e9, difference_from_cudnn=err)
            doc["rows"].append(row)
            Path(args.json).write_text(json.dumps(doc, indent=1))
            print(f"  {provider:9s} {ms:7.3f} ms  main {row['main_ms']:.3f} ({row['main_tflops']:.0f} TFLOP/s)"
                  f"  other {row['other_ms']:.3f}  [{main_name[:60]}]", flush=True)
        print(f"  ({time.time() - start:.0f} s)", flush=True)
    print()
    print("\n".join(summary(doc["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
