"""Probe: what a TMA descriptor made in the kernel costs a short window's forward, and where the
windowed backward's time goes.

docs/hopper-notes.md, section 19, left the op's window-128 forward at 1.33-1.38x FlexAttention,
a program there seeing about five key blocks: little work to spread a program's fixed costs
over, and one of them is making K's and V's descriptors (``tl.make_tensor_descriptor`` writes
each to global memory and fences it before the first load).  At B4 Hq32/Hkv8 N8192 D64, causal,
windows 128 (with and without learned sinks) and 1024, bfloat16:

    (a) the TMA forward's kernel (solutions/fast_forward_tma.py's loops and block ranges) at fixed
        tiles, its K and V descriptors made in the kernel or on the host (``TensorDescriptor``,
        ``host``), each program taking 1, 2 or 4 query tiles in turn (``x1``, ``x2``, ``x4``: the
        descriptors made once for all of them), beside FlexAttention compiled and the file's own
        autotuned forward (``autotuned``), each output compared with that forward's (``err``).  In
        the run kept that forward made its descriptors in the kernel; it now makes them on the host;
    (b) the op's backward at windows 1024 and 128 against FlexAttention's, and each one's kernels'
        GPU time per call from the PyTorch profiler.

    python grader/bench/probes/host_descriptors.py [a|b|ab]       (a Hopper GPU; writes $OUT/probe1.json)

The kernel here is the forward's as it was before the change this probe led to (section 22),
with ``TILES`` and ``HOST_DESC`` added; the file's own kernel now takes host-made descriptors.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels import runtime  # noqa: E402  (decides TRITON_INTERPRET before triton is imported)
from kernels.loader import ROOT, load_file, load_package  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

ff = load_file(ROOT / "solutions" / "fast_forward_tma.py")
_tma_blocks, _tma_window_edges, tiles_of = ff._tma_blocks, ff._tma_window_edges, ff.tiles_of
key_blocks_of = ff.key_blocks_of
OUT = os.environ.get("OUT", "/tmp")
rows = []


def bench(fn):
    return do_bench(fn, warmup=20, rep=80, return_mode="median")


@triton.jit
def _kernel(Q, K, V, O, LSE, SINKS, stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
            B, H_Q, GROUP, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale,
            CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, HAS_SINKS: tl.constexpr,
            PACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
            ONE_LOOP: tl.constexpr, TILES: tl.constexpr, HOST_DESC: tl.constexpr):
    ROWS: tl.constexpr = BLOCK_M // PACK
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_hp = tl.program_id(1)
    b = pid_hp // (H_Q // PACK)
    h0 = pid_hp % (H_Q // PACK) * PACK
    kv_h = h0 // GROUP
    rows = tl.arange(0, BLOCK_M)
    head = h0 + rows // ROWS
    offs_n = tl.arange(0, BLOCK_N)
    if HOST_DESC:
        desc_k = K
        desc_v = V
    else:
        desc_k = tiles_of(K, B, H_Q // GROUP, N_K, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_DIM_PAD)
        desc_v = tiles_of(V, B, H_Q // GROUP, N_K, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_DIM_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    shift = N_K - N_Q
    for t in range(TILES):
        start_m = (pid_m * TILES + (TILES - 1 - t)) * ROWS
        pos = start_m + rows % ROWS
        row_ok = (pos < N_Q)[:, None]
        q_rows = (Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + pos.to(tl.int64)[:, None] * stride_qn
                  + offs_d[None, :])
        q = tl.load(q_rows, mask=row_ok, other=0.0)
        if HAS_SINKS:
            m_i = tl.load(SINKS + head) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
        sink_hi, lo, full_lo, full_hi, hi = key_blocks_of(start_m, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL,
                                                          HAS_WINDOW=HAS_WINDOW, BLOCK_M=ROWS, BLOCK_N=BLOCK_N)
        if ONE_LOOP:
            acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, lo, hi, pos, offs_n, N_K, shift,
                                        WINDOW, SINK_TOKENS, qk_scale, True, CAUSAL, HAS_WINDOW, HAS_SINK_TOKENS,
                                        BLOCK_N, HEAD_DIM_PAD)
        else:
            acc, m_i, l_i = _tma_window_edges(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, lo, full_lo, full_hi, hi,
                                              pos, offs_n, N_K, shift, WINDOW, SINK_TOKENS, qk_scale, CAUSAL,
                                              HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM_PAD)
            acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, full_lo, full_hi, pos, offs_n, N_K,
                                        shift, WINDOW, SINK_TOKENS, qk_scale, False, CAUSAL, HAS_WINDOW,
                                        HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM_PAD)
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        o_rows = (O + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + pos.to(tl.int64)[:, None] * stride_on
                  + offs_d[None, :])
        tl.store(o_rows, o.to(O.dtype.element_ty), mask=row_ok)
        tl.store(LSE + (b * H_Q + head) * N_Q + pos, (m_i + tl.log2(l_safe)) * 0.6931471805599453, mask=pos < N_Q)


def variant(q, k, v, sinks, window, bm, bn, warps, stages, tiles, host):
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    pack = Hq // Hkv
    o = torch.empty_like(q)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)
    if host:
        kd = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, bn, D])
        vd = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, bn, D])
    else:
        kd, vd = k, v
    rows_ = bm // pack
    grid = (triton.cdiv(triton.cdiv(Nq, rows_), tiles), B * Hq // pack)
    runtime.tma_scratch()

    def call():
        _kernel[grid](q, kd, vd, o, lse, sinks if sinks is not None else lse, *q.stride()[:3], *k.stride()[:3],
                      *v.stride()[:3], *o.stride()[:3], B, Hq, Hq // Hkv, Nq, Nk, window, 0,
                      D ** -0.5 * 1.4426950408889634, CAUSAL=True, HAS_WINDOW=True, HAS_SINK_TOKENS=False,
                      HAS_SINKS=sinks is not None, PACK=pack, BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM_PAD=D,
                      ONE_LOOP=window <= 128, TILES=tiles, HOST_DESC=host, num_warps=warps, num_stages=stages)
        return o
    return call


def part_a():
    from grader.bench.cases import Case, Inputs
    from grader.bench.providers import Flex
    for window, sinks_on in ((128, False), (128, True), (1024, False)):
        gen = torch.Generator(device="cuda").manual_seed(0)
        B, Hq, Hkv, N, D = 4, 32, 8, 8192, 64
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        sinks = torch.randn(Hq, device="cuda") if sinks_on else None
        name = f"W{window}{' sinks' if sinks_on else ''}"
        flex = Flex()
        case = Case(batch=B, heads=Hq, kv_heads=Hkv, n_q=N, n_k=N, head_dim=D, causal=True, window=window,
                    sinks=sinks_on)
        attend = flex.attend(case, Inputs(q, k, v, sinks, None))
        attend(q, k, v, sinks)
        with torch.no_grad():
            flex_ms = bench(lambda: attend(q, k, v, sinks))
        want, _ = ff.flash_attention(q, k, v, causal=True, window=window, sinks=sinks)
        base_ms = bench(lambda: ff.flash_attention(q, k, v, causal=True, window=window, sinks=sinks))
        rows.append(dict(case=name, variant="flex", ms=flex_ms))
        rows.append(dict(case=name, variant="autotuned", ms=base_ms, vs_flex=flex_ms / base_ms))
        print(f"{name}: flex {flex_ms:.4f}  autotuned {base_ms:.4f} ({flex_ms / base_ms:.2f}x)", flush=True)
        tiles_list = ([(128, 32, 4, 3), (128, 32, 4, 2), (128, 64, 4, 3)] if window == 128
                      else [(128, 64, 4, 3), (128, 128, 8, 3)])
        for (bm, bn, w, s) in tiles_list:
            for tiles in (1, 2, 4):
                for host in (False, True):
                    label = f"{bm}/{bn}/{w}w/{s}s x{tiles}{' host' if host else ''}"
                    try:
                        call = variant(q, k, v, sinks, window, bm, bn, w, s, tiles, host)
                        got = call()
                        err = (got.float() - want.float()).abs().max().item()
                        ms = bench(call)
                        rows.append(dict(case=name, variant=label, ms=ms, vs_flex=flex_ms / ms, err=err))
                        print(f"  {label:28s} {ms:.4f} ms  {flex_ms / ms:.2f}x flex  err {err:.1e}", flush=True)
                    except Exception as e:
                        print(f"  {label}: failed {type(e).__name__}: {str(e)[:300]}", flush=True)
        json.dump(rows, open(f"{OUT}/probe1.json", "w"), indent=1)


def part_b():
    from torch.profiler import ProfilerActivity, profile
    op = load_package(ROOT / "solutions" / "attention_op")
    from grader.bench.cases import Case, Inputs
    from grader.bench.providers import Flex
    for window in (1024, 128):
        gen = torch.Generator(device="cuda").manual_seed(0)
        B, Hq, Hkv, N, D = 4, 32, 8, 8192, 64
        q = torch.randn(B, Hq, N, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(B, Hkv, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        do = torch.randn_like(q)
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

        def call():
            return op.attention(qq, kk, vv, is_causal=True, window=window, enable_gqa=True)
        torch.autograd.grad(call(), (qq, kk, vv), do)
        o = call()
        b_ms = bench(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True))
        bp = op.plans.backward_plan(B, Hq, Hkv, N, N, D, torch.bfloat16, q.device, True, window, 0, False)
        flex = Flex()
        case = Case(batch=B, heads=Hq, kv_heads=Hkv, n_q=N, n_k=N, head_dim=D, causal=True, window=window,
                    backward=True)
        grads, _ = flex.backward(case, Inputs(q, k, v, None, do))
        grads()
        f_ms = bench(grads)
        print(f"W{window} backward: op {b_ms:.4f} ms, flex {f_ms:.4f} ms ({f_ms / b_ms:.2f}x); plan {bp}", flush=True)
        rows.append(dict(case=f"W{window} bwd", variant="op", ms=b_ms, vs_flex=f_ms / b_ms, plan=str(bp)))
        rows.append(dict(case=f"W{window} bwd", variant="flex", ms=f_ms))
        for label, fn in (("op", lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)), ("flex", grads)):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            kernels = {}
            for e in prof.events():
                if e.device_type.name == "CUDA":
                    kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time / 1000 / 5
            for kname, ms in sorted(kernels.items(), key=lambda x: -x[1])[:8]:
                print(f"    {label}: {ms:.4f} ms  {kname[:110]}", flush=True)
                rows.append(dict(case=f"W{window} bwd", variant=f"{label} kernel", kernel=kname[:200], ms=ms))
        json.dump(rows, open(f"{OUT}/probe1.json", "w"), indent=1)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    t = time.time()
    which = sys.argv[1] if len(sys.argv) > 1 else "ab"
    if "a" in which:
        part_a()
        print(f"part a {time.time() - t:.0f} s", flush=True)
    if "b" in which:
        part_b()
    print(f"done {time.time() - t:.0f} s", flush=True)
