"""Stage 9's backward with Hopper's tensor memory accelerator: the fast variant, beside the readable one.

Which is which
--------------
``solutions/stage9_backward.py`` is the model answer: three kernels (a preprocess for delta,
dK/dV, dQ), every tile loaded with ``tl.load`` from a pointer grid.  This file computes the same
gradients (dq, dk, dv and the learned sinks' dsinks; causal bottom-right, GQA/MQA, sliding
windows, sink tokens) and differs only where speed and the lesson pull apart:

* **TMA descriptors in the loops.**  The dK/dV kernel loads a Q and a dO tile for every
  (head, query block) it visits, and the dQ kernel a K and a V tile for every key block: those
  come through descriptors, ``desc_q.load([batch_head, start_m, 0])``, whole tiles moved into
  shared memory by the copy engine with zeros past the end.  As in the TMA forward, the
  descriptors take the tensors' own strides, and are made once on the host (``HOST_DESC``), or
  by each program (``tl.make_tensor_descriptor``) where the op's kernels run under
  ``torch.compile``.
* **The row statistics through descriptors too.**  The dK/dV kernel also needs each query
  block's lse and delta, a few floats per row.  Read with ``tl.load`` they are the one load in
  its loop that Triton's pipeline does not run ahead, so every visit would wait for them; as
  (batch x head, Nq) descriptors they arrive with the tiles.  A TMA row must start on 16
  bytes, so when Nq is not a multiple of 4 the two are first copied into rows padded to one
  (see ``_stat_rows``).
* **Still three kernels.**  Folding the preprocess into the dQ kernel (which holds dO anyway:
  load O beside it, compute delta there and run dK/dV second) saves a pass over O and dO, but
  it is slower under sliding windows, where each program visits few blocks.  So stage 9's
  preprocess runs first, as there.
* **One flat loop over a GQA group in dK/dV.**  Stage 9 loops over the group's query heads and,
  inside, over query blocks; here one loop walks every (head, query block) pair, so a pipelined
  loop's set-up (its first loads, before any overlap) is paid once rather than once per head
  (docs/stage9-notes.md).
* **A GQA group packed into one dQ tile.**  Stage 9's dQ program takes one query head; here it
  takes ``PACK`` heads of a group (2, 4 or 8) at the same positions.  They read the same keys and
  the mask depends on the position alone, so fewer of the tile's key blocks need a mask.
* **Tiles for these loops.**  Without per-element address arithmetic, larger dQ tiles pay at
  D64 (see DQ_TILES).
* **Fewer choices.**  Head dims must be powers of two from 16 to 256, and a tensor is copied
  first unless a TMA descriptor can read it where it lies (``tma_compatible`` in the forward's
  file); no visit counting (``grader.isolation.harness.backward_visits`` shows stage 9's
  skipping).

The preprocess, the block ranges and the visibility rule are stage 9's own, through its public
names (``backward_preprocess``, ``query_blocks_of``, ``key_blocks_of``, ``is_visible``): the two
backwards skip the same tiles by construction, and a change to stage 9's rule reaches both.
``flash_attention`` is the TMA forward (solutions/fast_forward_tma.py), re-exported so that this
file runs forward and backward.
``python -m grader bench stage9`` times the pair as ``solution-tma``.
"""

from __future__ import annotations

import math
from pathlib import Path

from kernels import runtime, tuning, validate
from kernels.loader import load_file

import torch
import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

_HERE = Path(__file__).resolve().parent
_stage9 = load_file(_HERE / "stage9_backward.py")
_forward = load_file(_HERE / "fast_forward_tma.py")
is_visible = _stage9.is_visible
query_blocks_of = _stage9.query_blocks_of
key_blocks_of = _stage9.key_blocks_of
flash_attention = _forward.flash_attention
tiles_of = _forward.tiles_of

LOG2E = 1.4426950408889634   # log2(e): exp(x) == exp2(x * LOG2E)
HEAD_DIMS = (16, 256)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim, as in stage 9; the first entry is used
# untimed on short sequences.  At D64 under a window, with these loops, 128 x 64 beats 128 x 32
# for dQ, and 64 x 64 with 3 or 4 stages beats 32 x 64 for dK/dV once lse and delta come through
# descriptors: the autotuner has both to choose from.
DKDV_TILES = {
    64: [(32, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 4), (32, 128, 4, 3),
         (32, 128, 4, 4)],
    128: [(64, 128, 8, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 3), (32, 64, 4, 3)],
    256: [(16, 64, 8, 1), (32, 64, 4, 2), (32, 64, 8, 1)],
}
DQ_TILES = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (64, 32, 4, 3), (64, 128, 4, 3), (128, 32, 4, 3)],
    128: [(128, 32, 4, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (64, 64, 4, 3)],
    256: [(64, 16, 8, 1), (64, 32, 4, 2), (64, 32, 8, 1)],
}
DKDV_INTERPRETER_TILE = (32, 64, 4, 1)
DQ_INTERPRETER_TILE = (64, 32, 4, 1)


