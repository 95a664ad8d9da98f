"""Probe: does a forward that carries two independent query halves per program, or skips the
rescale of its accumulator when the row maxima did not grow, close the gap to cuDNN on Hopper?

The same minimal dense forward as warp_specialized_dense.py (2-D TMA descriptors made on the host,
no window, no sinks, N a multiple of the tile), in three more forms beside the plain loop:

- ``split``: the program's BLOCK_M query rows are two halves with their own maxima, sums and
  accumulators. Each key block's two score products are issued before either half's softmax, so
  that the GPU has one half's matrix product to run while the other half's softmax runs (what
  FlashAttention-3 gets inside a warpgroup by hand; here it is left to Triton's scheduler).
- ``lazy``: the accumulator and the row sums are rescaled only when some row's maximum grew by more
  than ``LAZY_BOUND`` (log2 units); otherwise the old maxima stay, and the exponentials, at most
  2**LAZY_BOUND, fit float32's range easily. The result is the same up to rounding.
- ``split+lazy``: both.

Each variant is checked against float32 SDPA before it is timed, beside SDPA's cuDNN backend on the
same inputs, at B4 H16 N4096, D64 and D128, causal and not.

    python grader/bench/probes/split_q_forward.py [--json FILE]     (a CUDA GPU)

On the CPU tests/test_fast_forward.py runs the kernel in Triton's interpreter against the float64
reference. docs/hopper-notes.md says what it measured.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LOG2E = 1.4426950408889634
LAZY_BOUND = 8.0            # rescale only when a row's maximum grew past 2**8 of the one kept


@triton.jit
def _softmax_step(s, m_i, l_i, acc, rows, start_n, offs_n, qk_scale, MASKED: tl.constexpr, LAZY: tl.constexpr,
                  LAZY_BOUND: tl.constexpr):
    """One key block's online-softmax update of one set of rows: the new maxima, the probabilities
    (float32) and the rescaled sums and accumulator."""
    if MASKED:
        s = tl.where(rows[:, None] >= start_n + offs_n[None, :], s, float("-inf"))
    m_blk = tl.max(s, 1) * qk_scale
    if LAZY:
        grown = tl.max(m_blk - m_i, 0) > LAZY_BOUND        # one answer for the whole program: no divergence
        if grown:
            m_new = tl.maximum(m_i, m_blk)
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
    else:
        m_new = tl.maximum(m_i, m_blk)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(s * qk_scale - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    return p, m_i, l_i, acc


@triton.jit
def _keys(acc_a, m_a, l_a, acc_b, m_b, l_b, q_a, q_b, desc_k, desc_v, row, lo, hi, rows_a, rows_b, offs_n,
          qk_scale, SPLIT: tl.constexpr, MASKED: tl.constexpr, LAZY: tl.constexpr, LAZY_BOUND: tl.constexpr,
          BLOCK_N: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        k = desc_k.load([row + start_n, 0])
        s_a = tl.dot(q_a, k.T)
        if SPLIT:
            s_b = tl.dot(q_b, k.T)                          # issued before half a's softmax
        v = desc_v.load([row + start_n, 0])
        p_a, m_a, l_a, acc_a = _softmax_step(s_a, m_a, l_a, acc_a, rows_a, start_n, offs_n, qk_scale,
                                             MASKED, LAZY, LAZY_BOUND)
        acc_a = tl.dot(p_a.to(v.dtype), v, acc_a)
        if SPLIT:
            p_b, m_b, l_b, acc_b = _softmax_step(s_b, m_b, l_b, acc_b, rows_b, start_n, offs_n, qk_scale,
                                                 MASKED, LAZY, LAZY_BOUND)
            acc_b = tl.dot(p_b.to(v.dtype), v, acc_b)
    return acc_a, m_a, l_a, acc_b, m_b, l_b


@triton.jit
def _finish(acc, m_i, l_i, desc_o, lse_ptr, row, start, rows):
    desc_o.store([row + start, 0], (acc / l_i[:, None]).to(desc_o.dtype))
    tl.store(lse_ptr + row + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453)


@triton.jit
def split_forward_kernel(desc_q, desc_k, desc_v, desc_o, lse_ptr, N, qk_scale, CAUSAL: tl.constexpr,
                         SPLIT: tl.constexpr, LAZY: tl.constexpr, LAZY_BOUND: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head), as one set or (SPLIT) two halves."""
    HALF: tl.constexpr = BLOCK_M // 2 if SPLIT else BLOCK_M
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m              # the longest rows first
    row = tl.program_id(1) * N
    start_m = pid_m * BLOCK_M
    offs_n = tl.arange(0, BLOCK_N)
    rows_a = start_m + tl.arange(0, HALF)
    rows_b = rows_a + HALF
    q_a = desc_q.load([row + start_m, 0])
    q_b = q_a
    if SPLIT:
        q_b = desc_q.load([row + start_m + HALF, 0])
    m_a = tl.full([HALF], float("-inf"), tl.float32)
    l_a = tl.zeros([HALF], tl.float32)
    acc_a = tl.zeros([HALF, D], tl.float32)
    m_b, l_b, acc_b = m_a, l_a, acc_a
    hi = start_m if CAUSAL else N
    acc_a, m_a, l_a, acc_b, m_b, l_b = _keys(acc_a, m_a, l_a, acc_b, m_b, l_b, q_a, q_b, desc_k, desc_v, row,
                                             0, hi, rows_a, rows_b, offs_n, qk_scale, SPLIT, False, LAZY,
                                             LAZY_BOUND, BLOCK_N)
    if CAUSAL:                                              # the diagonal blocks, masked
        acc_a, m_a, l_a, acc_b, m_b, l_b = _keys(acc_a, m_a, l_a, acc_b, m_b, l_b, q_a, q_b, desc_k, desc_v,
                                                 row, start_m, start_m + BLOCK_M, rows_a, rows_b, offs_n,
                                                 qk_scale, SPLIT, True, LAZY, LAZY_BOUND, BLOCK_N)
    _finish(acc_a, m_a, l_a, desc_o, lse_ptr, row, start_m, rows_a)
    if SPLIT:
        _finish(acc_b, m_b, l_b, desc_o, lse_ptr, row, start_m + HALF, rows_b)


