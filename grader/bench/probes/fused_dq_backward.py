"""Probe: does one backward kernel that adds dQ into a float32 buffer beat the two-kernel TMA backward?

The TMA backward (solutions/fast_backward_tma.py) runs a dK/dV kernel and a dQ kernel.  Each
recomputes the scores and dP of every visible tile, so a tile costs seven matrix products: QK^T,
dO V^T, P^T dO and dS^T Q in the first, QK^T, dO V^T and dS K in the second.  FlashAttention-2's
and -3's backward make one pass: the dK/dV program also forms dS K for its key block and adds it
into a float32 dQ that every key block of the row shares, five products a tile, at the price of
the additions (FlashAttention-3 sends them through the TMA unit's reduce-add).  This probe times
that pass, minimal (dense, causal or not, as many K/V heads as query heads, N a multiple of the
tiles), beside the TMA backward with every feature and SDPA's cuDNN backward, on the same inputs:

    fused-tma       dQ added through a descriptor's ``atomic_add`` (TMA reduce-add)
    fused-atomic    dQ added element by element (``tl.atomic_add``)
    tma             solutions/fast_backward_tma.py's flash_attention_backward
    cudnn           SDPA's cuDNN backend, ``torch.autograd.grad`` of its output

Each fused variant is timed over a few tiles and reports its fastest; every backward includes
stage 9's preprocess (delta) and, for the fused ones, zeroing the float32 buffer and converting it.
Gradients are checked against float32 SDPA before any timing.

    python grader/bench/probes/fused_dq_backward.py [--json PATH]    (a CUDA GPU; $OUT or /tmp)

tests/test_fast_backward.py judges the element-wise variant against float64 autograd on the CPU, in
Triton's interpreter (which has no descriptor reduce-add).
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
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634
# (BLOCK_M, BLOCK_N, warps, stages): each fits sm_90's shared memory, and ptxas spilled no register for it
# when Triton 3.9 compiled it for sm_90a without a GPU (128 x 128 at D64 spilled, as did 64 x 128 with 4 warps).
TILES = {
    64: [(64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 3), (32, 128, 8, 2), (128, 64, 8, 2)],
    128: [(64, 128, 8, 2), (32, 128, 8, 2), (64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2)],
}


@triton.jit
def _pass(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, desc_dq, DQ, bh, row, start_n, lo, hi, sm_scale,
          qk_scale, MASKED: tl.constexpr, TMA_REDUCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          D: tl.constexpr):
    """Over query blocks [lo, hi): dk += dS^T Q, dv += P^T dO, and dQ (rows of the buffer) += dS K."""
    offs_m = tl.arange(0, BLOCK_M)
    keys = start_n + tl.arange(0, BLOCK_N)
    for start_m in range(lo, hi, BLOCK_M):
        q = desc_q.load([row + start_m, 0])
        do = desc_do.load([row + start_m, 0])
        lse = desc_lse.load([bh, start_m]).reshape(BLOCK_M)
        delta = desc_delta.load([bh, start_m]).reshape(BLOCK_M)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale                              # (BLOCK_N, BLOCK_M), log2 units
        if MASKED:
            s_t = tl.where(keys[:, None] <= (start_m + offs_m)[None, :], s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        dq = tl.dot(tl.trans(ds_t), k) * sm_scale                             # (BLOCK_M, D) float32
        if TMA_REDUCE:
            desc_dq.atomic_add([row + start_m, 0], dq)
        else:
            rows = (row + start_m + offs_m).to(tl.int64)
            tl.atomic_add(DQ + rows[:, None] * D + tl.arange(0, D)[None, :], dq, sem="relaxed")
    return dk, dv


@triton.jit
def _fused_backward(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, ROWS, N, sm_scale, qk_scale, CAUSAL: tl.constexpr,
                    TMA_REDUCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """One program per (key block, batch x head): its dK and dV, and its share of every dQ row."""
    sm_scale, qk_scale = tl.cast(sm_scale, tl.float32), tl.cast(qk_scale, tl.float32)
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    row = bh * N                                  # (B*H*N, D) row of this head's first position
    desc_q = tl.make_tensor_descriptor(Q, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    desc_do = tl.make_tensor_descriptor(DO, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    desc_k = tl.make_tensor_descriptor(K, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_v = tl.make_tensor_descriptor(V, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_lse = tl.make_tensor_descriptor(LSE, shape=[ROWS // N, N], strides=[N, 1], block_shape=[1, BLOCK_M])
    desc_delta = tl.make_tensor_descriptor(DELTA, shape=[ROWS // N, N], strides=[N, 1], block_shape=[1, BLOCK_M])
    desc_dq = tl.make_tensor_descriptor(DQ, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_M, D])
    k = desc_k.load([row + start_n, 0])
    v = desc_v.load([row + start_n, 0])
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    if CAUSAL:                                    # query blocks on the diagonal masked, the rest whole
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.maximum(start_n + BLOCK_N, lo + BLOCK_M)
        dk, dv = _pass(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, desc_dq, DQ, bh, row, start_n, lo, mid,
                       sm_scale, qk_scale, True, TMA_REDUCE, BLOCK_M, BLOCK_N, D)
        dk, dv = _pass(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, desc_dq, DQ, bh, row, start_n, mid, N,
                       sm_scale, qk_scale, False, TMA_REDUCE, BLOCK_M, BLOCK_N, D)
    else:
        dk, dv = _pass(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, desc_dq, DQ, bh, row, start_n, 0, N,
                       sm_scale, qk_scale, False, TMA_REDUCE, BLOCK_M, BLOCK_N, D)
    desc_dk = tl.make_tensor_descriptor(DK, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_dv = tl.make_tensor_descriptor(DV, shape=[ROWS, D], strides=[D, 1], block_shape=[BLOCK_N, D])
    desc_dk.store([row + start_n, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    desc_dv.store([row + start_n, 0], dv.to(DV.dtype.element_ty))


def fused_backward(q, k, v, o, lse, do, causal, tile, tma_reduce, preprocess):
    """(dq, dk, dv) of contiguous (B, H, N, D) inputs, N a multiple of the tile's blocks."""
    B, H, N, D = q.shape
    bm, bn, warps, stages = tile
    assert N % max(bm, bn) == 0 and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    delta, _ = preprocess(o, do, lse)
    do = do.contiguous()
    dq32 = torch.zeros(B, H, N, D, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    scale = D ** -0.5
    _fused_backward[(N // bn, B * H)](q, k, v, do, lse, delta, dk, dv, dq32, B * H * N, N, scale, scale * LOG2E,
                                      CAUSAL=causal, TMA_REDUCE=tma_reduce, BLOCK_M=bm, BLOCK_N=bn, D=D,
                                      num_warps=warps, num_stages=stages)
    return dq32.to(q.dtype), dk, dv


def _reference(q, k, v, do, causal):
    qq, kk, vv = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    return torch.autograd.grad(o, (qq, kk, vv), do.float())


MAX_ERROR = 2e-2      # a backward whose gradients are further from float32 SDPA's is wrong, and not timed


def dense_cases():
    """``(d, causal, name, (q, k, v, do), flops)`` of the timed cases: B4 H16 N4096 bfloat16 at head
    dims 64 and 128, causal or not, and the backward's FLOPs over the visible pairs (five products:
    2.5x the forward's)."""
    for d in (64, 128):
        for causal in (False, True):
            gen = torch.Generator(device="cuda").manual_seed(0)
            inputs = tuple(torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))
            flops = 4 * 4 * 16 * d * (4096 * 4097 // 2 if causal else 4096 * 4096) * 5 // 2
            yield d, causal, f"B4 H16 N4096 D{d}{' causal' if causal else ''}", inputs, flops


def bench(fn) -> float:
    """Milliseconds per call of ``fn``, as every row of these probes is timed."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=20, rep=80, return_mode="median")


def _error(got, want) -> float:
    """Largest |got - want| over the largest |want|, across dq, dk and dv."""
    return max(((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item() for g, w in zip(got, want))


def baselines(record, tma_b, q, k, v, o, lse, do, causal: bool, want) -> None:
    """Time the two backwards every row is set against, on the same inputs: ``tma_b``'s (the
    module of solutions/fast_backward_tma.py), with its error against ``want``, and SDPA's cuDNN
    backend; ``record(provider, ms, note)`` keeps each."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        got = tma_b.flash_attention_backward(q, k, v, o, lse, do, causal=causal)[:3]
        record("tma", bench(lambda: tma_b.flash_attention_backward(q, k, v, o, lse, do, causal=causal)),
               f"error {_error(got, want):.1e}")
    except Exception as e:                          # a probe reports and goes on
        record("tma", None, f"failed: {type(e).__name__}: {str(e)[:200]}")
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oo = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
    record("cudnn", bench(lambda: torch.autograd.grad(oo, (qq, kk, vv), do, retain_graph=True)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "fused-dq.json"))
    args = parser.parse_args()

    runtime.tma_scratch()
    tma_f = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    tma_b = load_file(ROOT / "solutions" / "fast_backward_tma.py")
    preprocess = tma_b._stage9.backward_preprocess
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=[])
    print(doc["gpu"], doc["torch"], "triton", doc["triton"], flush=True)

    for d, causal, name, (q, k, v, do), flops in dense_cases():
        start = time.time()
        print(name, flush=True)
        o, lse = tma_f.flash_attention(q, k, v, causal=causal)
        want = _reference(q, k, v, do, causal)

        def record(provider, ms, note=""):
            row = dict(case=name, provider=provider, bwd_ms=ms, note=note,
                       bwd_tflops=round(flops / ms / 1e9, 1) if ms else None)
            doc["rows"].append(row)
            Path(args.json).write_text(json.dumps(doc, indent=1))
            print(f"  {provider:13s} {ms or 0:7.3f} ms  {row['bwd_tflops']} TFLOP/s  {note}", flush=True)

        for provider, tma_reduce in (("fused-tma", True), ("fused-atomic", False)):
            timed = []
            for tile in TILES[d]:
                try:
                    def run(tile=tile, tma_reduce=tma_reduce):
                        return fused_backward(q, k, v, o, lse, do, causal, tile, tma_reduce, preprocess)
                    err = _error(run(), want)
                    if err > MAX_ERROR:
                        record(provider, None, f"tile {tile}: WRONG, relative error {err:.2e}")
                        continue
                    timed.append((bench(run), tile, err))
                except Exception as e:          # a probe reports and goes on
                    record(provider, None, f"tile {tile} failed: {type(e).__name__}: {str(e)[:200]}")
                torch.cuda.empty_cache()
            if timed:
                ms, tile, err = min(timed)
                others = ", ".join(f"{t}: {m:.3f}" for m, t, _ in sorted(timed))
                record(provider, ms, f"best tile {tile}, error {err:.1e}; all: {others}")
        baselines(record, tma_b, q, k, v, o, lse, do, causal, want)
        print(f"  ({time.time() - start:.0f} s)", flush=True)

    print("\n| case | provider | bwd ms | bwd TFLOP/s | vs cuDNN | vs tma |")
    for r in doc["rows"]:
        if not r["bwd_ms"]:
            continue
        same = [x for x in doc["rows"] if x["case"] == r["case"] and x["bwd_ms"]]
        cudnn = next((x for x in same if x["provider"] == "cudnn"), None)
        tma = next((x for x in same if x["provider"] == "tma"), None)
        vs = [f"{x['bwd_ms'] / r['bwd_ms']:.2f}x" if x else "-" for x in (cudnn, tma)]
        print(f"| {r['case']} | {r['provider']} | {r['bwd_ms']:.3f} | {r['bwd_tflops']} | {vs[0]} | {vs[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