def dkdv_descriptors(q, do, lse_rows, delta_rows, shape: tuple, q_strides: tuple, do_strides: tuple,
                     block_m: int) -> tuple | None:
    """``(Q's, dO's, lse's, delta's)`` TMA descriptors made on the host for the dK/dV kernel: q and
    do ``shape`` (B, Hq, Nq, D) with the given strides, lse and delta as (B x Hq, Nq) rows
    (``_stat_rows``), all in tiles of ``block_m`` positions.  None for an empty tensor."""
    if 0 in shape:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    b, h, n, d = shape
    tiles = [TensorDescriptor(x, [b, h, n, d], list(st), [1, 1, block_m, int(d)]) for x, st in ((q, q_strides),
                                                                                        (do, do_strides))]
    return (*tiles, *(TensorDescriptor(x, [b * h, n], [x.stride(0), 1], [1, block_m]) for x in (lse_rows, delta_rows)))


def _dkdv_descriptor_tiles(nargs: dict) -> None:
    """The dK/dV autotuner's hook before each configuration: host-made descriptors take its query block."""
    if nargs.get("HOST_DESC"):
        for name in ("Q", "DO"):
            nargs[name].block_shape = [1, 1, nargs["BLOCK_M"], nargs["HEAD_DIM_PAD"]]
        for name in ("LSE", "DELTA"):
            nargs[name].block_shape = [1, nargs["BLOCK_M"]]


@triton.jit
def _dkdv_loop(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, b, h0, H_Q, heads, offs_m, offs_n, lo, hi, full_lo,
               full_hi, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale,
               MASKED: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """dk += dS^T Q and dv += P^T dO over query blocks [lo, hi) of ``heads`` heads from head h0 of batch b.

    One loop over every (head, query block) pair; with MASKED the mask is built only in blocks
    outside [full_lo, full_hi).
    """
    n_blocks = tl.cdiv(hi - lo, BLOCK_M)
    for i in range(0, heads * n_blocks):
        g = i // n_blocks
        start_m = lo + (i - g * n_blocks) * BLOCK_M
        rows = start_m + offs_m
        # Past N_Q every tile comes back as zeros: q = do = 0 there, so with lse = delta = 0 a
        # row past the end has p = 1 and dS = 0, and adds nothing to dk or dv.
        q = desc_q.load([b, h0 + g, start_m, 0]).reshape(BLOCK_M, HEAD_DIM_PAD)
        do = desc_do.load([b, h0 + g, start_m, 0]).reshape(BLOCK_M, HEAD_DIM_PAD)
        lse = desc_lse.load([b * H_Q + h0 + g, start_m]).reshape(BLOCK_M)
        lse = tl.where(lse == float("-inf"), float("inf"), lse)                     # empty rows: p = 0
        delta = desc_delta.load([b * H_Q + h0 + g, start_m]).reshape(BLOCK_M)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale                                     # (BLOCK_N, BLOCK_M)
        if MASKED:
            if (start_m < full_lo) | (start_m >= full_hi):
                seen = is_visible(rows, offs_n, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL=True, HAS_WINDOW=HAS_WINDOW)
                s_t = tl.where(tl.trans(seen), s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse[None, :] * 1.4426950408889634)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@tuning.autotune(DKDV_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW", "SINK_TOKENS",
                                  "GROUP"], pre_hook=_dkdv_descriptor_tiles)
