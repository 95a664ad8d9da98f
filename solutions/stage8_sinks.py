"""Stage 8: attention sinks, both kinds: sink tokens (StreamingLLM) and learned sinks (gpt-oss).

What you will learn
-------------------
* Sink tokens, ``sink_tokens=S``.  A model trained with full attention dumps a lot of
  attention on its first few tokens; slide a window past them and it falls apart.
  StreamingLLM keeps the first ``S`` keys visible to every query whatever the window (still
  causally: a query never sees a key after its diagonal)::

      W = 2, S = 1, Nq = Nk = 6
            k0 k1 k2 k3 k4 k5
        q0   #  .  .  .  .  .
        q1   #  #  .  .  .  .
        q2   #  #  #  .  .  .
        q3   #  .  #  #  .  .
        q4   #  .  .  #  #  .
        q5   #  .  .  .  #  #

  The kernel visits the sink keys as a range of their own: the first ``cdiv(S, block_n)``
  key blocks, masked, then the window's ranges of stage 7.  The blocks in between are still
  skipped, so the work stays O(N * (W + S)).  Where the window already reaches back into the
  sink blocks, the sink range stops where the window's starts: no block is visited twice.
* Learned sinks, ``sinks`` (float32, one logit per query head).  gpt-oss gives each head a
  learned logit for a virtual key whose value is zero: it adds ``exp(sinks[h])`` to every
  row's softmax denominator, so a head can put weight on "nothing"::

      lse[b, h, i] = log( exp(sinks[h]) + sum over visible j of exp(s[i, j]) )
      o[b, h, i]   = sum over visible j of exp(s[i, j] - lse[b, h, i]) v[j]

  The online softmax takes it in for free: start every row's running max at the sink's
  logit (in base 2) and its running sum at 1, as if the sink were the first key read.  A row
  that sees no key then ends with o = 0 and lse = sinks[h], and a sink of +40 cannot
  overflow anything, because exp2 is only ever taken of a logit minus the running max.

Everything of stage 7 stays: the sliding window in O(N * W), causal masking aligned
bottom-right with skipped blocks, GQA/MQA without copies, and the NaN-safe online softmax.

``flash_attention(..., return_visits=True)`` also returns how many key blocks each program
loaded, counted by the kernel's own loop: the tests use it to see that blocks are skipped.

Conventions (kernels/reference.py): q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D) with Hq % Hkv == 0;
returns o in q's dtype and lse (B, Hq, Nq) float32, natural log; rows that see no key give
o = 0, lse = -inf (lse = sinks[h] with learned sinks); ``window`` needs ``causal=True``.
"""

from __future__ import annotations

import math

import torch

from kernels import runtime, tuning, validate

import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

from solutions.stage3_flash_forward import LOG2E, LN2, HEAD_DIMS  # given

# The visibility rules of stages 5 and 7, one key block's scores and the NaN-safe update, unchanged.
from solutions.stage5_causal import _visible  # given
from solutions.stage7_sliding_window import _in_window  # given
from solutions.stage5_causal import _scores, _softmax_update  # given


