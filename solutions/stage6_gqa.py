"""Stage 6: grouped-query and multi-query attention: K/V heads shared, never copied.

What you will learn
-------------------
* Grouped-query attention (GQA): ``Hq`` query heads share ``Hkv`` key/value heads, in groups
  of ``Hq // Hkv`` consecutive query heads.  Multi-query attention (MQA) is ``Hkv = 1``;
  ordinary multi-head attention is ``Hkv = Hq``.  With Hq = 8 and Hkv = 2::

      query head   0  1  2  3  4  5  6  7
      K/V head     0  0  0  0  1  1  1  1        K/V head = h // (Hq // Hkv)

* Why the kernel reads the shared head in place.  ``k.repeat_interleave(Hq // Hkv, dim=1)``
  would give an MHA kernel what it wants, at the price of a copy of K and V ``Hq // Hkv``
  times larger than the cache GQA exists to shrink.  One integer division in the kernel's
  pointer arithmetic does the same for free, and the programs of one group read the same
  K/V tiles, which the GPU's L2 cache can share between them.

Everything of stage 5 stays: causal masking aligned bottom-right, whole key blocks below the
diagonal run without a mask, the diagonal band with one, blocks above it are never loaded, and
the online softmax stays NaN-safe for rows that see no key (o = 0, lse = -inf).

``flash_attention(..., return_visits=True)`` also returns how many key blocks each program
loaded, counted by the kernel's own loop: the tests use it to see that blocks are skipped.

Conventions (kernels/reference.py): q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq % Hkv == 0;
returns o in q's dtype and lse (B, Hq, Nq) float32, natural log; rows that see no key give
o = 0, lse = -inf.
"""

from __future__ import annotations

import math

import torch

from kernels import runtime, tuning, validate

import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

from solutions.stage3_flash_forward import LOG2E, LN2, HEAD_DIMS  # given

# Stage 5's helpers, unchanged: the visibility rule, one key block's scores, the NaN-safe update,
# the loop over a range of key blocks, the ranges themselves, the final store, and a program's
# work from pointers to its heads (stage 3's set-up, the ranges, the loops, the store).
from solutions.stage5_causal import (  # given
    _visible, _scores, _softmax_update, _attend_blocks, _key_blocks, _finish, _query_rows, _load_query_tile,
    _empty_state, _store_tile, _attend_tile,
)


@tuning.autotune(tuning.FORWARD_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "GROUP"])
@triton.jit
def _flash_forward_kernel(
    Q, K, V, O, LSE, VISITS,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,    # Q's and K's strides
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,    # V's and O's
    H, GROUP, N_Q, N_K, HEAD_DIM,   # H query heads; GROUP = Hq // Hkv of them share a K/V head
    qk_scale,                       # sm_scale * log2(e): scores come out in base 2
    CAUSAL: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)        # which block of queries, which (batch, query head)
    b, h = pid_bh // H, pid_bh % H
    # TODO(6a): the K/V head this query head reads: GROUP consecutive query heads share one,
    # so query head h reads K/V head h // GROUP (with MQA, GROUP = H and every head reads 0).
    # Use it for K and V below instead of h; never copy K or V.
    # BEGIN SOLUTION stub=pass
    h_kv = h // GROUP
    # END SOLUTION
    _attend_tile(LSE, VISITS, pid_m, pid_bh, N_Q, N_K, HEAD_DIM, qk_scale,
                 Q + b * stride_qb + h * stride_qh, O + b * stride_ob + h * stride_oh,      # this head's Q and O
                 K + b * stride_kb + h_kv * stride_kh, V + b * stride_vb + h_kv * stride_vh,  # its K/V head's
                 stride_qn, stride_qd, stride_on, stride_od, stride_kn, stride_kd, stride_vn, stride_vd,
                 CAUSAL=CAUSAL, COUNT_VISITS=COUNT_VISITS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM_PAD=HEAD_DIM_PAD)


