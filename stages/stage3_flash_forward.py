"""Stage 3: the FlashAttention forward pass in Triton.

What you will learn
-------------------
* How stage 1's tile loop becomes one Triton program per (query block, batch x head): the
  program loads its block of queries once, streams every key/value block through SRAM, and
  keeps the running max ``m``, sum ``l`` and output ``acc`` in registers.
* ``exp2`` instead of ``exp``: fold ``log2(e)`` into the softmax scale once, and every
  exponential in the loop becomes the cheaper hardware ``exp2``.
* Strides: the kernel never assumes a contiguous layout, so (B, N, H, D) memory viewed as
  (B, H, N, D) works without a copy.
* Masks at the edges: the last query block and the last key block may be partial.
* Head dims that are not a power of two: ``tl.arange`` needs a power of two, so a head dim of
  72 is computed as 128 with the extra 56 columns masked to zero; ``padding_waste`` says how
  much of the matrix work that throws away (stage 4 removes it in CUDA).

Conventions (kernels/reference.py): q (B, H, Nq, D), k and v (B, H, Nk, D); returns o in q's
dtype and lse (B, H, Nq) float32, natural log.
"""

from __future__ import annotations

import math

import torch

from kernels import runtime, tuning, validate

import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

LOG2E = 1.4426950408889634   # log2(e): exp(x) == exp2(x * LOG2E); the wrapper folds it into the scale
LN2 = tl.constexpr(0.6931471805599453)   # ln(2): log(x) == log2(x) * LN2; a constexpr, so kernels may read it
HEAD_DIMS = (16, 256)


def padding_waste(head_dim: int) -> float:
    """Fraction of the QK^T and PV work spent on padding when ``head_dim`` is rounded up to a power of two.

    >>> padding_waste(72)   # computed as 128: 56 of every 128 columns are zeros
    0.4375
    """
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    # TODO(3d): the kernel computes head_dim as triton.next_power_of_2(head_dim) columns; return
    # the fraction of those columns that are padding (0.0 when head_dim is a power of two).
    raise NotImplementedError("stage3_flash_forward.py: TODO(3d) is not written yet")


@tuning.autotune(tuning.FORWARD_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD"])
@triton.jit
def _flash_forward_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    H, N_Q, N_K, HEAD_DIM,
    qk_scale,                       # sm_scale * log2(e): scores come out in base 2
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    pid_m = tl.program_id(0)        # which block of queries
    pid_bh = tl.program_id(1)       # which (batch, head)
    b = pid_bh // H
    h = pid_bh % H

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)          # query rows of this program
    offs_n = tl.arange(0, BLOCK_N)                            # key columns within a block
    offs_d = tl.arange(0, HEAD_DIM_PAD)                       # head-dim columns (padded)
    row_ok = offs_m < N_Q
    d_ok = offs_d < HEAD_DIM                                  # False on the padding columns

    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd
    k_base = K + b * stride_kb + h * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + b * stride_vb + h * stride_vh + offs_d[None, :] * stride_vd

    # TODO(3a): load the Q tile once (zeros outside the sequence and in the padding columns),
    # and start the running statistics: m = -inf, l = 0, acc = 0 (float32, BLOCK_M x HEAD_DIM_PAD).
    pass

    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N_K
        # TODO(3b): load the K and V tiles of this block (masked like Q), compute the scores
        # s = (q @ k^T) * qk_scale, set columns past N_K to -inf, and do the online-softmax
        # update in base 2: m_new, alpha = exp2(m_i - m_new), p = exp2(s - m_new), then l_i
        # and acc (acc += p @ v, with p cast to v's dtype so tl.dot runs on tensor cores).
        pass

    # TODO(3c): normalise acc by l_i and store it in O's dtype (only real rows and real head-dim
    # columns), and store lse = (m_i + log2(l_i)) * LN2 for the real rows: natural log, like the
    # reference.  LN2 is defined at the top as a tl.constexpr: compiled for a GPU, a kernel may
    # only read module-level globals that are tl.constexpr (LOG2E, a plain float, works in the
    # interpreter only, and is for the wrapper).
    pass


def flash_attention(q, k, v, *, sm_scale: float | None = None, block_m: int | None = None,
                    block_n: int | None = None):
    """FlashAttention forward; returns ``(o, lse)``.

    No mask: every query sees every key.  Without ``block_m``/``block_n`` the tile comes from
    kernels/tuning.py (timed by the autotuner on a GPU for long sequences).

    Args:
        q: (B, H, Nq, D) queries, any strides; float16 or float32 (and bfloat16 on a GPU);
            16 <= D <= 256, any Nq >= 1.
        k, v: (B, H, Nk, D) keys and values, any strides: q's batch, heads, head dim, dtype and
            device; Nk >= 1.
        sm_scale: the scores' scale, a positive number; None means ``1 / sqrt(D)``.
        block_m: query rows per program, a power of two >= 16; None: the planned tile's.
        block_n: keys per loop step, a power of two >= 16; None: the planned tile's.

    Returns:
        ``(o, lse)``: o (B, H, Nq, D) in q's dtype (and q's strides); lse (B, H, Nq) float32,
        the log-sum-exp of each row's scaled scores in natural log (base e).
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, sm_scale=sm_scale, head_dims=HEAD_DIMS)
    runtime.check_dtype(q.dtype)
    if Hq != Hkv:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}; stage 3 expects the same number of heads")
    head_dim_pad = triton.next_power_of_2(D)
    block_m = validate.block_size(block_m, "block_m") if block_m is not None else None
    block_n = validate.block_size(block_n, "block_n") if block_n is not None else None
    # The tile: timed by the autotuner on a GPU for long sequences, else fixed (kernels/tuning.py).
    kernel, tile = tuning.plan(_flash_forward_kernel, tuning.FORWARD_TILES, head_dim_pad, Nq, Nk,
                               interpreter_tile=tuning.FORWARD_INTERPRETER_TILE, block_m=block_m,
                               block_n=block_n)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)

    o = torch.empty_like(q)                                                  # (B, H, Nq, D)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)      # (B, H, Nq)
    def grid(meta):                 # one program per (query block, batch x head); meta holds the tile
        return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq

    kernel[grid](
        q, k, v, o, lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        Hq, Nq, Nk, D,
        scale * LOG2E,
        HEAD_DIM_PAD=head_dim_pad, **tile,
    )
    return o, lse