@triton.jit
def _attention_mask(rows, cols, N_K, shift, WINDOW, SINK_TOKENS, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The whole visibility rule, (rows, cols) booleans: stage 5's _visible and, with HAS_WINDOW,
    stage 7's _in_window, except for the sink tokens j < SINK_TOKENS."""
    visible = _visible(rows, cols, N_K, shift, CAUSAL=CAUSAL)
    if HAS_WINDOW:
        in_window = _in_window(rows, cols, shift, WINDOW)
        # TODO(8a): keep the sink tokens visible whatever the window: a key j < SINK_TOKENS
        # counts as inside every row's window (the causal test above still applies).
        # BEGIN SOLUTION stub=pass
        in_window = in_window | (cols[None, :] < SINK_TOKENS)
        # END SOLUTION
        visible = visible & in_window
    return visible


@triton.jit
def _attend_blocks(acc, m_i, l_i, visits, lo, hi, shift, WINDOW, SINK_TOKENS,
                   q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Stage 7's loop over the key blocks lo, lo + BLOCK_N, ... (below hi) of one query tile.

    MASKED=True applies the whole rule, _attention_mask: the sink tokens j < SINK_TOKENS stay
    visible whatever the window.
    """
    offs_n = tl.arange(0, BLOCK_N)                            # key columns within a block
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        s, v = _scores(q, k_base, v_base, cols, stride_kn, stride_vn, N_K, d_ok, qk_scale)
        if MASKED:
            visible = _attention_mask(offs_m, cols, N_K, shift, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL,
                                      HAS_WINDOW=HAS_WINDOW)
            s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _softmax_update(acc, m_i, l_i, s, v)
        visits += 1                                   # one more key block loaded (the tests count them)
    return acc, m_i, l_i, visits


# The ranges of key blocks of stages 5 and 7, unchanged; the sink tokens' come after them.
from solutions.stage5_causal import _key_blocks  # given
from solutions.stage7_sliding_window import _window_blocks  # given


@triton.jit
def _sink_blocks(SINK_TOKENS, lo, BLOCK_N: tl.constexpr):
    """The sink tokens' own range of key blocks, [0, sink_hi), visited before the window's."""
    sink_hi = 0                                               # no block of their own
    # TODO(8c): the blocks that hold keys j < SINK_TOKENS, i.e. SINK_TOKENS rounded UP to a
    # multiple of BLOCK_N, but never past lo: from lo on, the window's ranges load those blocks
    # already (a block loaded twice counts its keys twice).  The blocks between sink_hi and lo
    # are skipped.
    # BEGIN SOLUTION stub=pass
    sink_hi = tl.minimum((SINK_TOKENS + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)
    # END SOLUTION
    return sink_hi


@triton.jit
def _key_ranges(start_m, N_K, shift, WINDOW, SINK_TOKENS, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Every range of key blocks of the query block starting at row start_m, in the order they are
    visited: the sink tokens [0, sink_hi) and the window's leading edge [lo, full_lo), masked; whole
    blocks [full_lo, full_hi); the diagonal band [full_hi, hi), masked.  They never overlap:
    sink_hi <= lo <= full_lo <= full_hi <= hi."""
    full_hi, hi = _key_blocks(start_m, N_K, shift, CAUSAL=CAUSAL, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    lo, full_lo, sink_hi = 0, 0, 0
    if HAS_WINDOW:
        lo, full_lo = _window_blocks(start_m, shift, WINDOW, full_hi, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
        sink_hi = _sink_blocks(SINK_TOKENS, lo, BLOCK_N=BLOCK_N)
    return sink_hi, lo, full_lo, full_hi, hi


# Stage 5's store and set-up of a program, unchanged.
from solutions.stage5_causal import (  # given
    _finish, _query_rows, _load_query_tile, _empty_state, _store_tile,
)


@triton.jit
def _attend_tile(LSE, VISITS, SINKS, h, pid_m, pid_bh, N_Q, N_K, HEAD_DIM, WINDOW, SINK_TOKENS, qk_scale,
                 q_head, o_head, k_head, v_head,
                 stride_qn, stride_qd, stride_on, stride_od, stride_kn, stride_kd, stride_vn, stride_vd,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, COUNT_VISITS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Stage 7's program with sinks: the sink tokens' range of key blocks before the window's, and
    the learned sink of query head h (SINKS[h]) counted in before the first key."""
    start_m = pid_m * BLOCK_M
    shift = N_K - N_Q               # query row i sees key j iff j <= i + shift (bottom-right alignment)
    sink_hi, lo, full_lo, full_hi, hi = _key_ranges(start_m, N_K, shift, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL,
                                                    HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    offs_m, row_ok, d_ok = _query_rows(start_m, N_Q, HEAD_DIM, BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD)
    q, k_base, v_base = _load_query_tile(q_head, k_head, v_head, stride_qn, stride_qd, stride_kd, stride_vd,
                                         offs_m, row_ok, d_ok, HEAD_DIM_PAD=HEAD_DIM_PAD)
    acc, m_i, l_i = _empty_state(BLOCK_M=BLOCK_M, HEAD_DIM_PAD=HEAD_DIM_PAD)
    # TODO(8b): with HAS_SINKS, this head's learned sink is a virtual key with logit SINKS[h]
    # and value 0.  Count it as read before every real key: start m_i at its logit in base 2
    # (SINKS[h] / LN2, as log2(x) = ln(x) / ln(2)) and l_i at 1 for every row; acc stays 0,
    # since its value is 0.
    # BEGIN SOLUTION stub=pass
    if HAS_SINKS:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + h) / LN2
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    # END SOLUTION
    visits = 0                                                               # key blocks loaded
    if sink_hi > 0:                                          # an empty range still costs a pipelined loop's set-up
        acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, 0, sink_hi, shift, WINDOW, SINK_TOKENS,
                                               q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                               MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, lo, full_lo, shift, WINDOW, SINK_TOKENS,
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, full_lo, full_hi, shift, WINDOW, SINK_TOKENS,
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=False, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    acc, m_i, l_i, visits = _attend_blocks(acc, m_i, l_i, visits, full_hi, hi, shift, WINDOW, SINK_TOKENS,
                                           q, k_base, v_base, stride_kn, stride_vn, offs_m, d_ok, N_K, qk_scale,
                                           MASKED=True, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, BLOCK_N=BLOCK_N)
    # With a learned sink a row that saw no key ends with l_i = 1 and m_i = the sink: o = 0 and
    # lse = sinks[h].
    _store_tile(acc, m_i, l_i, visits, o_head, stride_on, stride_od, LSE, VISITS, pid_m, pid_bh, N_Q, offs_m, row_ok,
                d_ok, COUNT_VISITS=COUNT_VISITS, HEAD_DIM_PAD=HEAD_DIM_PAD)


@tuning.autotune(tuning.FORWARD_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW",
                                             "SINK_TOKENS", "HAS_SINKS", "GROUP"])
@triton.jit
def _flash_forward_kernel(
    Q, K, V, O, LSE, SINKS, VISITS,
    stride_qb, stride_qh, stride_qn, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,    # Q's and K's strides
    stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_on, stride_od,    # V's and O's
    H, GROUP, N_Q, N_K, HEAD_DIM, WINDOW,   # GROUP = Hq // Hkv query heads share a K/V head (stage 6);
                                            # WINDOW keys per sliding window (used only with HAS_WINDOW)
    SINK_TOKENS,                    # the first SINK_TOKENS keys stay visible whatever the window
    qk_scale,                       # sm_scale * log2(e): scores come out in base 2
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, COUNT_VISITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    # A Python float arrives as float32 from Triton's launcher but as float64 from torch.compile's
    # (stage 9's op, solutions/attention_op/): fix its type, or the float64 would spread into
    # the accumulators.
    qk_scale = tl.cast(qk_scale, tl.float32)
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)        # which block of queries, which (batch, query head)
    b, h = pid_bh // H, pid_bh % H
    h_kv = h // GROUP               # the K/V head this query head shares (stage 6)
    _attend_tile(LSE, VISITS, SINKS, h, pid_m, pid_bh, N_Q, N_K, HEAD_DIM, WINDOW, SINK_TOKENS, qk_scale,
                 Q + b * stride_qb + h * stride_qh, O + b * stride_ob + h * stride_oh,      # this head's Q and O
                 K + b * stride_kb + h_kv * stride_kh, V + b * stride_vb + h_kv * stride_vh,  # its K/V head's
                 stride_qn, stride_qd, stride_on, stride_od, stride_kn, stride_kd, stride_vn, stride_vd,
                 CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, HAS_SINKS=HAS_SINKS, COUNT_VISITS=COUNT_VISITS,
                 BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM_PAD=HEAD_DIM_PAD)


from solutions.stage5_causal import _launch_setup  # given


def flash_attention(q, k, v, *, causal: bool = False, window: int | None = None, sink_tokens: int = 0,
                    sinks: torch.Tensor | None = None, sm_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, return_visits: bool = False):
    """FlashAttention forward with every feature of the workbook; returns ``(o, lse)``.

    Without ``block_m``/``block_n`` the tile comes from kernels/tuning.py (timed by the
    autotuner on a GPU for long sequences).

    Args:
        q: (B, Hq, Nq, D) queries, any strides; float16 or float32 (and bfloat16 on a GPU);
            16 <= D <= 256, any Nq >= 1.
        k, v: (B, Hkv, Nk, D) keys and values, any strides: q's batch, head dim, dtype and device;
            Hq % Hkv == 0, query head h reads K/V head h // (Hq // Hkv) (Hkv = 1: MQA); Nk >= 1.
        causal: query i sees key j iff j <= i + (Nk - Nq), the diagonal aligned bottom-right; a row
            that sees no key (Nq > Nk) gets o = 0 and lse = -inf (sinks[h] with learned sinks).
        window: W >= 1 (needs ``causal``): query i sees the W most recent keys, its own included,
            i' - W < j <= i' with i' = i + (Nk - Nq); None: no window.
        sink_tokens: S >= 0: keys j < S stay visible whatever the window (never past the diagonal).
        sinks: (Hq,) float32 learned logits on q's device, or None: one virtual zero-valued key per
            query head, added to every row's softmax denominator (lse includes it).
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
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens,
                                                      sinks=sinks, sm_scale=sm_scale, head_dims=HEAD_DIMS)
    kernel, config, o, lse, visits, qk_scale = _launch_setup(_flash_forward_kernel, q, Nk, sm_scale=sm_scale,
                                                             block_m=block_m, block_n=block_n,
                                                             return_visits=return_visits)
    def grid(meta):                 # one program per (query block, batch x query head); meta holds the tile
        return triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq

    sinks = sinks.to(torch.float32).contiguous() if sinks is not None else None   # (Hq,)
    kernel[grid](q, k, v, o, lse, sinks, visits, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
                 Hq, Hq // Hkv, Nq, Nk, D, window if window is not None else 0, sink_tokens, qk_scale,
                 CAUSAL=causal, HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
                 COUNT_VISITS=return_visits, **config)
    return (o, lse, visits) if return_visits else (o, lse)


# BEGIN SOLUTION stub=
if __name__ == "__main__":
    from kernels import reference
    q = runtime.randn(1, 4, 200, 64, dtype=torch.float16)
    k, v = (runtime.randn(1, 2, 200, 64, dtype=torch.float16) for _ in range(2))
    sinks = torch.tensor([-30.0, 0.0, 3.0, 40.0], device=q.device)
    for opts in (dict(causal=True, window=16, sink_tokens=4), dict(sinks=sinks),
                 dict(causal=True, window=16, sink_tokens=4, sinks=sinks)):
        o, lse, visits = flash_attention(q, k, v, **opts, block_m=32, block_n=32, return_visits=True)
        o_ref, lse_ref = reference.attention(q, k, v, **opts)
        print(f"{', '.join(f'{n}={x}' for n, x in opts.items() if n != 'sinks')}"
              f"{' learned sinks ' + str(sinks.tolist()) if 'sinks' in opts else ''}: "
              f"max |o - ref| = {(o.double() - o_ref).abs().max().item():.2e}, "
              f"max |lse - ref| = {(lse.double() - lse_ref).abs().max().item():.2e}, "
              f"key blocks loaded {int(visits.sum())}")
    if runtime.ON_GPU:
        from triton.testing import do_bench
        q = torch.randn(1, 64, 8192, 64, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, 8192, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sinks = torch.randn(64, device="cuda")
        for opts in (dict(causal=True), dict(causal=True, window=128, sink_tokens=4, sinks=sinks),
                     dict(causal=True, sinks=sinks)):
            ms = do_bench(lambda: flash_attention(q, k, v, **opts), return_mode="median")
            print(f"gpt-oss-like shapes (Hq 64, Hkv 8, N 8192, D 64, bf16), {sorted(opts)}: {ms:.3f} ms")
# END SOLUTION
