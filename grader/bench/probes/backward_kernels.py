"""Probe: where the backward's time goes, kernel by kernel, in the op and in cuDNN.

Profiles forward plus backward of ``solutions/attention_op.attention`` and of SDPA's cuDNN backend
at the dense cases (B4 H16 N4096 bf16, D64 and D128, causal and not) and records each GPU kernel's
time per call. Each kernel's rate counts the matrix products it does over the visible pairs,
2 * B * H * pairs * D FLOPs each: the forward does 2 (S and P V), the op's dK/dV kernel 4 (S, dP,
dV, dK), its dQ kernel 3 (S, dP, dQ), cuDNN's one backward kernel 5. A kernel the list below does
not name is kept as an "other" row of its provider and counted in that provider's backward total.

    python grader/bench/probes/backward_kernels.py [--json FILE]     (a CUDA GPU)

docs/hopper-notes.md says what it measured.
"""
import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.getcwd())
from kernels.loader import ROOT, load_package  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

# (name fragment, what the table calls it, matrix products); the first fragment a kernel's name holds
KERNELS = [("_tma_forward_kernel", "op forward", 2), ("_tma_dkdv_kernel", "op dK/dV", 4),
           ("_tma_dq_kernel", "op dQ", 3), ("_bwd_preprocess_kernel", "op preprocess", 0),
           ("flash_fprop", "cuDNN forward", 2), ("flash_bprop", "cuDNN backward", 5),
           ("dot_do_o", "cuDNN preprocess", 0), ("convert_dq", "cuDNN dQ to 16 bits", 0)]
CALLS = 10


def summary(rows: list[dict]) -> list[str]:
    """A markdown table: per case, each backward kernel's µs a call (TFLOP/s of its products), and
    the two backwards' totals."""
    lines = ["| case | op dK/dV | op dQ | op backward, all kernels | cuDNN backward | cuDNN backward, all kernels |",
             "| --- | --- | --- | --- | --- | --- |"]
    for case in dict.fromkeys(r["case"] for r in rows):
        of = {r["kernel"]: r for r in rows if r["case"] == case}

        def cell(name):
            r = of[name]
            return f"{r['us']:.0f} µs ({r['tflops']:.0f})"

        op = sum(r["us"] for k, r in of.items() if k.startswith("op ") and k != "op forward")
        cudnn = sum(r["us"] for k, r in of.items() if k.startswith("cuDNN ") and k != "cuDNN forward")
        lines.append(f"| {case} | {cell('op dK/dV')} | {cell('op dQ')} | {op:.0f} µs | {cell('cuDNN backward')} "
                     f"| {cudnn:.0f} µs |")
    return lines


def main(json_path: str) -> int:
    """Profile every case, write the rows to ``json_path`` and print the table."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    op = load_package(ROOT / "solutions" / "attention_op")
    rows = []
    for D in (64, 128):
        for causal in (False, True):
            B, H, N = 4, 16, 4096
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            do = torch.randn_like(q)
            pairs = N * (N + 1) / 2 if causal else N * N
            case = f"B{B} H{H} N{N} D{D}" + (" causal" if causal else "")
            for provider in ("op", "cudnn"):
                def step():
                    if provider == "op":
                        o = op.attention(q, k, v, is_causal=causal)
                    else:
                        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    return torch.autograd.grad(o, (q, k, v), do)
                backend = sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if provider == "cudnn" else contextlib.nullcontext()
                with backend:
                    for _ in range(3):
                        step()
                    torch.cuda.synchronize()
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        for _ in range(CALLS):
                            step()
                        torch.cuda.synchronize()
                for event in prof.key_averages():
                    us = event.self_device_time_total / CALLS
                    if us <= 0:
                        continue
                    named = [(name, products) for fragment, name, products in KERNELS if fragment in event.key]
                    who = "op" if provider == "op" else "cuDNN"
                    name, products = named[0] if named else (f"{who} other: {event.key[:60]}", 0)
                    flops = 2 * B * H * pairs * D * products
                    rows.append(dict(case=case, kernel=name, cuda_name=event.key[:120], us=us,
                                     tflops=round(flops / us / 1e6, 1) if products else None))
                    print(f"{case} {name}: {us:.0f} µs", flush=True)
    with open(json_path, "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       calls=CALLS, rows=rows), f, indent=1)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "backward-kernels.json"))
    raise SystemExit(main(cli.parse_args().json))
