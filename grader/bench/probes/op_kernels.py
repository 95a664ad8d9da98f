"""Probe: the kernels behind solutions/attention_op on Hopper, forward and backward, each case's
providers timed in the same run on the same inputs (bf16).

    python grader/bench/probes/op_kernels.py [--json PATH] [--old DIR [--old-name NAME]] [--cases 0,1]
                                             [--providers op,flex,cudnn] [--run NAME]

Providers:

    tma             solutions/fast_forward_tma.py and fast_backward_tma.py, called directly
    old             with ``--old DIR``: the two files found in DIR (copies of another version, beside
                    copies of the stage files they load), for an A/B of a change; ``--old-name``
                    names the rows (docs/hopper-notes.md says which versions its rows timed)
    op              attention_op.attention as a model calls it, (B, H, N, D) inputs: the kernels
                    its plan picks (the TMA kernels, and stage 4's wgmma forward where the plan
                    timed it faster), its launch plan and its autograd
    op-bnhd         the same with (B, N, H, D) tensors (``layout="bnhd"``), read where they lie
    op-stage9       the op with stage 9's kernels (``plans.KERNELS = "stage9"``)
    cudnn, fa2      SDPA's cuDNN and FlashAttention-2 backends (no window, no sinks: for the
                    gpt-oss cases they compute full causal attention without sinks, a floor)
    flex            FlexAttention compiled, with the case's mask and learned sinks through its lse
                    (grader/bench/providers.py's ``flex``)

``--providers`` times only those; ``--run`` labels the rows, and ``--json`` adds them to the rows
an existing file holds (the file's runs stay apart by label).

The forward is timed under ``no_grad``; the backward is the kernels' backward given o and lse, or
``torch.autograd.grad`` of the forward's output for the op and SDPA.  ms are
``triton.testing.do_bench`` medians; TFLOP/s count the visible (query, key) pairs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())
from kernels.loader import ROOT, load_file, load_package  # noqa: E402

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

CASES = [dict(name=f"B4 H16 N4096 D{d}{' causal' if c else ''}", b=4, hq=16, hkv=16, n=4096, d=d, causal=c,
              window=None, sinks=False) for d in (64, 128) for c in (False, True)]
CASES += [dict(name=f"gpt-oss B1 N4096 Hq64/Hkv8 D64 sinks, {'window 128' if w else 'full causal'}", b=1, hq=64,
               hkv=8, n=4096, d=64, causal=True, window=w, sinks=True) for w in (None, 128)]


def flops(case: dict, backward: bool) -> int:
    n, w = case["n"], case["window"]
    pairs = (sum(min(i + 1, w) for i in range(n)) if w else n * (n + 1) // 2 if case["causal"] else n * n)
    forward = 4 * case["b"] * case["hq"] * case["d"] * pairs
    return forward * 5 // 2 if backward else forward


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "op-kernels.json"))
    parser.add_argument("--old", default=None)
    parser.add_argument("--old-name", default="old")
    parser.add_argument("--cases", default=None, help="indices into CASES, comma-separated")
    parser.add_argument("--providers", default="tma,old,op,op-bnhd,op-stage9,cudnn,fa2,flex")
    parser.add_argument("--run", default="run")
    args = parser.parse_args()
    wanted = set(args.providers.split(","))
    tma_f = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    tma_b = load_file(ROOT / "solutions" / "fast_backward_tma.py")
    old = None
    if args.old:
        old = (load_file(Path(args.old) / "fast_forward_tma.py"), load_file(Path(args.old) / "fast_backward_tma.py"))
    op = load_package(ROOT / "solutions" / "attention_op")
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=[])
    if Path(args.json).exists():
        earlier = json.loads(Path(args.json).read_text())
        assert (earlier["gpu"], earlier["torch"], earlier["triton"]) == (doc["gpu"], doc["torch"], doc["triton"]), \
            "the file holds another machine's or version's runs"
        doc = earlier
    print(doc["gpu"], doc["torch"], "triton", doc["triton"], flush=True)

    def bench(fn):
        return do_bench(fn, warmup=20, rep=80, return_mode="median")

    def record(case, provider, fwd_ms, bwd_ms, note=""):
        row = dict(run=args.run, case=case["name"], provider=provider, fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                   fwd_tflops=round(flops(case, False) / fwd_ms / 1e9, 1) if fwd_ms else None,
                   bwd_tflops=round(flops(case, True) / bwd_ms / 1e9, 1) if bwd_ms else None, note=note)
        doc["rows"].append(row)
        Path(args.json).write_text(json.dumps(doc, indent=1))
        print(f"  {provider:12s} fwd {fwd_ms or 0:7.3f} ms  bwd {bwd_ms or 0:7.3f} ms  {note}", flush=True)

    chosen = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    for case in chosen:
        start = time.time()
        print(case["name"], flush=True)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(case["b"], case["hq"], case["n"], case["d"], device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(case["b"], case["hkv"], case["n"], case["d"], device="cuda", dtype=torch.bfloat16,
                            generator=gen) for _ in range(2))
        do = torch.randn_like(q)
        sinks = torch.randn(case["hq"], device="cuda") if case["sinks"] else None
        opts = dict(causal=case["causal"], window=case["window"], sinks=sinks)
        reference_o = None
        kernel_sets = [("tma", tma_f, tma_b)] if "tma" in wanted else []
        kernel_sets += [(args.old_name, *old)] if old and "old" in wanted else []
        for name, fwd, bwd in kernel_sets:
            try:
                o, lse = fwd.flash_attention(q, k, v, **opts)
                if reference_o is None:
                    reference_o = o
                note = f"max |o - tma's o| {(o.float() - reference_o.float()).abs().max().item():.2e}"
                f_ms = bench(lambda: fwd.flash_attention(q, k, v, **opts))
                b_ms = bench(lambda: bwd.flash_attention_backward(q, k, v, o, lse, do, **opts))
                record(case, name, f_ms, b_ms, note)
            except Exception as e:          # a probe reports and goes on
                record(case, name, None, None, f"failed: {type(e).__name__}: {str(e)[:300]}")
        for name, layout, kernels in (("op", "bhnd", "auto"), ("op-bnhd", "bnhd", "auto"),
                                      ("op-stage9", "bhnd", "stage9")):
            if name not in wanted:
                continue
            op.plans.KERNELS = kernels
            try:
                if layout == "bnhd":
                    qq, kk, vv, dd = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))   # (B, N, H, D)
                else:
                    qq, kk, vv, dd = q, k, v, do
                qq, kk, vv = (t.detach().requires_grad_(True) for t in (qq, kk, vv))
                ss = sinks.clone().requires_grad_(True) if sinks is not None else None
                inputs = (qq, kk, vv) + ((ss,) if ss is not None else ())

                def call():
                    return op.attention(qq, kk, vv, is_causal=case["causal"], window=case["window"], sinks=ss,
                                        enable_gqa=case["hq"] != case["hkv"], layout=layout)
                torch.autograd.grad(call(), inputs, dd)            # plans and compiles
                with torch.no_grad():
                    f_ms = bench(call)
                o = call()
                b_ms = bench(lambda: torch.autograd.grad(o, inputs, dd, retain_graph=True))
                plan = op.launch_plan(case["b"], case["hq"], case["hkv"], case["n"], case["n"], case["d"],
                                      torch.bfloat16, q.device, case["causal"], case["window"] or 0, 0, case["sinks"])
                kernels = "TMA kernels" if plan["tma"] else "stage 9's kernels"
                one_pass = op.plans.backward_plan(case["b"], case["hq"], case["hkv"], case["n"], case["n"], case["d"],
                                                  torch.bfloat16, q.device, case["causal"], case["window"] or 0, 0,
                                                  case["sinks"])["wgmma_backward"]     # made at the first backward
                record(case, name, f_ms, b_ms, f"{'wgmma' if plan.get('wgmma') else kernels} forward, "
                                               f"{'one-pass' if one_pass else kernels} backward")
            except Exception as e:
                record(case, name, None, None, f"failed: {type(e).__name__}: {str(e)[:300]}")
            finally:
                op.plans.KERNELS = "auto"
        if case["window"] is None:
            for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                if name not in wanted:
                    continue
                qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

                def sdpa(backend=backend, qq=qq, kk=kk, vv=vv):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=case["causal"],
                                                              enable_gqa=case["hq"] != case["hkv"])
                try:
                    with torch.no_grad():
                        f_ms = bench(sdpa)
                    o = sdpa()
                    b_ms = bench(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True))
                    record(case, name, f_ms, b_ms, "no sinks: full causal attention" if case["sinks"] else "")
                except Exception as e:
                    record(case, name, None, None, f"failed: {type(e).__name__}: {str(e)[:300]}")
        if "flex" in wanted:
            _flex(case, q, k, v, sinks, do, bench, record)
        print(f"  ({time.time() - start:.0f} s)", flush=True)

    print("\n| case | provider | fwd TFLOP/s | bwd TFLOP/s | fwd vs cuDNN | bwd vs cuDNN |")
    for case in chosen:
        rows = [r for r in doc["rows"] if r["case"] == case["name"] and r.get("run") == args.run]
        cudnn = next((r for r in rows if r["provider"] == "cudnn" and r["fwd_ms"]), None)
        for r in rows:
            if not r["fwd_ms"]:
                continue
            vs_f = f"{cudnn['fwd_ms'] / r['fwd_ms']:.2f}x" if cudnn else "-"
            vs_b = f"{cudnn['bwd_ms'] / r['bwd_ms']:.2f}x" if cudnn and r["bwd_ms"] else "-"
            print(f"| {case['name']} | {r['provider']} | {r['fwd_tflops']} | {r['bwd_tflops']} | {vs_f} | {vs_b} |")
    return 0


def _flex(case, q, k, v, sinks, do, bench, record):
    """FlexAttention, compiled, on the same inputs: the bench's provider, forward and backward."""
    from grader.bench.cases import Case, Inputs
    from grader.bench.providers import Flex
    shape = dict(batch=case["b"], heads=case["hq"], kv_heads=case["hkv"], n_q=case["n"], n_k=case["n"],
                 head_dim=case["d"], causal=case["causal"], window=case["window"], sinks=case["sinks"])
    try:
        flex = Flex()
        x = Inputs(q, k, v, sinks, do)
        attend = flex.attend(Case(**shape), x)
        attend(q, k, v, sinks)                                  # compiles
        with torch.no_grad():
            f_ms = bench(lambda: attend(q, k, v, sinks))
        grads, _ = flex.backward(Case(**shape, backward=True), x)
        grads()
        record(case, "flex", f_ms, bench(grads))
    except Exception as e:
        record(case, "flex", None, None, f"failed: {type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    sys.exit(main())
