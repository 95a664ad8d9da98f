"""Stage 5: causal attention: skip what is above the diagonal, and never make a NaN.

What you will learn
-------------------
* Causal masking aligned bottom-right, as FlashAttention does: query ``i`` sees key ``j`` iff
  ``j <= i + (Nk - Nq)``, so the last query always sees the last key.
* Block skipping.  A query block works out from its own position which key blocks it needs:
  the whole blocks below the diagonal (every row sees all of them: no mask at all), then a
  band of blocks the diagonal cuts through (masked element by element), and nothing above
  it.  Blocks above the diagonal are never loaded, so causal attention does about half the
  work.  ``_attend_blocks`` runs the loop of stage 3 over one range of key blocks, MASKED or
  not, and ``_attend_tile``, one program's work, calls it once per range::

      Nq = Nk = 512, block_m = 128, block_n = 64       F whole (no mask)  P band (masked)  . skipped
                         key block  0  1  2  3  4  5  6  7
          query block 0             P  P  .  .  .  .  .  .
          query block 1             F  F  P  P  .  .  .  .
          query block 2             F  F  F  F  P  P  .  .
          query block 3             F  F  F  F  F  F  P  P

* The NaN trap.  With ``block_m != block_n`` a row can be fully masked inside a tile (rows
  0-63 of query block 0 see nothing of key block 1 above), and with ``Nq > Nk`` a row can see
  no key at all.  Such a row's max is -inf, and ``exp2(-inf - (-inf))`` is NaN: an update
  that subtracts the tile's own max, or a running max that is still -inf, poisons the row.
  The fix: subtract 0 while the max is -inf (every ``exp2(-inf - 0)`` is then an honest 0),
  and finish a row whose sum ``l`` is 0 with ``o = 0`` and ``lse = -inf``.

The visibility rule (``_visible``) and the ranges of key blocks (``_key_blocks``) are small
functions of their own: stages 7 and 8 add the window's and the sink tokens' beside them, and
later stages take every helper of this file as given code.  The kernel itself only finds its
heads: ``_attend_tile`` does a program's work from pointers to them (stage 3's set-up, the
ranges, the loops and the store), so a later stage changes the kernel where it picks the heads.

``flash_attention(..., return_visits=True)`` also returns how many key blocks each program
loaded, counted by the kernel's own loop: the tests use it to see that blocks are skipped.

Conventions (kernels/reference.py): q (B, H, Nq, D), k and v (B, H, Nk, D); returns o in q's
dtype and lse (B, H, Nq) float32, natural log; rows that see no key give o = 0, lse = -inf.
"""

from __future__ import annotations

import math

import torch

from kernels import runtime, tuning, validate

import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

# Constants of stage 3: LOG2E for the wrapper, LN2 for kernels, the head dims the kernels take.
from solutions.stage3_flash_forward import LOG2E, LN2, HEAD_DIMS  # given


@triton.jit
def _visible(rows, cols, N_K, shift, CAUSAL: tl.constexpr):
    """The visibility rule, (rows, cols) booleans: query row i sees key j iff j < N_K and, with
    CAUSAL, j <= i + shift, where shift = N_K - N_Q (bottom-right alignment)."""
    visible = cols[None, :] < N_K                             # stage 3's rule: no key past N_K
    # TODO(5a): with CAUSAL, also hide the keys after each row's diagonal, cols > rows + shift
    # (rows down, cols across: broadcast them).
    # BEGIN SOLUTION stub=pass
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + shift)
    # END SOLUTION
    return visible


