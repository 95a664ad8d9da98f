"""The forward of stages 5-8 with Hopper's tensor memory accelerator: the fast variant, beside the readable one.

Which is which
--------------
``solutions/stage8_sinks.py`` is the model answer: every tile is loaded with ``tl.load`` from a
pointer grid (base + rows * stride + columns), with a mask on every edge, and that is the code a
learner writes.  This file computes the same attention (causal aligned bottom-right, GQA/MQA,
sliding windows, sink tokens, learned sinks; o and lse) and differs only where speed and the
lesson pull apart:

* **TMA descriptors for K and V.**  A descriptor says where a tensor lies (base, shape
  (B, H, N, D), strides, tile shape), and the kernel asks for tiles by coordinate,
  ``desc_k.load([batch, kv_head, start_n, 0])``.  On a Hopper GPU the copy engine (TMA) moves
  the whole tile into shared memory: no address arithmetic in the kernel's threads, no
  per-element masks.  Rows past the end of a tensor come back as zeros, so only the masked
  blocks (the diagonal, the window's edge, the last partial block) have to hide keys past N_k.
  The descriptors take the tensors' own strides, so (B, N, H, D) tensors seen as (B, H, N, D)
  views are read where they lie, without a copy.
* **Descriptors made once, on the host** (``HOST_DESC``, ``host_descriptors``).  A descriptor
  made in the kernel (``tl.make_tensor_descriptor``) is written to global memory and fenced by
  every program before its first load; a short window's program has only a few key blocks to
  spread that over, and at window 128 it cost a fifth of the forward's time.  So calls made
  here, and the op's calls, eager or compiled, pass K's and V's descriptors made on the host
  (``TensorDescriptor``), once per launch (solutions/attention_op/launch.py says how a compiled
  graph gets them).  q and o, read and written once per program, go through pointers.
* **Packed GQA heads.**  The query heads of a GQA group read the same keys, and the mask depends
  on the position alone.  So one program takes the whole group (2, 4 or 8 heads) at a quarter
  (half, eighth) of the positions: a 128-row tile is 4 heads x 32 positions.  Its diagonal band
  and window edge are then 32 keys wide instead of 128, and fewer of its key blocks need a mask
  (see kernels.tuning.gqa_pack).
* **A window's masked blocks in one loop.**  Every loop gets its own pipeline of K/V loads,
  filled at the start and drained at the end, and a window's tile has few blocks (17 at window
  1024), so the leading edge and the diagonal band share one loop before the whole blocks, and
  the pipeline is filled and drained twice rather than three times.
* **A short window's blocks in one masked loop.**  At window 128 a 128 x 32 tile sees five key
  blocks, three of them whole; one loop over all five, each masked, fills and drains its pipeline
  once instead of twice.  At window 1024 most of a tile's blocks are whole and their masks cost
  more than the second pipeline saves, so longer windows keep the two loops (``one_loop``;
  docs/hopper-notes.md, section 19, has the measurements).
* **The scale folded into the exponent.**  ``exp2(s * qk_scale - m)`` is one fused multiply-add
  per score instead of a multiply then a subtract.
* **Causal programs longest first.**  The last query blocks see the most keys; starting them
  first keeps them from running alone at the end of the grid.
* **Fewer choices.**  Head dims must be powers of two from 16 to 256 (a TMA tile has no padding
  columns), and a tensor is copied first unless its last stride is 1 and its start and other
  strides fall on 16 bytes (``tma_compatible``); stage 8's kernel takes any head dim and any
  strides.

``python -m grader bench stage5`` (and stages 6-9, forward cases) times this file as
``solution-tma`` beside the stage's solution; docs/performance.md has the numbers, and
docs/hopper-notes.md what each of these choices gains.
Triton's CPU interpreter runs it too, so its tests need no GPU.

The backward through TMA descriptors is ``solutions/fast_backward_tma.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

from kernels import runtime, tuning, validate
from kernels.loader import load_file

import torch
import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl

# The ranges of key blocks are stage 9's public key_blocks_of (stage 8's, seen from a query
# block): this forward skips exactly the blocks the pointer-grid one skips.
key_blocks_of = load_file(Path(__file__).resolve().parent / "stage9_backward.py").key_blocks_of

LOG2E = 1.4426950408889634   # log2(e): exp(x) == exp2(x * LOG2E)
HEAD_DIMS = (16, 256)

# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim; the first entry is used untimed on short
# sequences and must fit float32 tiles in shared memory.  128 x 128 tiles pay here, where the
# pointer-grid kernel's address registers made them lose; narrow key blocks serve short windows
# (128 x 32 at window 128: docs/hopper-notes.md, section 19).
TMA_TILES = {
    64: [(128, 64, 4, 3), (128, 128, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 4, 2),
         (64, 32, 4, 3), (128, 32, 4, 3)],
    128: [(128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2)],
}
INTERPRETER_TILE = (32, 32, 4, 1)
#: The longest window whose blocks the forward takes in one masked loop (``one_loop``): one loop was
#: faster at window 128 and slower at 1024 (docs/hopper-notes.md, section 19).
ONE_LOOP_WINDOW = 128


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, shape: tuple, k_strides: tuple, v_strides: tuple,
                   block_n: int) -> tuple | None:
    """``(K's, V's)`` TMA descriptors made on the host: ``shape`` (B, Hkv, Nk, D) with the given
    strides (a (B, N, H, D) tensor's in (B, H, N, D) order), tiles of ``block_n`` positions of one
    head.  None for an empty tensor, which no descriptor can describe: the kernel makes its own."""
    if 0 in shape:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor
    tile = [1, 1, block_n, int(shape[3])]           # int(): a traced head dim is symbolic (and specialized)
    return (TensorDescriptor(k, list(shape), list(k_strides), tile),
            TensorDescriptor(v, list(shape), list(v_strides), list(tile)))


def _descriptor_tiles(nargs: dict) -> None:
    """The autotuner's hook before each configuration: host-made descriptors take its key block."""
    if nargs.get("HOST_DESC"):
        for name in ("K", "V"):
            nargs[name].block_shape = [1, 1, nargs["BLOCK_N"], nargs["HEAD_DIM_PAD"]]


@triton.jit
def tiles_of(X, B, H, N, stride_b, stride_h, stride_n, ROWS: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """A TMA descriptor of X, (B, H, N, D) with any strides, whose tiles are ROWS positions of one head."""
    return tl.make_tensor_descriptor(X, shape=[B, H, N, HEAD_DIM_PAD], strides=[stride_b, stride_h, stride_n, 1],
                                     block_shape=[1, 1, ROWS, HEAD_DIM_PAD])


@triton.jit
def _tma_block(acc, m_i, l_i, q, desc_k, desc_v, kv_b, kv_h, start_n, pos, offs_n, N_K, shift, WINDOW, SINK_TOKENS,
               qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
               HAS_SINK_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Fold the key block at start_n into the query tile; m_i is in scaled base-2 units.

    ``pos`` is each row's query position (with packed GQA heads, rows of different heads share one).
    """
    k = desc_k.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)    # zeros past N_K
    s = tl.dot(q, tl.trans(k))                                                  # raw scores
    if MASKED:
        cols = start_n + offs_n
        visible = cols[None, :] < N_K
        if CAUSAL:
            visible = visible & (cols[None, :] <= pos[:, None] + shift)
        if HAS_WINDOW:
            in_window = cols[None, :] > pos[:, None] + shift - WINDOW
            if HAS_SINK_TOKENS:
                in_window = in_window | (cols[None, :] < SINK_TOKENS)
            visible = visible & in_window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)                       # qk_scale > 0
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                       # rows with nothing seen yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * qk_scale - m_safe[:, None])                                 # one FMA per score
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = desc_v.load([kv_b, kv_h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM_PAD)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, kv_b, kv_h, lo, hi, pos, offs_n, N_K, shift, WINDOW, SINK_TOKENS,
                qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_SINK_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """Fold key blocks lo, lo + BLOCK_N, ... (below hi) into the query tile."""
    for start_n in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _tma_block(acc, m_i, l_i, q, desc_k, desc_v, kv_b, kv_h, start_n, pos, offs_n, N_K, shift,
                                   WINDOW, SINK_TOKENS, qk_scale, MASKED, CAUSAL, HAS_WINDOW, HAS_SINK_TOKENS, BLOCK_N,
                                   HEAD_DIM_PAD)
    return acc, m_i, l_i


@triton.jit
def _tma_window_edges(acc, m_i, l_i, q, desc_k, desc_v, kv_b, kv_h, lo, full_lo, full_hi, hi, pos, offs_n, N_K, shift,
                      WINDOW, SINK_TOKENS, qk_scale, CAUSAL: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
                      BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """A window's masked blocks, its leading edge [lo, full_lo) and the diagonal band [full_hi, hi), in one loop.

    Each loop fills and drains its own pipeline of K/V loads, and a window's tile visits few
    blocks (17 at window 1024), so two loops instead of three pay: the edges here, then the
    whole blocks.  (Not one loop with the mask under ``if`` in it: Triton 3.6 computes that
    loop wrong on an H100.)
    """
    n_lead = (full_lo - lo) // BLOCK_N
    for j in range(0, n_lead + tl.cdiv(hi - full_hi, BLOCK_N)):
        start_n = tl.where(j < n_lead, lo + j * BLOCK_N, full_hi + (j - n_lead) * BLOCK_N)
        acc, m_i, l_i = _tma_block(acc, m_i, l_i, q, desc_k, desc_v, kv_b, kv_h, start_n, pos, offs_n, N_K, shift,
                                   WINDOW, SINK_TOKENS, qk_scale, True, CAUSAL, True, HAS_SINK_TOKENS, BLOCK_N,
                                   HEAD_DIM_PAD)
    return acc, m_i, l_i


@tuning.autotune(TMA_TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL", "HAS_WINDOW", "WINDOW", "SINK_TOKENS",
                                 "HAS_SINKS", "GROUP", "PACK"], pre_hook=_descriptor_tiles)
@triton.jit
def _tma_forward_kernel(
    Q, K, V, O, LSE, SINKS,                      # q, o (B, Hq, N_Q, D) and k, v (B, Hkv, N_K, D) with any strides
    #                                              (with HOST_DESC, K and V are their descriptors)
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_on,
    B, H_Q, GROUP, N_Q, N_K, WINDOW, SINK_TOKENS, qk_scale,   # GROUP = Hq // Hkv query heads share a K/V head
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, HAS_SINKS: tl.constexpr,
    PACK: tl.constexpr,                          # query heads per program (1, or GROUP: see flash_attention)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    ONE_LOOP: tl.constexpr = False,              # a window's blocks in one masked loop (see one_loop)
    HOST_DESC: tl.constexpr = False,             # K and V arrive as descriptors made on the host
):
    ROWS: tl.constexpr = BLOCK_M // PACK         # query positions per program; BLOCK_M rows = PACK heads x ROWS
    qk_scale = tl.cast(qk_scale, tl.float32)     # float32 under torch.compile too, where a float arrives as float64
    pid_m = tl.program_id(0)                     # which block of query positions
    if CAUSAL:                                   # the longest rows (the last positions) first: no long tail
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_hp = tl.program_id(1)                    # which batch and PACK query heads
    b = pid_hp // (H_Q // PACK)
    h0 = pid_hp % (H_Q // PACK) * PACK           # the first of the PACK heads
    kv_h = h0 // GROUP                           # their K/V head
    start_m = pid_m * ROWS
    rows = tl.arange(0, BLOCK_M)
    pos = start_m + rows % ROWS                  # row r: head h0 + r // ROWS, position start_m + r % ROWS
    head = h0 + rows // ROWS
    offs_n = tl.arange(0, BLOCK_N)

    # K and V as (B, Hkv, N, D) descriptors, read in every loop: made on the host, or here once per program.
    if HOST_DESC:
        desc_k = K
        desc_v = V
    else:
        desc_k = tiles_of(K, B, H_Q // GROUP, N_K, stride_kb, stride_kh, stride_kn, BLOCK_N, HEAD_DIM_PAD)
        desc_v = tiles_of(V, B, H_Q // GROUP, N_K, stride_vb, stride_vh, stride_vn, BLOCK_N, HEAD_DIM_PAD)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row_ok = (pos < N_Q)[:, None]
    # q and o, once per program, through pointers: a descriptor made in the kernel costs more than
    # it saves on a tile loaded once (docs/hopper-notes.md).
    q_rows = (Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + pos.to(tl.int64)[:, None] * stride_qn
              + offs_d[None, :])
    q = tl.load(q_rows, mask=row_ok, other=0.0)
    if HAS_SINKS:                                # a learned sink: a first key of logit SINKS[h] and value 0
        m_i = tl.load(SINKS + head) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Stage 8's ranges (stage 9's key_blocks_of), for ROWS positions: the sink tokens [0, sink_hi),
    # the window's masked leading edge [lo, full_lo), whole blocks [full_lo, full_hi), the diagonal
    # band (or the last partial block) [full_hi, hi).  A window takes its two masked ranges in one loop,
    # or with ONE_LOOP (a short window) all of [lo, hi) in one masked loop.
    shift = N_K - N_Q
    sink_hi, lo, full_lo, full_hi, hi = key_blocks_of(start_m, N_Q, N_K, WINDOW, SINK_TOKENS, CAUSAL=CAUSAL,
                                                      HAS_WINDOW=HAS_WINDOW, BLOCK_M=ROWS, BLOCK_N=BLOCK_N)
    if HAS_WINDOW:                               # no empty loop (and its set-up) without a window
        if HAS_SINK_TOKENS:
            if sink_hi > 0:
                acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, 0, sink_hi, pos, offs_n, N_K,
                                            shift, WINDOW, SINK_TOKENS, qk_scale, True, CAUSAL, HAS_WINDOW,
                                            HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM_PAD)
        if ONE_LOOP:
            acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, lo, hi, pos, offs_n, N_K, shift,
                                        WINDOW, SINK_TOKENS, qk_scale, True, CAUSAL, HAS_WINDOW, HAS_SINK_TOKENS,
                                        BLOCK_N, HEAD_DIM_PAD)
        else:
            acc, m_i, l_i = _tma_window_edges(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, lo, full_lo, full_hi, hi,
                                              pos, offs_n, N_K, shift, WINDOW, SINK_TOKENS, qk_scale, CAUSAL,
                                              HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM_PAD)
    if not (HAS_WINDOW and ONE_LOOP):
        acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, full_lo, full_hi, pos, offs_n, N_K,
                                    shift, WINDOW, SINK_TOKENS, qk_scale, False, CAUSAL, HAS_WINDOW,
                                    HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM_PAD)
    if not HAS_WINDOW:                           # the diagonal band, or the last partial block
        acc, m_i, l_i = _tma_blocks(acc, m_i, l_i, q, desc_k, desc_v, b, kv_h, full_hi, hi, pos, offs_n, N_K,
                                    shift, WINDOW, SINK_TOKENS, qk_scale, True, CAUSAL, HAS_WINDOW,
                                    HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM_PAD)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)      # a row that saw no key: o = 0, lse = -inf (sinks[h] with a sink)
    o = acc / l_safe[:, None]
    o_rows = (O + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + pos.to(tl.int64)[:, None] * stride_on
              + offs_d[None, :])
    tl.store(o_rows, o.to(O.dtype.element_ty), mask=row_ok)
    tl.store(LSE + (b * H_Q + head) * N_Q + pos, (m_i + tl.log2(l_safe)) * 0.6931471805599453, mask=pos < N_Q)


def tma_strides(x: torch.Tensor) -> bool:
    """Whether ``x``'s strides suit a TMA descriptor: the last 1, every other a positive multiple of
    16 bytes (not 0, as an expanded tensor's are)."""
    size, strides = x.element_size(), x.stride()
    return strides[-1] == 1 and all(s > 0 and s * size % 16 == 0 for s in strides[:-1])


def starts_on_16_bytes(x: torch.Tensor) -> bool:
    """Whether ``x`` starts on 16 bytes, as a TMA descriptor's base must.  A tensor traced by
    ``torch.compile`` has no address: it is taken as aligned, since Inductor copies a graph input
    that starts elsewhere before running kernels compiled for aligned ones."""
    try:
        return x.data_ptr() % 16 == 0
    except (RuntimeError, NotImplementedError):
        return True


def tma_compatible(x: torch.Tensor) -> bool:
    """Whether a TMA descriptor can read ``x`` where it lies: its strides (``tma_strides``) and
    a start on 16 bytes."""
    return tma_strides(x) and starts_on_16_bytes(x)


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when a TMA descriptor can read it, else a contiguous copy."""
    return x if tma_compatible(x) else x.clone(memory_format=torch.contiguous_format)


def one_loop(window: int | None, most: int | None = None) -> bool:
    """Whether a window (None or 0: none) is short enough, ``most`` keys or fewer (default
    ``ONE_LOOP_WINDOW``), for its key blocks to be taken in one masked loop."""
    return window is not None and 0 < window <= (ONE_LOOP_WINDOW if most is None else most)


def flash_attention(q, k, v, *, causal: bool = False, window: int | None = None, sink_tokens: int = 0,
                    sinks: torch.Tensor | None = None, sm_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, pack_gqa: bool = True,
                    one_loop_window: int | None = None, host_descriptors: bool = True):
    """Stage 8's forward through TMA descriptors; returns ``(o, lse)``.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq % Hkv == 0 and D a power of two from 16 to
    256; any Nq, Nk >= 1.  float16/float32 (and bfloat16 on a GPU).  ``causal``, ``window``,
    ``sink_tokens``, ``sinks`` and ``sm_scale`` as in stage 8; ``block_m``/``block_n`` fix the
    tile; ``pack_gqa=False`` gives each query head its own programs (see kernels.tuning.gqa_pack);
    ``one_loop_window`` replaces ``ONE_LOOP_WINDOW`` for this call (0: never one loop);
    ``host_descriptors=False`` has the kernel make K's and V's descriptors itself, as the op's
    does under ``torch.compile``.
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens,
                                                      sinks=sinks, sm_scale=sm_scale, head_dims=HEAD_DIMS)
    if D & (D - 1):
        raise ValueError(f"head_dim is {D}: the TMA variant takes head dims that are powers of two (a TMA tile has "
                         f"no padding columns); stage 8's flash_attention pads the others")
    for name, flag in (("pack_gqa", pack_gqa), ("host_descriptors", host_descriptors)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    if one_loop_window is not None and (isinstance(one_loop_window, bool) or not isinstance(one_loop_window, int)
                                        or one_loop_window < 0):
        raise ValueError(f"one_loop_window must be a non-negative int or None, got {one_loop_window!r}")
    runtime.check_dtype(q.dtype)
    block_m = validate.block_size(block_m, "block_m") if block_m is not None else None
    block_n = validate.block_size(block_n, "block_n") if block_n is not None else None
    pack = tuning.gqa_pack(Hq // Hkv) if pack_gqa else 1
    if block_m is not None and block_m % pack:
        raise ValueError(f"block_m is {block_m}: with pack_gqa it must hold whole groups of {pack} query heads "
                         f"(a multiple of {pack})")
    kernel, tile = tuning.plan(_tma_forward_kernel, TMA_TILES, D, Nq, Nk, interpreter_tile=INTERPRETER_TILE,
                               block_m=block_m, block_n=block_n)
    q, k, v = (tma_ready(x) for x in (q, k, v))
    o = torch.empty_like(q)                                                  # (B, Hq, Nq, D), q's strides
    if not tma_compatible(o):
        o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)      # (B, Hq, Nq)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    has_sink_tokens = window is not None and sink_tokens > 0      # without a window every earlier key is seen
    sinks = sinks.to(torch.float32).contiguous() if sinks is not None else None   # (Hq,)

    def grid(meta):
        return triton.cdiv(Nq, meta["BLOCK_M"] // pack), B * Hq // pack
    # The autotuner's hook gives host-made descriptors each configuration's key block.
    made = host_descriptors and kv_descriptors(k, v, (B, Hkv, Nk, D), k.stride(), v.stride(), tile.get("BLOCK_N", 16))
    runtime.tma_scratch()                        # the descriptors a kernel makes live in scratch memory
    kernel[grid](q, *(made or (k, v)), o, lse, sinks if sinks is not None else lse,
                 *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], B, Hq, Hq // Hkv, Nq, Nk,
                 window if window is not None else 0, sink_tokens if has_sink_tokens else 0, scale * LOG2E,
                 CAUSAL=causal, HAS_WINDOW=window is not None, HAS_SINK_TOKENS=has_sink_tokens,
                 HAS_SINKS=sinks is not None, PACK=pack, HEAD_DIM_PAD=D,
                 ONE_LOOP=one_loop(window, one_loop_window), HOST_DESC=bool(made), **tile)
    return o, lse