from solutions.stage5_causal import _launch_setup  # given


def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, return_visits: bool = False):
    """FlashAttention forward, optionally causal, with GQA/MQA; returns ``(o, lse)``.

    Without ``block_m``/``block_n`` the tile comes from kernels/tuning.py (timed by the
    autotuner on a GPU for long sequences).

    Args:
        q: (B, Hq, Nq, D) queries, any strides; float16 or float32 (and bfloat16 on a GPU);
            16 <= D <= 256, any Nq >= 1.
        k, v: (B, Hkv, Nk, D) keys and values, any strides: q's batch, head dim, dtype and device;
            Hq % Hkv == 0, query head h reads K/V head h // (Hq // Hkv) (Hkv = 1: MQA); Nk >= 1.
        causal: query i sees key j iff j <= i + (Nk - Nq), the diagonal aligned bottom-right; a row
            that sees no key (Nq > Nk) gets o = 0 and lse = -inf.
        sm_scale: the scores' scale, a positive number; None means ``1 / sqrt(D)``.
        block_m: query rows per program, a power of two >= 16; None: the planned tile's.
        block_n: keys per loop step, a power of two >= 16; None: the planned tile's.
        return_visits: also return how many key blocks each program loaded (the tile is then
            never autotuned).

    Returns:
        ``(o, lse)``, or ``(o, lse, visits)`` with ``return_visits``: o (B, Hq, Nq, D) in q's dtype
        (and q's strides); lse (B, Hq, Nq) float32, the log-sum-exp of each row's scaled scores in
        natural log (base e); visits (B, Hq, cdiv(Nq, BLOCK_M)) int32, BLOCK_M the tile's rows.
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, sm_scale=sm_scale, head_dims=HEAD_DIMS)
    # (attention_inputs has already refused Hq % Hkv != 0, with a ValueError that says why)
    kernel, config, o, lse, visits, qk_scale = _launch_setup(_flash_forward_kernel, q, Nk, sm_scale=sm_scale,
                                                             block_m=block_m, block_n=block_n,
                                                             return_visits=return_visits)
    def grid(meta):                 # one program per (query block, batch x query head); meta holds the tile
        return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq

    kernel[grid](q, k, v, o, lse, visits, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                 Hq, Hq // Hkv, Nq, Nk, D, qk_scale,
                 CAUSAL=causal, COUNT_VISITS=return_visits, **config)
    return (o, lse, visits) if return_visits else (o, lse)


# BEGIN SOLUTION stub=
if __name__ == "__main__":
    from kernels import reference
    for hq, hkv, nq, nk in ((4, 4, 128, 128), (8, 2, 128, 128), (6, 3, 100, 150), (8, 1, 150, 100)):
        q = runtime.randn(1, hq, nq, 64, dtype=torch.float16)
        k, v = (runtime.randn(1, hkv, nk, 64, dtype=torch.float16) for _ in range(2))
        o, lse = flash_attention(q, k, v, causal=True)
        o_ref, lse_ref = reference.attention(q, k, v, causal=True)
        print(f"Hq={hq} Hkv={hkv} (groups of {hq // hkv}) Nq={nq} Nk={nk}: "
              f"max |o - ref| = {(o.double() - o_ref).abs().max().item():.2e}")
    if runtime.ON_GPU:
        from triton.testing import do_bench
        q = torch.randn(4, 32, 4096, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(4, 8, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * 4 * 32 * 4096 * 4096 * 128 / 2                  # causal: half the pairs
        ms = do_bench(lambda: flash_attention(q, k, v, causal=True), return_mode="median")
        ms_sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), return_mode="median")
        print(f"causal GQA B4 Hq32 Hkv8 N4096 D128 bf16: {flops / ms * 1e-9:.0f} TFLOP/s, "
              f"SDPA {flops / ms_sdpa * 1e-9:.0f}, ratio {ms_sdpa / ms:.2f}")
# END SOLUTION
