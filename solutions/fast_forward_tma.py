"""The forward of stages 5-7 with Hopper's tensor memory accelerator: the fast variant, beside the readable one.

Which is which
--------------
``solutions/stage7_sliding_window.py`` is the model answer: every tile is loaded with
``tl.load`` from a pointer grid (base + rows * stride + columns), with a mask on every edge, and
that is the code a learner writes.  This file computes the same attention (causal aligned
bottom-right, GQA/MQA, sliding windows; o and lse) and differs only where speed and the lesson
pull apart:

* **TMA descriptors.**  The host describes each tensor once (``TensorDescriptor``: base, shape,
  strides, tile shape) and the kernel asks for tiles by coordinate,
  ``desc_k.load([kv_head, start_n, 0])``.  On a Hopper GPU the copy engine (TMA) moves the whole
  tile into shared memory: no address arithmetic in the kernel's threads, no per-element masks.
  Rows past the end of a tensor come back as zeros, so only the masked blocks (the diagonal, the
  window's edge, the last partial block) have to hide keys past N_k.
* **The scale folded into the exponent.**  ``exp2(s * qk_scale - m)`` is one fused multiply-add
  per score instead of a multiply then a subtract.
* **Fewer choices.**  Head dims must be powers of two from 16 to 256 (a TMA tile has no padding
  columns) and the tensors are made contiguous first; stage 7's kernel takes any head dim and
  any strides.

``python -m grader bench stage5`` (and stage6, stage7) times this file as ``solution-tma`` beside
the stage's solution; README's speed table has the H100 numbers.  Triton's CPU interpreter runs
it too, so its tests need no GPU.

Not here: sink tokens, learned sinks and the backward; stages 8 and 9 have them.
"""

from __future__ import annotations

import math

import torch

from kernels import runtime, tuning, validate

import triton  # noqa: E402  (after kernels.runtime: it decides TRITON_INTERPRET)
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

LOG2E = 1.4426950408889634   # log2(e): exp(x) == exp2(x * LOG2E)
HEAD_DIMS = (16, 256)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim; the first entry is used untimed on short
# sequences and must fit float32 tiles in shared memory.  128 x 128 tiles pay here, where the
# pointer-grid kernel's address registers made them lose; short tiles serve short windows.
TMA_TILES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    128: [(128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2)],
}
INTERPRETER_TILE = (32, 32, 4, 1)


def _tile_shapes(nargs: dict) -> None:
    """Give the descriptors the tile shape of the configuration about to run (the autotuner's pre-hook)."""
    bm, bn, d = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["HEAD_DIM_PAD"]
    nargs["desc_q"].block_shape = nargs["desc_o"].block_shape = [1, bm, d]
    nargs["desc_k"].block_shape = nargs["desc_v"].block_shape = [1, bn, d]


