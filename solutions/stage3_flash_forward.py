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
    # BEGIN SOLUTION
    padded = triton.next_power_of_2(head_dim)
    return (padded - head_dim) / padded
    # END SOLUTION


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
    # BEGIN SOLUTION stub=pass
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)    # (BLOCK_M, HEAD_DIM_PAD)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)                # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                              # running sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)                # unnormalised output
    # END SOLUTION

    for start_n in range(0, N_K, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N_K
        # TODO(3b): load the K and V tiles of this block (masked like Q), compute the scores
        # s = (q @ k^T) * qk_scale, set columns past N_K to -inf, and do the online-softmax
        # update in base 2: m_new, alpha = exp2(m_i - m_new), p = exp2(s - m_new), then l_i
        # and acc (acc += p @ v, with p cast to v's dtype so tl.dot runs on tensor cores).
        # BEGIN SOLUTION stub=pass
        k = tl.load(k_base + cols[:, None] * stride_kn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + cols[:, None] * stride_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k)) * qk_scale                                # (BLOCK_M, BLOCK_N)
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
        # END SOLUTION

    # TODO(3c): normalise acc by l_i and store it in O's dtype (only real rows and real head-dim
    # columns), and store lse = (m_i + log2(l_i)) * LN2 for the real rows: natural log, like the
    # reference.  LN2 is defined at the top as a tl.constexpr: compiled for a GPU, a kernel may
    # only read module-level globals that are tl.constexpr (LOG2E, a plain float, works in the
    # interpreter only, and is for the wrapper).
    # BEGIN SOLUTION stub=pass
    o = acc / l_i[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(LSE + pid_bh * N_Q + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)
    # END SOLUTION


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


# BEGIN SOLUTION stub=
if __name__ == "__main__":
    from kernels import reference
    for d in (64, 72):
        q, k, v = (runtime.randn(2, 4, n, d, dtype=torch.float16) for n in (300, 257, 257))
        o, lse = flash_attention(q, k, v)
        o_ref, lse_ref = reference.attention(q, k, v)
        print(f"D={d}: max |o - ref| = {(o.double() - o_ref).abs().max().item():.2e}, "
              f"padding waste {padding_waste(d):.1%}")
    if runtime.ON_GPU:
        from triton.testing import do_bench
        q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = do_bench(lambda: flash_attention(q, k, v), return_mode="median")
        ms_sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), return_mode="median")
        flops = 4 * 4 * 16 * 4096 * 4096 * 128
        print(f"B4 H16 N4096 D128 bf16: {flops / ms * 1e-9:.0f} TFLOP/s, SDPA {flops / ms_sdpa * 1e-9:.0f}, "
              f"ratio {ms_sdpa / ms:.2f}")
# END SOLUTION
