"""Stage 9: the backward pass, from the saved log-sum-exp.

What you will learn
-------------------
* Why the backward needs nothing of size N^2: the forward saves ``o`` and ``lse``, and every
  tile of the attention matrix is rebuilt on the fly as ``p = exp(s - lse)``.
* The backward tile by tile in plain PyTorch first (part 1, ``tiled_attention_backward``):
  the arithmetic of every kernel below, as two loops you can print and step through.
* The three kernels of FlashAttention-2's backward and why there are three:
    1. a preprocess that computes ``delta = rowsum(dO * O)`` per query row (and here the
       gradient of the learned sinks, which needs nothing else);
    2. a dK/dV kernel with one program per (key block, KV head) that walks down the query
       blocks that can see its keys, and over the query heads of its GQA group, so the
       group's contributions are summed in registers: no atomics, no expanded K/V copies;
    3. a dQ kernel with one program per (query block, query head) that walks across the key
       blocks exactly as the forward does.
* The same block skipping as the forward (causal, sliding window, sink tokens), seen from
  both sides: a key block is visited by the query blocks that see it, and by no other.
* An ``autograd.Function`` that ties the forward and either backward together
  (``tiled_attention`` with part 1's, ``attention`` with part 2's).
* Your kernels as a PyTorch operator (part 3, ``attention_op``): a schema, a fake implementation
  and an autograd rule, so that ``torch.compile(model, fullgraph=True)`` keeps them in its graph.

The forward is stage 8's, complete and given: only the backward has TODOs, first in PyTorch (9a),
then in Triton (9b, 9c, 9d); then the operator around both (9e, 9f).

The derivation, for one query head (``S = scale * Q K^T``, ``P = exp(S - lse)``, ``O = P V``)::

    dV  = P^T dO                         (Nk, D)
    dP  = dO V^T                         (Nq, Nk)   one tile at a time, never whole
    dS  = P o (dP - delta)               delta[i] = sum_j P[i, j] dP[i, j] = rowsum(dO o O)[i]
    dQ  = scale * dS K                   (Nq, D)
    dK  = scale * dS^T Q                 (Nk, D)

A learned sink is a virtual key with logit ``sinks[h]`` and value zero, so its ``dP`` is
zero and ``delta`` is unchanged; its own ``dS`` column is ``exp(sinks[h] - lse) * (0 - delta)``::

    dsinks[h] = -sum over b, i of exp(sinks[h] - lse[b, h, i]) * delta[b, h, i]

Conventions (kernels/reference.py): q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), Hq % Hkv == 0;
causal aligned bottom-right; ``window`` needs ``causal``; ``sink_tokens`` keys stay visible
whatever the window; ``sinks`` (Hq,) float32 logits.  A row that sees no key has zero
gradients, never NaN.
"""

from __future__ import annotations

import math

import torch

from kernels import masks, runtime, tuning, validate

import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

# The forward is stage 8's, complete (causal, GQA, sliding window, sink tokens, learned sinks).
# Its helpers are the backward's too: the whole visibility rule (_attention_mask, from _visible,
# _in_window and the sink tokens) and every range of key blocks (_key_ranges, from _key_blocks,
# _window_blocks and _sink_blocks).
LOG2E = 1.4426950408889634   # log2(e): exp(x) == exp2(x * LOG2E); the wrapper folds it into the scale
LN2 = tl.constexpr(0.6931471805599453)   # ln(2): log(x) == log2(x) * LN2; a constexpr, so kernels may read it
HEAD_DIMS = (16, 256)


@triton.jit
def _visible(rows, cols, N_K, shift, CAUSAL: tl.constexpr):
    """The visibility rule, (rows, cols) booleans: query row i sees key j iff j < N_K and, with
    CAUSAL, j <= i + shift, where shift = N_K - N_Q (bottom-right alignment)."""
    visible = cols[None, :] < N_K                             # stage 3's rule: no key past N_K
    if CAUSAL:
        visible = visible & (cols[None, :] <= rows[:, None] + shift)
    return visible


@triton.jit
def _in_window(rows, cols, shift, WINDOW):
    """The sliding window, (rows, cols) booleans: key j is inside row i's window iff
    j > i + shift - WINDOW, so WINDOW keys up to the row's diagonal i + shift, its own included."""
    in_window = cols[None, :] > rows[:, None] + shift - WINDOW
    return in_window


