"""Stage 7: sliding-window attention, whose work grows with the window, not the sequence.

What you will learn
-------------------
* A sliding window of ``W`` keys (Mistral, Gemma, gpt-oss): with ``causal=True`` and
  ``window=W``, query ``i`` sees key ``j`` iff ``i' - W < j <= i'``, where ``i' = i + (Nk - Nq)``
  is its diagonal: exactly ``W`` keys, its own included (fewer near the start)::

      W = 3, Nq = Nk = 6
            k0 k1 k2 k3 k4 k5
        q0   #  .  .  .  .  .
        q1   #  #  .  .  .  .
        q2   #  #  #  .  .  .
        q3   .  #  #  #  .  .
        q4   .  .  #  #  #  .
        q5   .  .  .  #  #  #

* Work in O(N * W), not O(N^2).  Masking the keys outside the window would give the right
  answer and save nothing.  Instead the loop of a query block *starts* at the first key block
  inside its first row's window, so every program loads about (W + block_m) / block_n key
  blocks whatever the sequence length, and doubling N at a fixed W doubles the work.
* Three ranges of key blocks per query block: the window's leading edge (masked: its first
  blocks are only partly inside the window of some rows), the blocks inside every row's
  window (no mask at all), and the diagonal band (masked, as in stage 5)::

      Nq = Nk = 512, block_m = block_n = 64, W = 160    E leading edge  F whole  P band  . skipped
                         key block  0  1  2  3  4  5  6  7
          query block 0             P  .  .  .  .  .  .  .
          query block 1             F  P  .  .  .  .  .  .
          query block 2             E  F  P  .  .  .  .  .
          query block 3             E  E  F  P  .  .  .  .
          query block 4             .  E  E  F  P  .  .  .
          query block 5             .  .  E  E  F  P  .  .
          query block 6             .  .  .  E  E  F  P  .
          query block 7             .  .  .  .  E  E  F  P

  With a small window (W < block_m) a block has no whole blocks at all: the leading edge and
  the band meet, and rows of one query block can have windows that share no key.  A row can
  then meet its first tile with every key hidden: the NaN-safe update of stage 5 earns its keep
  even when Nq = Nk.

Everything of stage 6 stays: GQA/MQA (query head h reads K/V head h // (Hq // Hkv), never a
copy), causal masking aligned bottom-right with the blocks above the diagonal skipped, and
rows that see no key giving o = 0 and lse = -inf.

``flash_attention(..., return_visits=True)`` also returns how many key blocks each program
loaded, counted by the kernel's own loop: the tests use it to see that blocks are skipped.

Conventions (kernels/reference.py): q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq % Hkv == 0;
returns o in q's dtype and lse (B, Hq, Nq) float32, natural log; rows that see no key give
o = 0, lse = -inf; ``window`` needs ``causal=True``.
"""

from __future__ import annotations

import math

import torch

from kernels import runtime, tuning, validate

import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

from solutions.stage3_flash_forward import LOG2E, LN2, HEAD_DIMS  # given

# Stage 5's visibility rule, unchanged; the window adds a rule of its own.
from solutions.stage5_causal import _visible  # given


@triton.jit
def _in_window(rows, cols, shift, WINDOW):
    """The sliding window, (rows, cols) booleans: key j is inside row i's window iff
    j > i + shift - WINDOW, so WINDOW keys up to the row's diagonal i + shift, its own included."""
    # TODO(7a): the keys that have not left the row's window: j > i + shift - WINDOW.
    # BEGIN SOLUTION stub=pass
    in_window = cols[None, :] > rows[:, None] + shift - WINDOW
    return in_window
    # END SOLUTION


# Stage 5's scores of one key block and NaN-safe update, unchanged.
from solutions.stage5_causal import _scores, _softmax_update  # given