@triton.jit
def _scores(q, k_base, v_base, cols, stride_kn, stride_vn, N_K, d_ok, qk_scale):
    """One key block's scores against the query tile, in base 2, and its values (stage 3's loads)."""
    col_ok = cols < N_K
    k = tl.load(k_base + cols[:, None] * stride_kn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_base + cols[:, None] * stride_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    return tl.dot(q, tl.trans(k)) * qk_scale, v                             # (BLOCK_M, BLOCK_N), v


@triton.jit
def _softmax_update(acc, m_i, l_i, s, v):
    """Stage 3's online-softmax update of one tile of scores, made NaN-safe."""
    # TODO(5a), continued: stage 3's update, made NaN-safe: a row can have m_new = -inf (it has
    # seen no key yet, and this tile hides every key from it).  Subtract m_safe = (0 where
    # m_new is -inf, else m_new) in both exponentials, alpha = exp2(m_i - m_safe) and
    # p = exp2(s - m_safe), and keep m_i = m_new itself (still -inf for such a row).
    # BEGIN SOLUTION stub=pass
    # A row that has seen no key yet has m_new = -inf: subtract 0 from it instead.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                # -inf - -inf is NaN; -inf - 0 is not
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    m_i = m_new
    # END SOLUTION
    return acc, m_i, l_i


@triton.jit
def _attend_blocks(acc, m_i, l_i, visits, lo, hi, shift,
                   q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold the key blocks starting at lo, lo + BLOCK_N, ... (below hi) into one query tile.

    MASKED=False is for blocks that every row of the tile sees whole: no mask is built.
    MASKED=True applies the visibility rule, _visible.
    """
    offs_n = tl.arange(0, BLOCK_N)                            # key columns within a block
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        s, v = _scores(q, k_base, v_base, cols, stride_kn, stride_vn, N_K, d_ok, qk_scale)
        if MASKED:
            s = tl.where(_visible(offs_m, cols, N_K, shift, CAUSAL=CAUSAL), s, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v)
        visits += 1                                   # one more key block loaded (the tests count them)
    return acc, m_i, l_i, visits


@triton.jit
def _key_blocks(start_m, N_K, shift, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks the query block starting at row start_m needs, as two ranges of block
    starts: whole blocks [0, full_hi) that every row sees, and the band [full_hi, hi) that the
    diagonal cuts.  Query row i sees key j iff j <= i + shift."""
    # TODO(5b): the two ranges.
    #   whole blocks [0, full_hi): every row of the block sees every key in them.  The first
    #     row, start_m, sees keys <= start_m + shift, so full_hi is start_m + shift + 1 rounded
    #     DOWN to a multiple of BLOCK_N (and never below 0: when Nq > Nk it can be negative).
    #   the band [full_hi, hi): blocks the diagonal cuts.  The block's last row sees keys
    #     <= start_m + BLOCK_M - 1 + shift, so hi = start_m + BLOCK_M + shift, kept in [0, N_K].
    # Without CAUSAL every key is visible: the whole blocks are the ones that end by N_K, and
    # the band is the partial last block, if any.  (Round down with // only on values >= 0:
    # Triton's integer division truncates toward zero, like C, so -5 // 4 is -1, not -2.)
    # Until you do, the stub visits every key block with the mask: right answers, N^2 work.
    # BEGIN SOLUTION stub=full_hi, hi = 0, N_K
    if CAUSAL:
        full_hi = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), N_K)
    else:
        full_hi = N_K // BLOCK_N * BLOCK_N
        hi = N_K
    # END SOLUTION
    return full_hi, hi


@triton.jit
def _finish(acc, m_i, l_i, o_ptrs, lse_ptrs, row_ok, d_ok):
    """Normalise the tile and store o (real rows and head-dim columns) and lse, natural log."""
    # TODO(5c): normalise and store as in stage 3, but a row that saw no key has l_i = 0 and
    # m_i = -inf: divide by 1 instead of 0 there (acc is 0, so o = 0), and let its
    # lse = (m_i + log2(l)) * LN2 come out as -inf, not NaN.
    # BEGIN SOLUTION stub=pass
    # A row that saw no key ends with l_i = 0 and m_i = -inf: o = 0 and lse = -inf, not NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)                                 # rows that saw no key
    o = acc / l_safe[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptrs, (m_i + tl.log2(l_safe)) * LN2, mask=row_ok)
    # END SOLUTION


@triton.jit
def _query_rows(start_m, N_Q, HEAD_DIM, BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The query rows start_m, ... of a program, and the masks of its real rows and real
    head-dim columns: index arithmetic alone, apart from any load or store."""
    offs_m = start_m + tl.arange(0, BLOCK_M)                  # query rows of this program
    offs_d = tl.arange(0, HEAD_DIM_PAD)                       # head-dim columns (padded)
    return offs_m, offs_m < N_Q, offs_d < HEAD_DIM            # False past N_Q and on the padding columns


@triton.jit
def _load_query_tile(q_head, k_head, v_head, stride_qn, stride_qd, stride_kd, stride_vd, offs_m, row_ok, d_ok,
                     HEAD_DIM_PAD: tl.constexpr):
    """Stage 3's set-up of a program, for the query rows offs_m (from _query_rows) of the heads
    that start at q_head (Q), k_head and v_head (K and V): the Q tile, loaded once (zeros outside
    the sequence and in the padding columns), and where the head-dim columns of K and V start."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q = tl.load(q_head + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)             # (BLOCK_M, HEAD_DIM_PAD)
    k_base = k_head + offs_d[None, :] * stride_kd
    v_base = v_head + offs_d[None, :] * stride_vd
    return q, k_base, v_base


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Stage 3's running statistics before any key: acc = 0, m = -inf, l = 0 (float32)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)                # running max (base 2)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                              # running sum
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)                # unnormalised output
    return acc, m_i, l_i