@triton.jit
def _tma_dkdv_kernel(
    Q, DO, LSE, DELTA, K, V, DK, DV,             # q, do (B, Hq, N_Q, D), k, v, dk, dv (B, Hkv, N_K, D): any strides
    #                                              (with HOST_DESC, Q, DO, LSE and DELTA are their descriptors)
    stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don, STAT_STRIDE,   # LSE, DELTA (B*Hq, N_Q)
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    B, H_Q, H_KV, GROUP, N_Q, N_K, WINDOW, SINK_TOKENS, sm_scale, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HOST_DESC: tl.constexpr = False,
):
    sm_scale, qk_scale = tl.cast(sm_scale, tl.float32), tl.cast(qk_scale, tl.float32)  # float32 under torch.compile
    pid_n = tl.program_id(0)                     # which block of keys
    kv_bh = tl.program_id(1)                     # which (batch x KV head)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    b = kv_bh // H_KV
    kv_h = kv_bh % H_KV
    rows_n = offs_n.to(tl.int64)[:, None]
    kv_ok = (offs_n < N_K)[:, None]
    k = tl.load(K + b.to(tl.int64) * stride_kb + kv_h * stride_kh + rows_n * stride_kn + offs_d[None, :],
                mask=kv_ok, other=0.0)
    v = tl.load(V + b.to(tl.int64) * stride_vb + kv_h * stride_vh + rows_n * stride_vn + offs_d[None, :],
                mask=kv_ok, other=0.0)
    if HOST_DESC:
        desc_q = Q
        desc_do = DO
        desc_lse = LSE
        desc_delta = DELTA
    else:
        desc_q = tiles_of(Q, B, H_Q, N_Q, stride_qb, stride_qh, stride_qn, BLOCK_M, HEAD_DIM_PAD)
        desc_do = tiles_of(DO, B, H_Q, N_Q, stride_dob, stride_doh, stride_don, BLOCK_M, HEAD_DIM_PAD)
        desc_lse = tl.make_tensor_descriptor(LSE, shape=[B * H_Q, N_Q], strides=[STAT_STRIDE, 1],
                                             block_shape=[1, BLOCK_M])
        desc_delta = tl.make_tensor_descriptor(DELTA, shape=[B * H_Q, N_Q], strides=[STAT_STRIDE, 1],
                                               block_shape=[1, BLOCK_M])
    dk = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM_PAD], dtype=tl.float32)

    lo, full_lo, full_hi, hi = query_blocks_of(start_n, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL, HAS_WINDOW,
                                               BLOCK_M, BLOCK_N)
    h0 = kv_h * GROUP                            # the first query head of the group
    if HAS_WINDOW:                               # both ends masked: one loop, masks only at the ends
        dk, dv = _dkdv_loop(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, b, h0, H_Q, GROUP, offs_m, offs_n,
                            lo, hi, full_lo, full_hi, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale, True, HAS_WINDOW,
                            BLOCK_M, HEAD_DIM_PAD)
    else:
        dk, dv = _dkdv_loop(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, b, h0, H_Q, GROUP, offs_m, offs_n,
                            lo, full_lo, full_lo, full_hi, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale, True, HAS_WINDOW,
                            BLOCK_M, HEAD_DIM_PAD)
        dk, dv = _dkdv_loop(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, b, h0, H_Q, GROUP, offs_m, offs_n,
                            full_lo, full_hi, full_lo, full_hi, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale, False,
                            HAS_WINDOW, BLOCK_M, HEAD_DIM_PAD)
        dk, dv = _dkdv_loop(dk, dv, k, v, desc_q, desc_do, desc_lse, desc_delta, b, h0, H_Q, GROUP, offs_m, offs_n,
                            full_hi, hi, full_lo, full_hi, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale, True, HAS_WINDOW,
                            BLOCK_M, HEAD_DIM_PAD)
    dk_rows = DK + b.to(tl.int64) * stride_dkb + kv_h * stride_dkh + rows_n * stride_dkn + offs_d[None, :]
    dv_rows = DV + b.to(tl.int64) * stride_dvb + kv_h * stride_dvh + rows_n * stride_dvn + offs_d[None, :]
    tl.store(dk_rows, (dk * sm_scale).to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(dv_rows, dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_loop(dq, q, do, lse, delta, pos, desc_k, desc_v, b, kv_h, lo, hi, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
             HEAD_DIM_PAD: tl.constexpr):
    """dq += dS K over the key blocks [lo, hi); ``pos`` is each row's query position."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        k = desc_k.load([b, kv_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)           # zeros past N_K
        v = desc_v.load([b, kv_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            seen = is_visible(pos, start_n + offs_n, N_Q, N_K, WINDOW, SINK_TOKENS,
                              CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW)
            s = tl.where(seen, s, float("-inf"))
        p = tl.exp2(s - lse[:, None] * 1.4426950408889634)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@tuning.autotune(DQ_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW", "SINK_TOKENS", "GROUP",
                                "PACK"], pre_hook=_forward._descriptor_tiles)
@triton.jit
def _tma_dq_kernel(
    K, V, Q, DO, DQ, LSE, DELTA,                 # q, do, dq (B, Hq, N_Q, D), k, v (B, Hkv, N_K, D): any strides
    #                                              (with HOST_DESC, K and V are their descriptors)
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_qb, stride_qh, stride_qn, stride_dob, stride_doh, stride_don, stride_dqb, stride_dqh, stride_dqn,
    B, H_Q, GROUP, N_Q, N_K, WINDOW, SINK_TOKENS, sm_scale, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PACK: tl.constexpr, HOST_DESC: tl.constexpr = False,
):
    # A program takes PACK query heads of one GQA group at ROWS positions: row r is head
    # h0 + r // ROWS of batch b at position start_m + r % ROWS.
    ROWS: tl.constexpr = BLOCK_M // PACK
    sm_scale, qk_scale = tl.cast(sm_scale, tl.float32), tl.cast(qk_scale, tl.float32)  # float32 under torch.compile
    pid_m = tl.program_id(0)
    pid_hp = tl.program_id(1)
    b = pid_hp // (H_Q // PACK)
    h0 = pid_hp % (H_Q // PACK) * PACK
    kv_h = h0 // GROUP
    start_m = pid_m * ROWS
    r = tl.arange(0, BLOCK_M)
    pos = start_m + r % ROWS
    h = h0 + r // ROWS
    row_ok = pos < N_Q
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    stats = (b * H_Q + h) * N_Q + pos                        # this row's entry of LSE and DELTA
    b64, pos64 = b.to(tl.int64), pos.to(tl.int64)[:, None]
    q = tl.load(Q + b64 * stride_qb + h[:, None] * stride_qh + pos64 * stride_qn + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + b64 * stride_dob + h[:, None] * stride_doh + pos64 * stride_don + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + stats, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + stats, mask=row_ok, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a row that sees nothing: p = 0, not NaN

    if HOST_DESC:
        desc_k = K
        desc_v = V
    else:
        desc_k = tiles_of(K, B, H_Q // GROUP, N_K, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_DIM_PAD)
        desc_v = tiles_of(V, B, H_Q // GROUP, N_K, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_DIM_PAD)

    dq = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    sink_hi, lo, full_lo, full_hi, hi = key_blocks_of(start_m, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL, HAS_WINDOW,
                                                      ROWS, BLOCK_N)
    if sink_hi > 0:
        dq = _dq_loop(dq, q, do, lse, delta, pos, desc_k, desc_v, b, kv_h, 0, sink_hi, N_Q, N_K, WINDOW, SINK_TOKENS,
                      qk_scale, True, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM_PAD)
    dq = _dq_loop(dq, q, do, lse, delta, pos, desc_k, desc_v, b, kv_h, lo, full_lo, N_Q, N_K, WINDOW, SINK_TOKENS,
                  qk_scale, True, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM_PAD)
    dq = _dq_loop(dq, q, do, lse, delta, pos, desc_k, desc_v, b, kv_h, full_lo, full_hi, N_Q, N_K, WINDOW, SINK_TOKENS,
                  qk_scale, False, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM_PAD)
    dq = _dq_loop(dq, q, do, lse, delta, pos, desc_k, desc_v, b, kv_h, full_hi, hi, N_Q, N_K, WINDOW, SINK_TOKENS,
                  qk_scale, True, CAUSAL, HAS_WINDOW, BLOCK_N, HEAD_DIM_PAD)
    dq_rows = DQ + b64 * stride_dqb + h[:, None] * stride_dqh + pos64 * stride_dqn + offs_d[None, :]
    tl.store(dq_rows, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


def _stat_rows(x: torch.Tensor, rows: int, n: int) -> torch.Tensor:
    """x (rows * n float32, contiguous) as a (rows, n) view whose rows start on 16 bytes, as a TMA descriptor needs.

    When n is not a multiple of 4, or x itself starts off 16 bytes (a caller's slice), the rows
    are copied into a buffer padded to a multiple of 4; the descriptor's shape stays (rows, n),
    so the padding is never read.
    """
    if n % 4 == 0 and _forward.starts_on_16_bytes(x):
        return x.view(rows, n)
    padded = x.new_empty(rows, (n + 3) // 4 * 4)[:, :n]
    padded.copy_(x.view(rows, n))
    return padded


def flash_attention_backward(q, k, v, o, lse, do, *, causal=False, window=None, sink_tokens=0, sinks=None,
                             sm_scale=None, block_m=None, block_n=None, host_descriptors=True):
    """Gradients ``(dq, dk, dv, dsinks)``, as stage 9's ``flash_attention_backward``.

    q, o, do: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D); lse: (B, Hq, Nq) float32 from the forward;
    D a power of two from 16 to 256.  ``block_m``/``block_n`` fix the dQ kernel's tile (for tests);
    ``host_descriptors=False`` has the kernels make their descriptors themselves, as the op's do
    under ``torch.compile`` where torch cannot pass host-made ones into a graph.
    Extra memory: delta (B, Hq, Nq) float32 and a few floats per query block for dsinks (and, when Nq
    is not a multiple of 4, padded copies of lse and delta: see _stat_rows).
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens,
                                                      sinks=sinks, sm_scale=sm_scale, head_dims=HEAD_DIMS)
    if D & (D - 1):
        raise ValueError(f"head_dim is {D}: the TMA variant takes head dims that are powers of two (a TMA tile has "
                         f"no padding columns); stage 9's flash_attention_backward pads the others")
    runtime.check_dtype(q.dtype)
    validate.backward_inputs(q, o, lse, do)
    if not isinstance(host_descriptors, bool):
        raise TypeError(f"host_descriptors must be True or False, got {host_descriptors!r}")
    block_m = validate.block_size(block_m, "block_m") if block_m is not None else None
    block_n = validate.block_size(block_n, "block_n") if block_n is not None else None
    group = Hq // Hkv
    pack = tuning.gqa_pack(group)                           # 1, 2, 4 or 8: a block_m (>= 16) holds whole groups
    q, k, v, do = (_forward.tma_ready(x) for x in (q, k, v, do))   # o: only the preprocess reads it, by strides
    lse = lse.contiguous()                       # stage 9's preprocess indexes it as (B * Hq * Nq)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    has_window = window is not None
    w = window if has_window else 0
    s_tok = sink_tokens if has_window else 0               # without a window every earlier key is seen
    flags = dict(CAUSAL=causal, HAS_WINDOW=has_window, HEAD_DIM_PAD=D)   # D is a power of two: no padding
    dkdv_kernel, dkdv_tile = tuning.plan(_tma_dkdv_kernel, DKDV_TILES, D, Nq, Nk,
                                         interpreter_tile=DKDV_INTERPRETER_TILE)
    dq_kernel, dq_tile = tuning.plan(_tma_dq_kernel, DQ_TILES, D, Nq, Nk, interpreter_tile=DQ_INTERPRETER_TILE,
                                     block_m=block_m, block_n=block_n)

    # 1. delta = rowsum(dO * O) and the learned sinks' gradient: stage 9's preprocess.
    delta, dsinks = _stage9.backward_preprocess(o, do, lse, sinks)

    # 2. dK and dV: one program per (key block, batch x KV head), over the group's query heads.
    lse_rows, delta_rows = (_stat_rows(x, B * Hq, Nq) for x in (lse, delta))    # one row stride for both
    runtime.tma_scratch()                        # the descriptors a kernel makes live in scratch memory
    dk, dv = torch.empty_like(k), torch.empty_like(v)                         # k's and v's strides
    # The autotuners' hooks give host-made descriptors each configuration's tile.
    made = host_descriptors and dkdv_descriptors(q, do, lse_rows, delta_rows, (B, Hq, Nq, D), q.stride(), do.stride(),
                                                 dkdv_tile.get("BLOCK_M", 16))
    dkdv_kernel[lambda meta: (triton.cdiv(Nk, meta["BLOCK_N"]), B * Hkv)](
        *(made[:2] if made else (q, do)), *(made[2:] if made else (lse_rows, delta_rows)), k, v, dk, dv,
        *q.stride()[:3], *do.stride()[:3], lse_rows.stride(0),
        *k.stride()[:3], *v.stride()[:3], *dk.stride()[:3], *dv.stride()[:3],
        B, Hq, Hkv, group, Nq, Nk, w, s_tok, scale, scale * LOG2E, HOST_DESC=bool(made), **flags, **dkdv_tile)

    # 3. dQ: one program per (block of positions, batch x PACK query heads of a group).
    dq = torch.empty_like(q)                                                  # q's strides
    made = host_descriptors and _forward.kv_descriptors(k, v, (B, Hkv, Nk, D), k.stride(), v.stride(),
                                                        dq_tile.get("BLOCK_N", 16))
    dq_kernel[lambda meta: (triton.cdiv(Nq, meta["BLOCK_M"] // pack), B * Hq // pack)](
        *(made or (k, v)), q, do, dq, lse, delta, *k.stride()[:3], *v.stride()[:3], *q.stride()[:3], *do.stride()[:3],
        *dq.stride()[:3], B, Hq, group, Nq, Nk, w, s_tok, scale, scale * LOG2E, PACK=pack, HOST_DESC=bool(made),
        **flags, **dq_tile)
    return dq, dk, dv, dsinks