@triton.jit
def _attend_blocks(acc, m_i, l_i, visits, lo, hi, shift, WINDOW,
                   q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stage 5's loop over the key blocks lo, lo + BLOCK_N, ... (below hi) of one query tile.

    MASKED=True applies stage 5's rule, _visible, and with HAS_WINDOW also _in_window.
    """
    offs_n = tl.arange(0, BLOCK_N)                            # key columns within a block
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        s, v = _scores(q, k_base, v_base, cols, stride_kn, stride_vn, N_K, d_ok, qk_scale)
        if MASKED:
            visible = _visible(offs_m, cols, N_K, shift, CAUSAL=CAUSAL)
            if HAS_WINDOW:
                visible = visible & _in_window(offs_m, cols, shift, WINDOW)
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v)
        visits += 1                                   # one more key block loaded (the tests count them)
    return acc, m_i, l_i, visits


# Stage 5's ranges of key blocks, unchanged; the window's come after them.
from solutions.stage5_causal import _key_blocks  # given


@triton.jit
def _window_blocks(start_m, shift, WINDOW, full_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks behind the window that a query block skips: it starts at lo, and the blocks
    [full_lo, full_hi) are inside every row's window; [lo, full_lo) is the window's masked edge."""
    lo, full_lo = 0, 0                                        # every key block, the edge masked
    # TODO(7b): skip the key blocks that are behind every row's window.
    #   lo: the first row, start_m, sees keys >= start_m + shift - WINDOW + 1: round that DOWN
    #     to a multiple of BLOCK_N (never below 0).  The loop starts there, not at block 0.
    #   full_lo: the last row sees keys >= start_m + BLOCK_M + shift - WINDOW: blocks starting
    #     there or later (round UP to a multiple of BLOCK_N, never below 0) are inside every
    #     row's window, so [full_lo, full_hi) needs no mask; [lo, full_lo) is the masked edge.
    #   The three ranges must stay in order, lo <= full_lo <= full_hi <= hi, or a block is
    #   visited twice.  When the window is shorter than the query block, no block is inside
    #   every row's window and full_lo comes out past full_hi: cap it at full_hi.
    # BEGIN SOLUTION stub=pass
    lo = tl.maximum(start_m + shift - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    full_lo = (tl.maximum(start_m + BLOCK_M + shift - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(full_lo, full_hi)
    # END SOLUTION
    return lo, full_lo


# Stage 5's store and set-up of a program, unchanged.
from solutions.stage5_causal import (  # given
    _finish, _query_rows, _load_query_tile, _empty_state, _store_tile,
)


@triton.jit
def _attend_tile(LSE, VISITS, pid_m, pid_bh, N_Q, N_K, HEAD_DIM, WINDOW, qk_scale, q_head, o_head, k_head, v_head,
                 stride_qn, stride_qd, stride_on, stride_od, stride_kn, stride_kd, stride_vn, stride_vd,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, COUNT_VISITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Stage 5's program with a window: three ranges of key blocks instead of two, the window's
    leading edge (masked), whole blocks, and the diagonal band (masked)."""
    start_m = pid_m * BLOCK_M
    shift = N_K - N_Q               # query row i sees key j iff j <= i + shift (bottom-right alignment)
    full_hi, hi = _key_blocks(start_m, N_K, shift, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    lo, full_lo = 0, 0
    if HAS_WINDOW:
        lo, full_lo = _window_blocks(start_m, shift, WINDOW, full_hi, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    offs_m, row_ok, d_ok = _query_rows(start_m, N_Q, HEAD_DIM, BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD)
    q, k_base, v_base = _load_query_tile(q_head, k_head, v_head, stride_qn, stride_qd, stride_kd, stride_vd,
                                         offs_m, row_ok, d_ok, HEAD_DIM_PAD=HEAD_DIM_PAD)
    acc, m_i, l_i = _empty_state(BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD)
    visits = 0                                                               # key blocks loaded
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, lo, full_lo, shift, WINDOW,   # the window's edge
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, full_lo, full_hi, shift, WINDOW,   # whole blocks
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=False, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, full_hi, hi, shift, WINDOW,   # the diagonal band
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    _store_tile(acc, m_i, l_i, visits, o_head, stride_on, stride_od, LSE, VISITS, pid_m, pid_bh, N_Q, offs_m, row_ok,
                d_ok, COUNT_VISITS=COUNT_VISITS, HEAD_DIM_PAD=HEAD_DIM_PAD)


@tuning.autotune(tuning.FORWARD_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW", "GROUP"])
@triton.jit
def _flash_forward_kernel(
    Q, K, V, O, LSE, VISITS,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,    # Q's and K's strides
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,    # V's and O's
    H, GROUP, N_Q, N_K, HEAD_DIM, WINDOW,   # GROUP = Hq // Hkv query heads share a K/V head (stage 6);
                                            # WINDOW keys per sliding window (used only with HAS_WINDOW)
    qk_scale,                       # sm_scale * log2(e): scores come out in base 2
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)        # which block of queries, which (batch, query head)
    b, h = pid_bh // H, pid_bh % H
    h_kv = h // GROUP               # the K/V head this query head shares (stage 6)
    _attend_tile(LSE, VISITS, pid_m, pid_bh, N_Q, N_K, HEAD_DIM, WINDOW, qk_scale,
                 Q + b * stride_qb + h * stride_qh, O + b * stride_ob + h * stride_oh,      # this head's Q and O
                 K + b * stride_kb + h_kv * stride_kh, V + b * stride_vb + h_kv * stride_vh,  # its K/V head's
                 stride_qn, stride_qd, stride_on, stride_od, stride_kn, stride_kd, stride_vn, stride_vd,
                 CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, COUNT_VISITS=COUNT_VISITS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                 HEAD_DIM_PAD=HEAD_DIM_PAD)


from solutions.stage5_causal import _launch_setup  # given


def flash_attention(q, k, v, *, causal: bool = False, window: int | None = None, sm_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, return_visits: bool = False):
    """FlashAttention forward, optionally causal with a sliding window, with GQA/MQA; returns ``(o, lse)``.

    Without ``block_m``/``block_n`` the tile comes from kernels/tuning.py (timed by the
    autotuner on a GPU for long sequences).

    Args:
        q: (B, Hq, Nq, D) queries, any strides; float16 or float32 (and bfloat16 on a GPU);
            16 <= D <= 256, any Nq >= 1.
        k, v: (B, Hkv, Nk, D) keys and values, any strides: q's batch, head dim, dtype and device;
            Hq % Hkv == 0, query head h reads K/V head h // (Hq // Hkv) (Hkv = 1: MQA); Nk >= 1.
        causal: query i sees key j iff j <= i + (Nk - Nq), the diagonal aligned bottom-right; a row
            that sees no key (Nq > Nk) gets o = 0 and lse = -inf.
        window: W >= 1 (needs ``causal``): query i sees the W most recent keys, its own included,
            i' - W < j <= i' with i' = i + (Nk - Nq); None: no window.
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
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, window=window, sm_scale=sm_scale,
                                                      head_dims=HEAD_DIMS)
    kernel, config, o, lse, visits, qk_scale = _launch_setup(_flash_forward_kernel, q, Nk, sm_scale=sm_scale,
                                                             block_m=block_m, block_n=block_n,
                                                             return_visits=return_visits)
    def grid(meta):                 # one program per (query block, batch x query head); meta holds the tile
        return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq

    kernel[grid](q, k, v, o, lse, visits, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                 Hq, Hq // Hkv, Nq, Nk, D, window if window is not None else 0, qk_scale,
                 CAUSAL=causal, HAS_WINDOW=window is not None, COUNT_VISITS=return_visits, **config)
    return (o, lse, visits) if return_visits else (o, lse)


# BEGIN SOLUTION stub=
if __name__ == "__main__":
    from kernels import reference
    for nq, nk, w, bm, bn in ((256, 256, 16, 32, 32), (256, 256, 100, 64, 16), (100, 300, 40, 16, 64),
                              (300, 100, 1, 32, 32)):
        q = runtime.randn(1, 2, nq, 64, dtype=torch.float16)
        k, v = (runtime.randn(1, 1, nk, 64, dtype=torch.float16) for _ in range(2))
        o, lse, visits = flash_attention(q, k, v, causal=True, window=w, block_m=bm, block_n=bn, return_visits=True)
        o_ref, lse_ref = reference.attention(q, k, v, causal=True, window=w)
        causal = flash_attention(q, k, v, causal=True, block_m=bm, block_n=bn, return_visits=True)[2]
        print(f"Nq={nq} Nk={nk} W={w} {bm}x{bn}: max |o - ref| = {(o.double() - o_ref).abs().max().item():.2e}; "
              f"key blocks loaded {int(visits.sum())}, causal alone {int(causal.sum())}")
    if runtime.ON_GPU:
        from triton.testing import do_bench
        q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for w in (128, 512, 2048, 8192, None):
            ms = do_bench(lambda: flash_attention(q, k, v, causal=True, window=w), return_mode="median")
            print(f"N=16384 D=128 bf16, window {w}: {ms:.3f} ms")
# END SOLUTION