@triton.jit
def _attention_mask(rows, cols, N_K, shift, WINDOW, SINK_TOKENS, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The whole visibility rule, (rows, cols) booleans: stage 5's _visible and, with HAS_WINDOW,
    stage 7's _in_window, except for the sink tokens j < SINK_TOKENS."""
    visible = _visible(rows, cols, N_K, shift, CAUSAL=CAUSAL)
    if HAS_WINDOW:
        in_window = _in_window(rows, cols, shift, WINDOW)
        in_window = in_window | (cols[None, :] < SINK_TOKENS)
        visible = visible & in_window
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
    # A row that has seen no key yet has m_new = -inf: subtract 0 from it instead.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                # -inf - -inf is NaN; -inf - 0 is not
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    m_i = m_new
    return acc, m_i, l_i


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


@triton.jit
def _key_blocks(start_m, N_K, shift, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks the query block starting at row start_m needs, as two ranges of block
    starts: whole blocks [0, full_hi) that every row sees, and the band [full_hi, hi) that the
    diagonal cuts.  Query row i sees key j iff j <= i + shift."""
    if CAUSAL:
        full_hi = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), N_K)
    else:
        full_hi = N_K // BLOCK_N * BLOCK_N
        hi = N_K
    return full_hi, hi


@triton.jit
def _window_blocks(start_m, shift, WINDOW, full_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The key blocks behind the window that a query block skips: it starts at lo, and the blocks
    [full_lo, full_hi) are inside every row's window; [lo, full_lo) is the window's masked edge."""
    lo, full_lo = 0, 0                                        # every key block, the edge masked
    lo = tl.maximum(start_m + shift - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    full_lo = (tl.maximum(start_m + BLOCK_M + shift - WINDOW, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(full_lo, full_hi)
    return lo, full_lo


@triton.jit
def _sink_blocks(SINK_TOKENS, lo, BLOCK_N: tl.constexpr):
    """The sink tokens' own range of key blocks, [0, sink_hi), visited before the window's."""
    sink_hi = 0                                               # no block of their own
    sink_hi = tl.minimum((SINK_TOKENS + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo)
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


@triton.jit
def _finish(acc, m_i, l_i, o_ptrs, lse_ptrs, row_ok, d_ok):
    """Normalise the tile and store o (real rows and head-dim columns) and lse, natural log."""
    # A row that saw no key ends with l_i = 0 and m_i = -inf: o = 0 and lse = -inf, not NaN.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)                                 # rows that saw no key
    o = acc / l_safe[:, None]
    tl.store(o_ptrs, o.to(o_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptrs, (m_i + tl.log2(l_safe)) * LN2, mask=row_ok)


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
    if HAS_SINKS:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(SINKS + h) / LN2
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
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


# =============================================================================================
# Part 1: the backward in PyTorch, one tile at a time (TODO 9a).
# =============================================================================================

def tiled_attention_backward(q, k, v, o, lse, do, *, causal=False, window=None, sink_tokens=0, sinks=None,
                             sm_scale=None, block_m=32, block_n=32):
    """Gradients ``(dq, dk, dv, dsinks)`` computed tile by tile in PyTorch, from ``o``, ``lse`` and ``do``.

    The same arithmetic as the Triton kernels of part 2, as plain loops: for each block of
    ``block_m`` query rows, for each block of ``block_n`` keys whose tile holds a visible pair,
    rebuild that tile of P from lse, and add its share to dq, dk and dv.  Shapes as the
    forward: dq like q, dk and dv like k and v (float32 arithmetic, returned in the inputs'
    dtype), dsinks like sinks (None without).  Masks as the forward's (kernels/masks.py).
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens,
                                                      sinks=sinks, sm_scale=sm_scale)
    if o.shape != q.shape or do.shape != q.shape:
        raise ValueError(f"o and do must have q's shape {tuple(q.shape)}, got {tuple(o.shape)} and {tuple(do.shape)}")
    if lse.shape != (B, Hq, Nq):
        raise ValueError(f"lse must have shape {(B, Hq, Nq)}, got {tuple(lse.shape)}")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    group = Hq // Hkv
    visible = masks.attention_mask(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens)
    # A query head's GQA group as a dimension of its own: query head h is (h // group, h % group),
    # so a (B, Hkv, 1, ...) tile of K or V broadcasts over the heads that read it.
    q4, o4, do4 = (t.float().unflatten(1, (Hkv, group)) for t in (q, o, do))      # (B, Hkv, G, Nq, D)
    lse4 = lse.float().unflatten(1, (Hkv, group))                                   # (B, Hkv, G, Nq)
    k4, v4 = (t.float().unsqueeze(2) for t in (k, v))                               # (B, Hkv, 1, Nk, D)
    sinks4 = sinks.float().view(1, Hkv, group, 1) if sinks is not None else None
    dq = torch.zeros_like(q4)
    dk, dv = torch.zeros_like(k4), torch.zeros_like(v4)
    dsinks = torch.zeros_like(sinks4) if sinks is not None else None

    for i0 in range(0, Nq, block_m):                                    # one query block
        rows = torch.arange(i0, min(i0 + block_m, Nq), device=q.device)
        qi, oi, doi = (t[..., i0:i0 + block_m, :] for t in (q4, o4, do4))  # (B, Hkv, G, bm, D)
        lse_i = lse4[..., i0:i0 + block_m]                              # (B, Hkv, G, bm)
        # TODO(9a): the backward of this query block, in float32.
        # First its rows' delta = rowsum(dO * O) and, with learned sinks, their share of the sink
        # gradient: dsinks -= exp(sinks - lse) * delta, summed over batch and rows.
        # Then for each key block [j0, j0 + block_n) whose tile holds a visible pair (test
        # visible(0, 0, rows[:, None], cols[None, :]); skip the others, as the kernels will):
        #   p = exp(scale * qi @ kj^T - lse) where visible, 0 elsewhere (torch.where, not a
        #       product with the mask: a row that sees no key has lse = -inf, exp(s - lse) = inf,
        #       and inf * 0 is NaN),
        #   dv += p^T @ dO, dp = dO @ vj^T, ds = p * (dp - delta),
        #   dq += scale * ds @ kj, dk += scale * ds^T @ qi,
        # summing dk and dv over the group's heads (dimension 2).
        raise NotImplementedError("stage9_backward.py: TODO(9a) is not written yet")
    dsinks = dsinks.flatten().to(sinks.dtype) if sinks is not None else None
    return (dq.flatten(1, 2).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype), dsinks)


class _Attention(torch.autograd.Function):
    """o = attention(q, k, v): the forward saves q, k, v, o, lse (and sinks), nothing N^2, and
    the backward is the function passed in: ``tiled_attention_backward`` or the kernels of part 2."""

    @staticmethod
    def forward(ctx, q, k, v, causal, window, sink_tokens, sinks, sm_scale, backward):
        o, lse = flash_attention(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens,
                                 sinks=sinks, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.options = dict(causal=causal, window=window, sink_tokens=sink_tokens, sm_scale=sm_scale)
        ctx.backward_fn = backward
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq, dk, dv, dsinks = ctx.backward_fn(q, k, v, o, lse, do, sinks=sinks, **ctx.options)
        return dq, dk, dv, None, None, None, dsinks, None, None


def tiled_attention(q, k, v, *, causal=False, window=None, sink_tokens=0, sinks=None, sm_scale=None):
    """Differentiable attention: the Triton forward, and ``tiled_attention_backward`` for the gradients.

    Slow (Python loops over tiles) but exact: the step before the Triton backward.
    """
    return _Attention.apply(q, k, v, causal, window, sink_tokens, sinks, sm_scale, tiled_attention_backward)


# =============================================================================================
# Part 2: the backward in Triton, three kernels (TODO 9b, 9c, 9d).
# =============================================================================================

# Tile shapes of the two backward kernels, (BLOCK_M, BLOCK_N, num_warps, num_stages), per padded
# head dim; the autotuner tries each row on long sequences (kernels/tuning.py) and the first
# entry is the default.  dK/dV keeps a tall key block resident and streams short query blocks
# past it; dQ the other way round (as Triton's fused-attention tutorial does).  Each program
# holds two float32 accumulators of its resident block (dk and dv, or dq and the q/dO tiles),
# so the resident side stays at 128 rows or less, and at D=256 smaller still.
DKDV_TILES_H100 = {
    64: [(32, 128, 4, 3), (32, 128, 4, 4), (64, 64, 4, 3), (32, 64, 4, 3), (16, 64, 4, 3)],
    128: [(32, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)],
    256: [(16, 64, 8, 1), (32, 64, 4, 2), (32, 64, 8, 1)],
}
DQ_TILES_H100 = {
    64: [(128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 4, 4)],
    128: [(128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    256: [(64, 16, 8, 1), (64, 32, 4, 2), (64, 32, 8, 1)],
}
# Smaller GPUs: the entries that fit, with a first entry that fits in float32 (see kernels/tuning.py;
# on a T4, dK/dV's D=256 tile does not fit in float32).
DKDV_TILES_BY_SMEM = {
    227 * 1024: DKDV_TILES_H100,
    163 * 1024: {64: DKDV_TILES_H100[64],
                 128: [(32, 64, 4, 3), (32, 128, 8, 2), (64, 128, 8, 3), (64, 128, 8, 2), (64, 64, 4, 3)],
                 256: [(16, 32, 4, 1), (16, 64, 8, 1), (32, 64, 4, 2), (32, 64, 8, 1)]},
    99 * 1024: {64: DKDV_TILES_H100[64],
                128: [(16, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 2)],
                256: [(16, 16, 4, 1), (16, 32, 4, 1), (16, 64, 8, 1)]},
    64 * 1024: {64: [(16, 32, 4, 1), (16, 64, 4, 2), (32, 64, 4, 2)],
                128: [(16, 32, 4, 1)],
                256: [(16, 16, 4, 1)]},
}
DQ_TILES_BY_SMEM = {
    227 * 1024: DQ_TILES_H100,
    163 * 1024: {64: DQ_TILES_H100[64],
                 128: [(64, 32, 4, 2), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2),
                       (64, 64, 4, 3)],
                 256: [(32, 16, 4, 1), (64, 16, 8, 1), (64, 32, 4, 2), (64, 32, 8, 1)]},
    99 * 1024: {64: DQ_TILES_H100[64],
                128: [(32, 32, 4, 1), (64, 32, 4, 2), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 4, 3),
                      (128, 64, 8, 2)],
                256: [(32, 16, 4, 1), (64, 16, 8, 1), (64, 32, 8, 1)]},
    64 * 1024: {64: [(32, 16, 4, 1), (64, 16, 4, 1), (64, 32, 4, 2)],
                128: [(32, 16, 4, 1), (32, 32, 4, 1)],
                256: [(16, 16, 4, 1)]},
}
DKDV_TILES = tuning.for_smem(DKDV_TILES_BY_SMEM, tuning.smem_per_block())   # this GPU's
DQ_TILES = tuning.for_smem(DQ_TILES_BY_SMEM, tuning.smem_per_block())
# The interpreter's tiles: small, so that tests with a few dozen rows still cross block edges.
DKDV_INTERPRETER_TILE = (32, 64, 4, 1)
DQ_INTERPRETER_TILE = (64, 32, 4, 1)
PREPROCESS_BLOCK_M = 128 if runtime.ON_GPU else 64     # delta's query block (its own kernel)


# The visibility rule and the block ranges, from each side.  Public: other backward kernels build
# on them, and must skip exactly the same tiles.

@triton.jit
def is_visible(rows, cols, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The forward's visibility rule, (rows, cols) booleans: may query row i see key j?

    Stage 8's _attention_mask with shift = N_K - N_Q: stage 5's _visible (j < N_K and, with
    CAUSAL, j <= i + shift, bottom-right aligned), and with HAS_WINDOW stage 7's _in_window,
    except for stage 8's sink tokens j < SINK_TOKENS.
    A (keys, queries) tile, as the dK/dV kernel holds, is its transpose.
    """
    return _attention_mask(rows, cols, N_K, N_K - N_Q, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW)


@triton.jit
def query_blocks_of(start_n, N_Q, N_K, WINDOW, SINK_TOKENS,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The query rows [lo, hi) that can see some key of the block starting at ``start_n``, and
    within them the blocks [full_lo, full_hi) that see every key of it (no mask needed).

    The forward's ranges seen from the key side.  Causal: the first query that sees key j is
    j - shift, shift = Nk - Nq, so start at the query block holding it (the diagonal) and go
    down; the block's last key is seen from row start_n + BLOCK_N - 1 - shift on.  A window:
    key j drops out of the window after query j - shift + W - 1, so stop there; the block's
    first key drops out first.  Sink tokens never drop out.
    """
    lo = 0
    hi = N_Q
    full_lo = 0
    full_hi = N_Q
    if CAUSAL:
        shift = N_K - N_Q
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.minimum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M, hi)
        if HAS_WINDOW:
            window_hi = tl.minimum(start_n + BLOCK_N - 1 - shift + WINDOW, N_Q)
            hi = tl.where(start_n < SINK_TOKENS, N_Q, window_hi)
            full_lo = tl.minimum(full_lo, hi)
            full_hi = tl.maximum(tl.minimum(tl.maximum(start_n - shift + WINDOW, 0) // BLOCK_M * BLOCK_M, hi),
                                 full_lo)
    return lo, full_lo, full_hi, hi


@triton.jit
def key_blocks_of(start_m, N_Q, N_K, WINDOW, SINK_TOKENS,
                  CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The keys the query block starting at ``start_m`` can see: the forward's ranges, stage 8's
    _key_ranges.  Sink-token blocks [0, sink_hi), then the causal (or windowed) range
    [lo, hi), and within it the blocks [full_lo, full_hi) that every row of the block sees
    whole (no mask needed).  The ranges never overlap: sink_hi <= lo <= full_lo <= full_hi <= hi.
    """
    shift = N_K - N_Q               # query row i sees key j iff j <= i + shift (bottom-right alignment)
    sink_hi, lo, full_lo, full_hi, hi = _key_ranges(start_m, N_K, shift, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL,
                                                    HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return sink_hi, lo, full_lo, full_hi, hi


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, LSE, DELTA, SINKS, DSINKS_PART,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_dob, stride_doh, stride_don, stride_dod,
    H, N_Q, HEAD_DIM,
    BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    pid_m = tl.program_id(0)        # which block of query rows
    pid_bh = tl.program_id(1)       # which (batch, query head)
    b = pid_bh // H
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = offs_m < N_Q
    tile_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od
    do_ptrs = DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod

    # TODO(9b): load the O and dO tiles (zeros outside), compute delta = rowsum(dO * O) in float32
    # and store it to DELTA[pid_bh * N_Q + row] for the real rows.  With learned sinks, also load
    # the rows' lse (natural log) and this head's sink logit, and store this block's share of the
    # sink gradient, -sum over rows of exp(sink - lse) * delta, to DSINKS_PART[pid_bh, pid_m]
    # (a (B*H, number of query blocks) buffer that the wrapper sums: deterministic, no atomics).
    pass


@triton.jit
def _dkdv_blocks(dk, dv, k, v, q_group, do_group, stride_qh, stride_doh, stride_qn, stride_don, LSE, DELTA,
                 stats_group, heads, offs_m, offs_n, d_ok, lo, hi, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale,
                 visits_group, n_key_blocks, full_lo, full_hi,
                 MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                 COUNT_VISITS: tl.constexpr):
    """dk += dS^T @ Q and dv += P^T @ dO over the query blocks [lo, hi) of ``heads`` query heads
    (the GQA group: q_group, do_group, stats_group and visits_group point at its first head),
    for one key block.

    MASKED=False is for query blocks whose every row sees every key of the block: no mask is
    built.  MASKED=True hides the keys a row cannot see (causal diagonal, window edge) in the
    blocks outside [full_lo, full_hi), the ones that see the whole key block.
    """
    # One flat loop over every (query head of the group, query block) pair, rather than a loop
    # over heads around a loop over blocks.  Triton overlaps the loads of the next tiles with the
    # arithmetic of this one only within the innermost loop, and under a window each head has just
    # a few query blocks to visit: nested, every head would pay the loop's start-up again.
    n_blocks = tl.maximum(tl.cdiv(hi - lo, BLOCK_M), 0)      # query blocks per head
    for i in range(0, heads * n_blocks):
        g = i // n_blocks                                     # the query head, within the group
        start_m = lo + (i - g * n_blocks) * BLOCK_M
        q_base = q_group + g * stride_qh                      # its Q, dO, and rows of LSE and DELTA
        do_base = do_group + g * stride_doh
        stats = stats_group + g * N_Q
        rows = start_m + offs_m
        row_ok = rows < N_Q
        # TODO(9c): load the Q and dO tiles of these query rows, their lse and delta.  Rebuild
        # the transposed probabilities pT = exp2(k @ q^T * qk_scale - lse * log2(e)), a
        # (BLOCK_N, BLOCK_M) tile, and in a MASKED block zero it where a key is not visible
        # (the transpose of is_visible(rows, offs_n, ...)).  Rows past N_Q: load their lse as
        # +inf, so p = 0.  A row that sees no key has lse = -inf: make it +inf too, so its p is
        # exp2(-inf - inf) = 0 and not exp2(-inf + inf) = NaN.
        # Then dv += pT @ dO, dpT = v @ dO^T, dsT = pT * (dpT - delta) and dk += dsT @ q
        # (cast pT and dsT to the inputs' dtype for tl.dot, as the forward casts p).
        pass
        if COUNT_VISITS:                                  # this program owns its column of the map
            tile = visits_group + (g * tl.cdiv(N_Q, BLOCK_M) + start_m // BLOCK_M) * n_key_blocks
            tl.store(tile, tl.load(tile) + 1)
    return dk, dv


@tuning.autotune(DKDV_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW", "SINK_TOKENS",
                                  "GROUP"])
@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, VISITS,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H_Q, H_KV, GROUP, N_Q, N_K, HEAD_DIM, WINDOW, SINK_TOKENS,
    sm_scale, qk_scale,             # qk_scale = sm_scale * log2(e): scores in base 2, as in the forward
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, COUNT_VISITS: tl.constexpr,
):
    sm_scale, qk_scale = tl.cast(sm_scale, tl.float32), tl.cast(qk_scale, tl.float32)  # float32 under torch.compile too
    pid_n = tl.program_id(0)        # which block of keys
    pid_bh = tl.program_id(1)       # which (batch, KV head)
    b = pid_bh // H_KV
    h_kv = pid_bh % H_KV
    start_n = pid_n * BLOCK_N

    offs_n = start_n + tl.arange(0, BLOCK_N)                  # key rows of this program
    offs_m = tl.arange(0, BLOCK_M)                            # query rows within a block
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    kv_ok = (offs_n < N_K)[:, None] & d_ok[None, :]
    k = tl.load(K + b * stride_kb + h_kv * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_ok, other=0.0)                        # (BLOCK_N, HEAD_DIM_PAD)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)

    # The query blocks to visit: masked [lo, full_lo), whole [full_lo, full_hi), masked [full_hi, hi)
    # (with a window: all of [lo, hi) masked, see below).
    lo, full_lo, full_hi, hi = query_blocks_of(start_n, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL,
                                               HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    n_key_blocks = tl.num_programs(0)
    h0 = h_kv * GROUP                                         # the first query head that reads this KV head
    q_group = Q + b * stride_qb + h0 * stride_qh + offs_d[None, :] * stride_qd
    do_group = DO + b * stride_dob + h0 * stride_doh + offs_d[None, :] * stride_dod
    stats_group = (b * H_Q + h0) * N_Q                        # its rows in LSE and DELTA; the next heads follow
    visits_group = VISITS + (b * H_Q + h0) * tl.cdiv(N_Q, BLOCK_M) * n_key_blocks + pid_n
    if HAS_WINDOW:
        # Under a window both ends of the range are masked: one loop that builds the mask only
        # in the blocks that need it (outside [full_lo, full_hi)) instead of three loops.
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_group, do_group, stride_qh, stride_doh, stride_qn, stride_don, LSE,
                              DELTA, stats_group, GROUP, offs_m, offs_n, d_ok, lo, hi, N_Q, N_K, WINDOW,
                              SINK_TOKENS, qk_scale, visits_group, n_key_blocks, full_lo, full_hi, MASKED=True,
                              HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, COUNT_VISITS=COUNT_VISITS)
    else:
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_group, do_group, stride_qh, stride_doh, stride_qn, stride_don, LSE,
                              DELTA, stats_group, GROUP, offs_m, offs_n, d_ok, lo, full_lo, N_Q, N_K, WINDOW,
                              SINK_TOKENS, qk_scale, visits_group, n_key_blocks, full_lo, full_hi, MASKED=True,
                              HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, COUNT_VISITS=COUNT_VISITS)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_group, do_group, stride_qh, stride_doh, stride_qn, stride_don, LSE,
                              DELTA, stats_group, GROUP, offs_m, offs_n, d_ok, full_lo, full_hi, N_Q, N_K, WINDOW,
                              SINK_TOKENS, qk_scale, visits_group, n_key_blocks, full_lo, full_hi, MASKED=False,
                              HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, COUNT_VISITS=COUNT_VISITS)
        dk, dv = _dkdv_blocks(dk, dv, k, v, q_group, do_group, stride_qh, stride_doh, stride_qn, stride_don, LSE,
                              DELTA, stats_group, GROUP, offs_m, offs_n, d_ok, full_hi, hi, N_Q, N_K, WINDOW,
                              SINK_TOKENS, qk_scale, visits_group, n_key_blocks, full_lo, full_hi, MASKED=True,
                              HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, COUNT_VISITS=COUNT_VISITS)

    dk = dk * sm_scale                                        # dS was taken w.r.t. the scaled scores
    tl.store(DK + b * stride_dkb + h_kv * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + b * stride_dvb + h_kv * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_blocks(dq, q, do, lse, delta, rows, k_base, v_base, stride_kn, stride_vn,
               lo, hi, N_Q, N_K, HEAD_DIM, WINDOW, SINK_TOKENS, qk_scale, visits_row,
               MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, COUNT_VISITS: tl.constexpr):
    """dq += dS @ K over the key blocks [lo, hi), for the query tile ``q``.

    MASKED=False is for key blocks that every row of the tile sees whole; MASKED=True hides
    keys past N_K and, with CAUSAL, keys a row cannot see.
    """
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = tl.arange(0, HEAD_DIM_PAD) < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N_K
        # TODO(9d): load the K and V tiles of these keys (zeros outside), rebuild
        # p = exp2(q @ k^T * qk_scale - lse * log2(e)) and, in a MASKED block, zero it where
        # is_visible(rows, cols, ...) is False (a key past N_K, after the row's diagonal or
        # outside its window).
        # Then dp = dO @ v^T, ds = p * (dp - delta) and dq += ds @ k.
        pass
        if COUNT_VISITS:
            tl.store(visits_row + start_n // BLOCK_N, tl.load(visits_row + start_n // BLOCK_N) + 1)
    return dq


@tuning.autotune(DQ_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW", "SINK_TOKENS",
                                "GROUP"])
@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, VISITS,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    H_Q, GROUP, N_Q, N_K, HEAD_DIM, WINDOW, SINK_TOKENS,
    sm_scale, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, COUNT_VISITS: tl.constexpr,
):
    sm_scale, qk_scale = tl.cast(sm_scale, tl.float32), tl.cast(qk_scale, tl.float32)  # float32 under torch.compile too
    pid_m = tl.program_id(0)        # which block of query rows
    pid_bh = tl.program_id(1)       # which (batch, query head)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    h_kv = h // GROUP               # GQA: the KV head this query head reads
    start_m = pid_m * BLOCK_M

    rows = start_m + tl.arange(0, BLOCK_M)
    stats = pid_bh * N_Q + rows                               # the rows' entries of LSE and DELTA
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = rows < N_Q
    tile_ok = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                mask=tile_ok, other=0.0)                      # (BLOCK_M, HEAD_DIM_PAD)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + offs_d[None, :] * stride_dod,
                 mask=tile_ok, other=0.0)
    lse = tl.load(LSE + stats, mask=row_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that sees nothing: p = 0, not NaN
    delta = tl.load(DELTA + stats, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    k_base = K + b * stride_kb + h_kv * stride_kh + offs_d[None, :] * stride_kd
    v_base = V + b * stride_vb + h_kv * stride_vh + offs_d[None, :] * stride_vd
    visits_row = VISITS + (pid_bh * tl.num_programs(0) + pid_m) * tl.cdiv(N_K, BLOCK_N)
    # The key blocks to visit: the sink tokens [0, sink_hi) and the window's leading edge
    # [lo, full_lo), masked; whole blocks [full_lo, full_hi); the diagonal band [full_hi, hi), masked.
    sink_hi, lo, full_lo, full_hi, hi = key_blocks_of(start_m, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL,
                                                      HAS_WINDOW=HAS_WINDOW, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    if sink_hi > 0:                                          # an empty range still costs a pipelined loop's set-up
        dq = _dq_blocks(dq, q, do, lse, delta, rows, k_base, v_base, stride_kn, stride_vn, 0, sink_hi, N_Q, N_K,
                        HEAD_DIM, WINDOW, SINK_TOKENS, qk_scale, visits_row, MASKED=True, BLOCK_N=BLOCK_N,
                        HEAD_DIM_PAD=HEAD_DIM_PAD, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, COUNT_VISITS=COUNT_VISITS)
    dq = _dq_blocks(dq, q, do, lse, delta, rows, k_base, v_base, stride_kn, stride_vn, lo, full_lo, N_Q, N_K,
                    HEAD_DIM, WINDOW, SINK_TOKENS, qk_scale, visits_row, MASKED=True, BLOCK_N=BLOCK_N,
                    HEAD_DIM_PAD=HEAD_DIM_PAD, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, COUNT_VISITS=COUNT_VISITS)
    dq = _dq_blocks(dq, q, do, lse, delta, rows, k_base, v_base, stride_kn, stride_vn, full_lo, full_hi, N_Q, N_K,
                    HEAD_DIM, WINDOW, SINK_TOKENS, qk_scale, visits_row, MASKED=False, BLOCK_N=BLOCK_N,
                    HEAD_DIM_PAD=HEAD_DIM_PAD, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, COUNT_VISITS=COUNT_VISITS)
    dq = _dq_blocks(dq, q, do, lse, delta, rows, k_base, v_base, stride_kn, stride_vn, full_hi, hi, N_Q, N_K,
                    HEAD_DIM, WINDOW, SINK_TOKENS, qk_scale, visits_row, MASKED=True, BLOCK_N=BLOCK_N,
                    HEAD_DIM_PAD=HEAD_DIM_PAD, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW, COUNT_VISITS=COUNT_VISITS)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows[:, None] * stride_dqn + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=tile_ok)


# The kernels that other code launches itself (solutions/attention_op/, under torch.compile),
# by public names: the forward's and the backward's three, the same objects as above.
flash_forward_kernel = _flash_forward_kernel
bwd_preprocess_kernel = _bwd_preprocess_kernel
bwd_dkdv_kernel = _bwd_dkdv_kernel
bwd_dq_kernel = _bwd_dq_kernel


def backward_preprocess(o, do, lse, sinks=None):
    """The backward's first kernel: ``(delta, dsinks)``, delta = rowsum(dO * O) as (B, Hq, Nq)
    float32 and the learned sinks' gradient like ``sinks`` (None without)."""
    B, Hq, Nq, D = o.shape
    pre_m = PREPROCESS_BLOCK_M
    delta = torch.empty(B, Hq, Nq, device=o.device, dtype=torch.float32)          # (B, Hq, Nq)
    dsinks_part = torch.empty(B, Hq, triton.cdiv(Nq, pre_m), device=o.device, dtype=torch.float32)
    _bwd_preprocess_kernel[(triton.cdiv(Nq, pre_m), B * Hq)](
        o, do, lse, delta, sinks if sinks is not None else delta, dsinks_part,
        *o.stride(), *do.stride(), Hq, Nq, D,
        BLOCK_M=pre_m, HEAD_DIM_PAD=triton.next_power_of_2(D), HAS_SINKS=sinks is not None)
    dsinks = dsinks_part.sum(dim=(0, 2)).to(sinks.dtype) if sinks is not None else None
    return delta, dsinks


def flash_attention_backward(q, k, v, o, lse, do, *, causal=False, window=None, sink_tokens=0, sinks=None,
                             sm_scale=None, return_visits=False):
    """Gradients ``(dq, dk, dv, dsinks)`` of ``o`` from the forward's ``o`` and ``lse`` and ``do``.

    Nothing of size Nq x Nk is ever allocated: extra memory is delta (B, Hq, Nq) float32 and a
    few floats per query block for the sink gradient.

    ``return_visits=True`` also returns, for each kernel, how many times it processed each
    (query block, key block) tile of each (batch, query head), as a dict: ``"dkdv"`` and
    ``"dq"`` int32 tensors (B, Hq, query blocks, key blocks), each in its kernel's tile shape
    ``"dkdv_blocks"`` and ``"dq_blocks"`` (BLOCK_M, BLOCK_N).  The tests and the notebook's
    pictures use them to see which blocks are skipped.

    Args:
        q, k, v: the forward's inputs: q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D), Hq % Hkv == 0,
            any strides; float16 or float32 (and bfloat16 on a GPU); 16 <= D <= 256.
        o, lse: the forward's outputs, o (B, Hq, Nq, D) and lse (B, Hq, Nq) float32 in natural log.
        do: (B, Hq, Nq, D), the gradient of the loss with respect to o.
        causal, window, sink_tokens, sm_scale: as for ``flash_attention``: the diagonal aligned
            bottom-right, W >= 1 most recent keys (needs causal) or None, S >= 0 sink tokens, the
            scores' scale (None: ``1 / sqrt(D)``).
        sinks: (Hq,) float32 learned sink logits the forward used, or None.
        return_visits: also return the dict of visit counts described above (the tiles are then
            never autotuned).

    Returns:
        ``(dq, dk, dv, dsinks)``, with the dict last when ``return_visits``: dq like q, dk and dv
        like k and v (shape, dtype, strides), dsinks (Hq,) in sinks's dtype or None without sinks.
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(
        q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, sm_scale=sm_scale,
        head_dims=HEAD_DIMS)
    runtime.check_dtype(q.dtype)
    if do.shape != q.shape:
        raise ValueError(f"do must have o's shape {tuple(q.shape)}, got {tuple(do.shape)}")
    head_dim_pad = triton.next_power_of_2(D)
    tuning.check_fits(q.dtype, head_dim_pad, kernels="stage 9's dK/dV kernel")   # a T4 and float32 at D 256
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    group = Hq // Hkv
    has_window = window is not None
    flags = dict(CAUSAL=causal, HAS_WINDOW=has_window, HEAD_DIM_PAD=head_dim_pad, COUNT_VISITS=return_visits)
    w, s_tok = (window if has_window else 0), sink_tokens
    # Each kernel's tile: timed by the autotuner on a GPU for long sequences (kernels/tuning.py).
    dkdv_kernel, dkdv_tile = tuning.plan(_bwd_dkdv_kernel, DKDV_TILES, head_dim_pad, Nq, Nk,
                                         interpreter_tile=DKDV_INTERPRETER_TILE, counting=return_visits)
    dq_kernel, dq_tile = tuning.plan(_bwd_dq_kernel, DQ_TILES, head_dim_pad, Nq, Nk,
                                     interpreter_tile=DQ_INTERPRETER_TILE, counting=return_visits)

    # 1. delta = rowsum(dO * O), and the learned sinks' gradient.
    delta, dsinks = backward_preprocess(o, do, lse, sinks)

    visits_dkdv = visits_dq = delta                                   # placeholders, never touched
    if return_visits:
        (bm1, bn1), (bm2, bn2) = (dkdv_tile["BLOCK_M"], dkdv_tile["BLOCK_N"]), (dq_tile["BLOCK_M"], dq_tile["BLOCK_N"])
        visits_dkdv = torch.zeros(B, Hq, triton.cdiv(Nq, bm1), triton.cdiv(Nk, bn1), device=q.device, dtype=torch.int32)
        visits_dq = torch.zeros(B, Hq, triton.cdiv(Nq, bm2), triton.cdiv(Nk, bn2), device=q.device, dtype=torch.int32)

    # 2. dK and dV: one program per (key block, batch x KV head).
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dkdv_kernel[lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * Hkv)](
        q, k, v, do, dk, dv, lse, delta, visits_dkdv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        Hq, Hkv, group, Nq, Nk, D, w, s_tok, scale, scale * LOG2E, **flags, **dkdv_tile)

    # 3. dQ: one program per (query block, batch x query head).
    dq = torch.empty_like(q)
    dq_kernel[lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"]), B * Hq)](
        q, k, v, do, dq, lse, delta, visits_dq,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
        Hq, group, Nq, Nk, D, w, s_tok, scale, scale * LOG2E, **flags, **dq_tile)
    if return_visits:
        return dq, dk, dv, dsinks, {"dkdv": visits_dkdv, "dq": visits_dq,
                                    "dkdv_blocks": (bm1, bn1), "dq_blocks": (bm2, bn2)}
    return dq, dk, dv, dsinks


def attention(q, k, v, *, causal=False, window=None, sink_tokens=0, sinks=None, sm_scale=None):
    """Differentiable FlashAttention: ``o``, with gradients for q, k, v and sinks.

    The forward is ``flash_attention``; the backward, ``flash_attention_backward``.  The options
    are the forward's; kernels/reference.py specifies them.

    Args:
        q: (B, Hq, Nq, D) queries, any strides; float16 or float32 (and bfloat16 on a GPU);
            16 <= D <= 256.
        k, v: (B, Hkv, Nk, D) keys and values: q's batch, head dim, dtype and device; Hq % Hkv == 0,
            query head h reads K/V head h // (Hq // Hkv); Nk >= 1.
        causal, window, sink_tokens, sm_scale: as for ``flash_attention``: the diagonal aligned
            bottom-right, W >= 1 most recent keys (needs causal) or None, S >= 0 sink tokens, the
            scores' scale (None: ``1 / sqrt(D)``).
        sinks: (Hq,) float32 learned sink logits on q's device, or None.

    Returns:
        o (B, Hq, Nq, D) in q's dtype; lse is kept for the backward, not returned.
    """
    return _Attention.apply(q, k, v, causal, window, sink_tokens, sinks, sm_scale, flash_attention_backward)



# =============================================================================================
# Part 3: your attention as a PyTorch operator (TODO 9e, 9f).
# =============================================================================================
# torch.compile turns a model into graphs it can optimise as a whole. It cannot look inside a
# Triton launch behind an autotuner, and without help it stops the graph there (a "graph break").
# A custom operator is a contract that lets it keep your kernels as one step of the graph:
#   * a schema, read from the type hints: what goes in and what comes out;
#   * a fake implementation: the outputs' shapes, dtypes and device, computed without running
#     anything (the compiler traces with fake tensors, which have no numbers);
#   * an autograd rule: what to keep after the forward, and the backward that uses it.

LIBRARY = runtime.op_library("stage9")      # the ops are torch.ops.<LIBRARY>.attention_forward, ...


@torch.library.custom_op(f"{LIBRARY}::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                      causal: bool, window: int | None, sink_tokens: int,
                      sm_scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The operator's real work: your forward kernel. Returns ``(o, lse)``."""
    return flash_attention(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks,
                           sm_scale=sm_scale)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, sinks, causal, window, sink_tokens, sm_scale):
    """What the forward returns, made without running it."""
    # TODO(9e): return (o, lse) as empty tensors exactly like the real forward's: o like q, and
    # lse of shape (B, Hq, Nq) in float32 on q's device (q.new_empty keeps the device).
    pass


@torch.library.custom_op(f"{LIBRARY}::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor, sinks: torch.Tensor | None, causal: bool, window: int | None,
                       sink_tokens: int, sm_scale: float | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Your backward kernels. An operator returns tensors, never None: without learned sinks,
    dsinks comes back empty."""
    dq, dk, dv, dsinks = flash_attention_backward(q, k, v, o, lse, do, causal=causal, window=window,
                                                  sink_tokens=sink_tokens, sinks=sinks, sm_scale=sm_scale)
    return dq, dk, dv, dsinks if dsinks is not None else q.new_empty(0, dtype=torch.float32)


@attention_backward.register_fake
def _attention_backward_fake(q, k, v, o, lse, do, sinks, causal, window, sink_tokens, sm_scale):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx, inputs, output):
    """Runs after the forward: keep what the backward needs (nothing of size Nq x Nk)."""
    # TODO(9f): inputs are the forward's arguments in order, output is its (o, lse). Save the
    # tensors q, k, v, o, lse and sinks with ctx.save_for_backward, and keep the options as
    # ctx.options = (causal, window, sink_tokens, sm_scale) for _backward below.
    pass


def _backward(ctx, do, dlse):
    """One gradient per input of the forward, in order; None for the options. (``dlse`` is the
    gradient of lse, which ``attention_op`` does not return: nothing flows through it.)"""
    q, k, v, o, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(q, k, v, o, lse, do, sinks, *ctx.options)
    return dq, dk, dv, (dsinks if sinks is not None else None), None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup_context)


def attention_op(q, k, v, *, causal=False, window=None, sink_tokens=0, sinks=None, sm_scale=None):
    """``attention`` through your operators: the same kernels and gradients, and a model that calls
    it compiles with ``torch.compile(model, fullgraph=True)``.

    Args:
        q, k, v, causal, window, sink_tokens, sinks, sm_scale: as for ``attention``.

    Returns:
        o (B, Hq, Nq, D) in q's dtype, differentiable in q, k, v and sinks.
    """
    o, _ = attention_forward(q, k, v, sinks, causal, window, sink_tokens, sm_scale)
    return o