@triton.jit
def _store_tile(acc, m_i, l_i, visits, o_head, stride_on, stride_od, LSE, VISITS, pid_m, pid_bh, N_Q, offs_m,
                row_ok, d_ok, COUNT_VISITS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """The end of a program: o and lse of its rows, through _finish, for the head whose O starts at
    o_head and whose rows of LSE start at LSE + pid_bh * N_Q, and with COUNT_VISITS how many key
    blocks it loaded.  (o's pointers are made here, after the loops, not held through them.)"""
    offs_d = tl.arange(0, HEAD_DIM_PAD)                       # head-dim columns (padded)
    o_ptrs = o_head + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    _finish(acc, m_i, l_i, o_ptrs, LSE + pid_bh * N_Q + offs_m, row_ok, d_ok)
    if COUNT_VISITS:
        tl.store(VISITS + pid_bh * tl.num_programs(0) + pid_m, visits)


@triton.jit
def _attend_tile(LSE, VISITS, pid_m, pid_bh, N_Q, N_K, HEAD_DIM, qk_scale, q_head, o_head, k_head, v_head,
                 stride_qn, stride_qd, stride_on, stride_od, stride_kn, stride_kd, stride_vn, stride_vd,
                 CAUSAL: tl.constexpr, COUNT_VISITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """One program's work: query block pid_m of the query head at q_head against the K/V head at
    k_head and v_head, with o and lse stored for (batch, head) pid_bh.  The ranges of key blocks
    first, then the Q tile, then one _attend_blocks per range, then the store."""
    start_m = pid_m * BLOCK_M
    shift = N_K - N_Q               # query row i sees key j iff j <= i + shift (bottom-right alignment)
    full_hi, hi = _key_blocks(start_m, N_K, shift, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    offs_m, row_ok, d_ok = _query_rows(start_m, N_Q, HEAD_DIM, BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD)
    q, k_base, v_base = _load_query_tile(q_head, k_head, v_head, stride_qn, stride_qd, stride_kd, stride_vd,
                                         offs_m, row_ok, d_ok, HEAD_DIM_PAD=HEAD_DIM_PAD)
    acc, m_i, l_i = _empty_state(BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD)
    visits = 0                                                               # key blocks loaded
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, 0, full_hi, shift,       # whole blocks, no mask
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N)
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, full_hi, hi, shift,      # the diagonal band, masked
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N)
    _store_tile(acc, m_i, l_i, visits, o_head, stride_on, stride_od, LSE, VISITS, pid_m, pid_bh, N_Q, offs_m, row_ok,
                d_ok, COUNT_VISITS=COUNT_VISITS, HEAD_DIM_PAD=HEAD_DIM_PAD)


@tuning.autotune(tuning.FORWARD_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL"])
@triton.jit
def _flash_forward_kernel(
    Q, K, V, O, LSE, VISITS,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,    # Q's and K's strides
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,    # V's and O's
    H, N_Q, N_K, HEAD_DIM,
    qk_scale,                       # sm_scale * log2(e): scores come out in base 2
    CAUSAL: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)        # which block of queries, which (batch, head)
    b, h = pid_bh // H, pid_bh % H
    _attend_tile(LSE, VISITS, pid_m, pid_bh, N_Q, N_K, HEAD_DIM, qk_scale,
                 Q + b * stride_qb + h * stride_qh, O + b * stride_ob + h * stride_oh,      # this head's Q and O
                 K + b * stride_kb + h * stride_kh, V + b * stride_vb + h * stride_vh,      # and its K and V
                 stride_qn, stride_qd, stride_on, stride_od, stride_kn, stride_kd, stride_vn, stride_vd,
                 CAUSAL=CAUSAL, COUNT_VISITS=COUNT_VISITS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM_PAD=HEAD_DIM_PAD)


def _launch_setup(kernel, q, Nk, *, sm_scale, block_m, block_n, return_visits):
    """What every launch of the forward needs: the kernel and its tile (timed by the autotuner on
    a GPU for long sequences, else fixed: kernels/tuning.py), the outputs and qk_scale.  ``kernel``
    is the stage's own forward kernel: each later stage passes the one it wrote."""
    runtime.check_dtype(q.dtype)
    B, Hq, Nq, D = q.shape
    head_dim_pad = triton.next_power_of_2(D)
    block_m = validate.block_size(block_m, "block_m") if block_m is not None else None
    block_n = validate.block_size(block_n, "block_n") if block_n is not None else None
    kernel, tile = tuning.plan(kernel, tuning.FORWARD_TILES, head_dim_pad, Nq, Nk,
                               interpreter_tile=tuning.FORWARD_INTERPRETER_TILE, block_m=block_m,
                               block_n=block_n, counting=return_visits)
    o = torch.empty_like(q)                                                  # (B, Hq, Nq, D)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)      # (B, Hq, Nq)
    visits = (torch.empty(B, Hq, triton.cdiv(Nq, tile["BLOCK_M"]), device=q.device, dtype=torch.int32)
              if return_visits else None)                   # key blocks loaded per program
    qk_scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)) * LOG2E
    return kernel, dict(HEAD_DIM_PAD=head_dim_pad, **tile), o, lse, visits, qk_scale