def forward(q, k, v, causal: bool, tile: tuple, split: bool, lazy: bool):
    """``(o, lse)`` of dense attention over (B, H, N, D) tensors, N a multiple of both block sizes;
    ``tile`` is (BLOCK_M, BLOCK_N, warps, stages)."""
    bm, bn, warps, stages = tile
    B, H, N, D = q.shape
    if N % bm or N % bn or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v: expected one (B, H, N, D) shape with N a multiple of {bm} and {bn}, "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    q, k, v = (x.contiguous() for x in (q, k, v))
    o = torch.empty_like(q)
    lse = torch.empty(B, H, N, device=q.device, dtype=torch.float32)
    half = bm // 2 if split else bm
    dq, do_ = (TensorDescriptor.from_tensor(x.view(B * H * N, D), [half, D]) for x in (q, o))
    dk, dv = (TensorDescriptor.from_tensor(x.view(B * H * N, D), [bn, D]) for x in (k, v))
    split_forward_kernel[(N // bm, B * H)](dq, dk, dv, do_, lse, N, D ** -0.5 * LOG2E, CAUSAL=causal,
                                           SPLIT=split, LAZY=lazy, LAZY_BOUND=LAZY_BOUND, BLOCK_M=bm,
                                           BLOCK_N=bn, D=D, num_warps=warps, num_stages=stages)
    return o, lse


VARIANTS = {"plain": (False, False), "split": (True, False), "lazy": (False, True), "split+lazy": (True, True)}
TILES = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (256, 128, 8, 2), (256, 64, 8, 3)]


def summary(rows: list[dict]) -> list[str]:
    """A markdown table: per case, cuDNN's TFLOP/s and each variant's best tile and its TFLOP/s."""
    lines = ["| case | cuDNN | " + " | ".join(VARIANTS) + " |", "| --- " * (len(VARIANTS) + 2) + "|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        best = {}
        for r in rows:
            if r["case"] == case and "tflops" in r and r["tflops"] > best.get(r["provider"], (0, ""))[0]:
                best[r["provider"]] = (r["tflops"], r["tile"])
        cells = [f"{best[p][0]:.0f} ({best[p][1]})" if p in best else "-" for p in VARIANTS]
        lines.append(f"| {case} | {best['cudnn'][0]:.0f} | " + " | ".join(cells) + " |")
    return lines


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "split-q.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from warp_specialized_dense import dense_cases  # the same four cases, inputs and reference
    rows = []
    for D, causal, (q, k, v), flops, ref in dense_cases():
        case = f"B4 H16 N4096 D{D}" + (" causal" if causal else "")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal),
                          rep=300, return_mode="median")
        rows.append(dict(case=case, provider="cudnn", tile=None, ms=ms, tflops=round(flops / ms / 1e9, 1)))
        for name, (split, lazy) in VARIANTS.items():
            for tile in TILES:
                label = "{}x{} w{} s{}".format(*tile)
                try:
                    o, _ = forward(q, k, v, causal, tile, split, lazy)
                    err = ((o.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        raise AssertionError(f"relative error {err:.1e} against float32 SDPA")
                    ms = do_bench(lambda: forward(q, k, v, causal, tile, split, lazy), rep=100, return_mode="median")
                    rows.append(dict(case=case, provider=name, tile=label, ms=ms, tflops=round(flops / ms / 1e9, 1)))
                    print(f"{case} {name} {label}: {flops / ms / 1e9:.0f} TFLOP/s (err {err:.1e})", flush=True)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit is a row too
                    rows.append(dict(case=case, provider=name, tile=label, error=repr(e)[:300]))
                    print(f"{case} {name} {label}: FAILED {repr(e)[:160]}", flush=True)
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           lazy_bound=LAZY_BOUND, rows=rows), f, indent=1)
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