@triton.jit
def _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, kv_bh, lo, hi, offs_m, offs_n, N_K, shift, WINDOW, qk_scale,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Fold key blocks lo, lo + BLOCK_N, ... (below hi) into the query tile; m_i is in scaled base-2 units."""
    for start_n in range(lo, hi, BLOCK_N):
        k = desc_k.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)     # zeros past N_K
        s = tl.dot(q, tl.trans(k))                                              # raw scores
        if MASKED:
            cols = start_n + offs_n
            visible = cols[None, :] < N_K
            if CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + shift)
            if HAS_WINDOW:
                visible = visible & (cols[None, :] > offs_m[:, None] + shift - WINDOW)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)                   # qk_scale > 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                   # rows with nothing seen yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s * qk_scale - m_safe[:, None])                             # one FMA per score
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = desc_v.load([kv_bh, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@tuning.autotune(TMA_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW", "GROUP"],
                 pre_hook=_tile_shapes)
@triton.jit
def _tma_forward_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE,
    GROUP, N_Q, N_K, WINDOW, qk_scale,           # GROUP = Hq // Hkv query heads share a K/V head
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    pid_m = tl.program_id(0)                     # which block of queries
    pid_bh = tl.program_id(1)                    # which (batch, query head): a row of the (B*Hq, N, D) view
    kv_bh = pid_bh // GROUP                      # its K/V head in the (B*Hkv, N, D) view: (b*H + h) // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)

    q = desc_q.load([pid_bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM_PAD)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # The same three ranges as stage 7: the window's masked leading edge [lo, full_lo), whole
    # blocks [full_lo, full_hi), the diagonal band (or the last partial block) [full_hi, hi).
    shift = N_K - N_Q
    if CAUSAL:
        full_hi = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), N_K)
    else:
        full_hi = N_K // BLOCK_N * BLOCK_N
        hi = N_K
    full_lo = 0
    if HAS_WINDOW:                               # no empty loop (and its set-up) without a window
        lo = tl.maximum(start_m + shift - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(start_m + BLOCK_M + shift - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        full_lo = tl.minimum(full_lo, full_hi)
        acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, kv_bh, lo, full_lo, offs_m, offs_n, N_K,
                                    shift, WINDOW, qk_scale, True, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM_PAD)
    acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, kv_bh, full_lo, full_hi, offs_m, offs_n, N_K,
                                shift, WINDOW, qk_scale, False, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM_PAD)
    acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, kv_bh, full_hi, hi, offs_m, offs_n, N_K,
                                shift, WINDOW, qk_scale, True, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM_PAD)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)      # a row that saw no key: o = 0, lse = -inf
    o = acc / l_safe[:, None]
    desc_o.store([pid_bh, start_m, 0], o.to(desc_o.dtype).reshape(1, BLOCK_M, HEAD_DIM_PAD))   # rows past N_Q dropped
    tl.store(LSE + pid_bh * N_Q + offs_m, (m_i + tl.log2(l_safe)) * 0.6931471805599453, mask=offs_m < N_Q)


def _tma_ready(x: torch.Tensor) -> torch.Tensor:
    """Contiguous, with a 16-byte-aligned start: what a TMA descriptor needs (a copy otherwise)."""
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def flash_attention(q, k, v, *, causal: bool = False, window: int | None = None, sm_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None):
    """Stage 7's forward through TMA descriptors; returns ``(o, lse)``.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq % Hkv == 0 and D a power of two from 16 to
    256; any Nq, Nk >= 1.  float16/float32 (and bfloat16 on a GPU).  ``causal``, ``window`` and
    ``sm_scale`` as in stage 7; ``block_m``/``block_n`` fix the tile.
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, window=window, sm_scale=sm_scale,
                                                      head_dims=HEAD_DIMS)
    if D & (D - 1):
        raise ValueError(f"head_dim is {D}: the TMA variant takes head dims that are powers of two (a TMA tile has "
                         f"no padding columns); stage 7's flash_attention pads the others")
    runtime.check_dtype(q.dtype)
    block_m = validate.block_size(block_m, "block_m") if block_m is not None else None
    block_n = validate.block_size(block_n, "block_n") if block_n is not None else None
    kernel, tile = tuning.plan(_tma_forward_kernel, TMA_TILES, D, Nq, Nk, interpreter_tile=INTERPRETER_TILE,
                               block_m=block_m, block_n=block_n)
    bm, bn = (tile["BLOCK_M"], tile["BLOCK_N"]) if tile else tuning.first_entry(TMA_TILES, D, INTERPRETER_TILE)[:2]
    q, k, v = (_tma_ready(x) for x in (q, k, v))
    o = torch.empty_like(q)                                                  # (B, Hq, Nq, D), contiguous
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)      # (B, Hq, Nq)
    # 3-D views: one row of tiles per (batch, head), so a tile never reads into the next head.
    desc_q, desc_o = (TensorDescriptor.from_tensor(x.view(B * Hq, Nq, D), [1, bm, D]) for x in (q, o))
    desc_k, desc_v = (TensorDescriptor.from_tensor(x.view(B * Hkv, Nk, D), [1, bn, D]) for x in (k, v))
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)

    def grid(meta):
        return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq
    kernel[grid](desc_q, desc_k, desc_v, desc_o, lse, Hq // Hkv, Nq, Nk,
                 window if window is not None else 0, scale * LOG2E,
                 CAUSAL=causal, HAS_WINDOW=window is not None, HEAD_DIM_PAD=D, **tile)
    return o, lse