def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, return_visits: bool = False):
    """FlashAttention forward, optionally causal; returns ``(o, lse)``.

    Without ``block_m``/``block_n`` the tile comes from kernels/tuning.py (timed by the
    autotuner on a GPU for long sequences).

    Args:
        q: (B, H, Nq, D) queries, any strides; float16 or float32 (and bfloat16 on a GPU);
            16 <= D <= 256, any Nq >= 1.
        k, v: (B, H, Nk, D) keys and values, any strides: q's batch, heads, head dim, dtype and
            device; Nk >= 1.
        causal: query i sees key j iff j <= i + (Nk - Nq), the diagonal aligned bottom-right; a row
            that sees no key (Nq > Nk) gets o = 0 and lse = -inf.
        sm_scale: the scores' scale, a positive number; None means ``1 / sqrt(D)``.
        block_m: query rows per program, a power of two >= 16; None: the planned tile's.
        block_n: keys per loop step, a power of two >= 16; None: the planned tile's.
        return_visits: also return how many key blocks each program loaded (the tile is then
            never autotuned).

    Returns:
        ``(o, lse)``, or ``(o, lse, visits)`` with ``return_visits``: o (B, H, Nq, D) in q's dtype
        (and q's strides); lse (B, H, Nq) float32, the log-sum-exp of each row's scaled scores in
        natural log (base e); visits (B, H, cdiv(Nq, BLOCK_M)) int32, BLOCK_M the tile's rows.
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, sm_scale=sm_scale,
                                                      head_dims=HEAD_DIMS)
    if Hq != Hkv:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}; stage 5 expects the same number of heads")
    kernel, config, o, lse, visits, qk_scale = _launch_setup(_flash_forward_kernel, q, Nk, sm_scale=sm_scale,
                                                             block_m=block_m, block_n=block_n,
                                                             return_visits=return_visits)
    def grid(meta):                 # one program per (query block, batch x head); meta holds the tile
        return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq

    kernel[grid](q, k, v, o, lse, visits, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                 Hq, Nq, Nk, D, qk_scale,
                 CAUSAL=causal, COUNT_VISITS=return_visits, **config)
    return (o, lse, visits) if return_visits else (o, lse)


# BEGIN SOLUTION stub=
if __name__ == "__main__":
    from kernels import reference
    for nq, nk, bm, bn in ((300, 300, 32, 32), (100, 300, 16, 64), (300, 100, 64, 16), (129, 129, 128, 32)):
        q = runtime.randn(1, 2, nq, 64, dtype=torch.float16)
        k, v = (runtime.randn(1, 2, nk, 64, dtype=torch.float16) for _ in range(2))
        o, lse, visits = flash_attention(q, k, v, causal=True, block_m=bm, block_n=bn, return_visits=True)
        o_ref, lse_ref = reference.attention(q, k, v, causal=True)
        print(f"Nq={nq} Nk={nk} {bm}x{bn}: max |o - ref| = {(o.double() - o_ref).abs().max().item():.2e}, "
              f"NaN in o: {int(o.isnan().sum())}, key blocks loaded {int(visits.sum())} "
              f"of {visits.numel() * triton.cdiv(nk, bn)}")
    if runtime.ON_GPU:
        from triton.testing import do_bench
        q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * 4 * 16 * 4096 * 4096 * 128 / 2                  # causal: half the pairs
        ms = do_bench(lambda: flash_attention(q, k, v, causal=True), return_mode="median")
        ms_sdpa = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                           return_mode="median")
        print(f"causal B4 H16 N4096 D128 bf16: {flops / ms * 1e-9:.0f} TFLOP/s, SDPA {flops / ms_sdpa * 1e-9:.0f}, "
              f"ratio {ms_sdpa / ms:.2f}")
# END SOLUTION
