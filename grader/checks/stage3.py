"""Checks for stage 3: the FlashAttention forward pass in Triton.

CPU checks use shapes the Triton interpreter runs in seconds and still hit every edge: sequence
lengths that are 1, just under, at and just over a block; Nq != Nk; padded head dims; tile
shapes with block_m != block_n; strided inputs.  The ``gpu=True`` checks repeat the idea at real
sizes in float16, bfloat16 and float32 (TF32).
"""

from __future__ import annotations

import math

from kernels import runtime

import torch

from grader.check import check
from grader.checks.attention import attend


def _describe(q, k, v, block_m, block_n) -> str:
    """'(B=1, H=2, Nq=129, Nk=129, D=72, float16, 32x32 tiles; ...)': the case, for messages."""
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    parts = [f"B={B}, H={H}, Nq={Nq}, Nk={Nk}, D={D}, {str(q.dtype).replace('torch.', '')}"]
    if block_m is not None and block_n is not None:
        parts.append(f"{block_m}x{block_n} tiles")
    notes = []
    if block_m is not None and Nq % block_m:
        notes.append(f"last query block has {Nq % block_m} of {block_m} rows")
    if block_n is not None and Nk % block_n:
        notes.append(f"last key block has {Nk % block_n} of {block_n} keys")
    if D & (D - 1):
        notes.append(f"D={D} padded to {1 << (D - 1).bit_length()}")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        notes.append("strided inputs")
    return "(" + ", ".join(parts) + ("; " + ", ".join(notes) if notes else "") + ")"


def _attention_close(ctx, q, k, v, *, sm_scale=None, block_m=None, block_n=None, ref_device=None, what=""):
    """Run the learner's flash_attention and judge o and lse against the float64 reference.

    The allowed error is twice what plain PyTorch makes in q's dtype (TF32 matmuls for float32 on a
    GPU).  ``ref_device`` is where the reference is computed: the GPU for real sizes, else the CPU.
    """
    scale = {"sm_scale": sm_scale} if sm_scale is not None else {}     # else the learner's default
    label = (what + " " if what else "") + _describe(q, k, v, block_m, block_n)
    attend(ctx, q, k, v, what=label, block_m=block_m, block_n=block_n, device=ref_device or torch.device("cpu"),
           **scale)


def _qkv(ctx, b, h, nq, nk, d, dtype=torch.float32):
    return ctx.randn(b, h, nq, d, dtype=dtype), ctx.randn(b, h, nk, d, dtype=dtype), ctx.randn(b, h, nk, d, dtype=dtype)


# -- sequence lengths ------------------------------------------------------------------------

@check(points=2, hint="rows past N_Q load zeros and are never stored (mask offs_m < N_Q); keys past N_K get "
                      "score -inf before the row max (cols < N_K), and the loop runs over every key block, "
                      "the partial last one included")
def sequence_lengths(ctx):
    """Nq = Nk = 1, 17, 127, 128, 129 with 32x32 tiles: one row, partial blocks, exact blocks, one extra row."""
    for n in (1, 17, 127, 128, 129):
        q, k, v = _qkv(ctx, 1, 2, n, n, 64)
        _attention_close(ctx, q, k, v, block_m=32, block_n=32)


@check(points=1, hint="the query rows and the key columns have separate bounds: mask rows with N_Q and keys "
                      "with N_K, and size the grid with cdiv(N_Q, BLOCK_M)")
def unequal_lengths(ctx):
    """Nq != Nk both ways, down to a single query and a single key."""
    for nq, nk in ((17, 129), (129, 17), (1, 100), (100, 1), (65, 40)):
        q, k, v = _qkv(ctx, 2, 1, nq, nk, 32)
        _attention_close(ctx, q, k, v, block_m=32, block_n=32)


# -- head dims -------------------------------------------------------------------------------

@check(points=1, hint="offs_d = tl.arange(0, HEAD_DIM_PAD) indexes the head dim of q, k, v and o alike; "
                      "the default scale is 1/sqrt(D)")
def head_dims_powers_of_two(ctx):
    """Head dims 16, 32, 64 and 128 with the default tiles and the default scale."""
    for d in (16, 32, 64, 128):
        q, k, v = _qkv(ctx, 1, 2, 70, 90, d)
        _attention_close(ctx, q, k, v)


@check(points=2, hint="load Q, K and V with the mask offs_d < HEAD_DIM and other=0.0 so the padding columns are "
                      "zeros (otherwise they read the next row or head), store only offs_d < HEAD_DIM, and scale "
                      "by 1/sqrt(D) with the real D, not the padded one")
def head_dims_padded(ctx):
    """Head dims that are not powers of two (24 ... 256), computed padded to the next power of two."""
    dims = (24, 40, 48, 72, 80, 96, 160, 200, 256)
    for d in dims:
        q, k, v = _qkv(ctx, 1, 2, 45, 70, d)
        _attention_close(ctx, q, k, v)


@check(points=1, hint="padding_waste(D) = (P - D) / P with P = triton.next_power_of_2(D); "
                      "refuse anything that is not a positive int with a ValueError")
def padding_waste_values(ctx):
    """padding_waste(D) for every D in 16..256, and bad arguments refused."""
    for d in range(16, 257):
        padded = 1 << (d - 1).bit_length()          # the next power of two, written independently
        expected = (padded - d) / padded
        got = ctx.learner.padding_waste(d)
        ctx.expect(isinstance(got, float) or isinstance(got, int) and not isinstance(got, bool),
                   f"padding_waste({d}) should return a number, got {type(got).__name__}")
        ctx.expect(math.isclose(got, expected, rel_tol=0, abs_tol=1e-12),
                   f"padding_waste({d}): D={d} is computed as {padded} columns, so {padded - d} of every {padded} "
                   f"are padding and the waste is {padded - d}/{padded} = {expected:.4g}; got {got!r}")
    for bad in (0, -64, 72.0, "72", True, None):
        ctx.expect_error("padding_waste", bad, mentions=["head_dim"],
                         why=f"padding_waste({bad!r}) is not a positive int head dim")


# -- tiles, strides, scale, dtypes -------------------------------------------------------------

@check(points=1, hint="use BLOCK_M for everything about queries (offs_m, m_i, l_i, acc rows) and BLOCK_N for "
                      "keys (offs_n, the loop step); the two need not be equal")
def block_shapes(ctx):
    """Explicit tiles 16x16, 16x64, 64x16, 32x64 and 64x32 over lengths that are no multiple of them."""
    for bm, bn in ((16, 16), (16, 64), (64, 16), (32, 64), (64, 32)):
        q, k, v = _qkv(ctx, 1, 2, 100, 90, 32)
        _attention_close(ctx, q, k, v, block_m=bm, block_n=bn)


@check(points=1, hint="address every tensor with its own strides (stride_qn, stride_kn, stride_vn, stride_on, "
                      "..., and the *_d strides): never assume contiguous rows, and never reuse one tensor's "
                      "strides for another")
def non_contiguous(ctx):
    """(B, N, H, D) memory viewed as (B, H, N, D); k, v and q in three different layouts; o not like q."""
    q, k, v = (ctx.randn(2, n, 3, 32).transpose(1, 2) for n in (50, 70, 70))
    _attention_close(ctx, q, k, v, block_m=32, block_n=32, what="all three transposed")
    q, k, v = (ctx.randn(1, n, 2, 40).transpose(1, 2) for n in (40, 37, 37))
    _attention_close(ctx, q, k, v, block_m=16, block_n=32, what="transposed, padded head dim")
    q = ctx.randn(1, 2, 50, 64)[..., :48]                   # rows 64 apart: stride_qn != D, o comes back dense
    k = ctx.randn(1, 2, 60, 48)                             # contiguous
    v = ctx.randn(1, 60, 2, 48).transpose(1, 2)             # transposed
    _attention_close(ctx, q, k, v, block_m=32, block_n=16, what="q sliced, k contiguous, v transposed")
    q, k, v = (ctx.randn(1, 2, n, 64)[..., ::2] for n in (33, 40, 40))   # every other column: stride_d == 2
    _attention_close(ctx, q, k, v, block_m=16, block_n=16, what="head-dim stride 2")


@check(points=1, hint="fold the scale into the base-2 exponent once: qk_scale = sm_scale * log2(e), and use the "
                      "caller's sm_scale when one is given")
def custom_scale(ctx):
    """sm_scale of 0.05, 0.5 and 2.0, and scores in the hundreds: exp2 only ever sees s - max."""
    for scale in (0.05, 0.5, 2.0):
        q, k, v = _qkv(ctx, 1, 2, 65, 80, 64)
        _attention_close(ctx, q, k, v, sm_scale=scale, block_m=32, block_n=32, what=f"sm_scale={scale}")
    q, k, v = ctx.randn(1, 2, 40, 64, scale=4.0), ctx.randn(1, 2, 70, 64, scale=4.0), ctx.randn(1, 2, 70, 64)
    _attention_close(ctx, q, k, v, sm_scale=2.0, block_m=16, block_n=32, what="sm_scale=2.0, scores up to ~1000")


@check(points=1, hint="accumulate in float32 (acc, m_i, l_i), cast p to v's dtype before the second tl.dot, and "
                      "cast o to O's element type only when storing; lse stays float32")
def float16(ctx):
    """float16 inputs: o in float16, lse in float32, as accurate as PyTorch in float16."""
    for nq, nk, d in ((129, 127, 64), (33, 200, 72), (64, 64, 128)):
        q, k, v = _qkv(ctx, 1, 2, nq, nk, d, dtype=torch.float16)
        _attention_close(ctx, q, k, v)


# -- bad input ---------------------------------------------------------------------------------

@check(points=1, hint="call validate.attention_inputs(..., head_dims=HEAD_DIMS) and runtime.check_dtype before "
                      "launching anything", validation=True)
def bad_input(ctx):
    """Wrong rank, mismatched batch, heads or head dims, mixed dtypes, head dims out of range."""
    q, k, v = _qkv(ctx, 1, 2, 8, 8, 16)
    ctx.expect_error("flash_attention", q[0], k, v, mentions=["q"], why="q of rank 3")
    ctx.expect_error("flash_attention", q, k[None], v, mentions=["k"], why="k of rank 5")
    ctx.expect_error("flash_attention", q, *_qkv(ctx, 2, 2, 8, 8, 16)[1:], mentions=["batch"],
                     why="q of batch 1 with k, v of batch 2")
    ctx.expect_error("flash_attention", ctx.randn(1, 4, 8, 16), k, v, mentions=["heads"],
                     why="q with 4 heads and k, v with 2")
    ctx.expect_error("flash_attention", ctx.randn(1, 3, 8, 16), k, v, mentions=["heads"],
                     why="q with 3 heads and k, v with 2")
    ctx.expect_error("flash_attention", ctx.randn(1, 2, 8, 32), k, v, mentions=["head dim"],
                     why="q of head dim 32 with k, v of head dim 16")
    ctx.expect_error("flash_attention", q, k, v.half(), mentions=["dtype"], why="v float16 with q, k float32")
    ctx.expect_error("flash_attention", q.double(), k.double(), v.double(), errors=("TypeError",),
                     mentions=["float64"], why="float64 inputs (the kernels take float16, float32, bfloat16)")
    for d in (8, 512):
        ctx.expect_error("flash_attention", *_qkv(ctx, 1, 1, 4, 4, d), mentions=["head dim"],
                         why=f"head dim {d}, outside 16..256")
    ctx.expect_error("flash_attention", q, k, v, sm_scale=-1.0, mentions=["sm_scale"], why="sm_scale=-1.0")
    ctx.expect_error("flash_attention", q, k, v, block_m=24, mentions=["block_m"], why="block_m=24")
    if not runtime.ON_GPU:
        ctx.expect_error("flash_attention", q.bfloat16(), k.bfloat16(), v.bfloat16(), errors=("TypeError",),
                         mentions=["bfloat16"],
                         why="bfloat16 on the CPU (Triton's interpreter computes bfloat16 dots wrongly)")


# -- GPU, real sizes ---------------------------------------------------------------------------

_GPU_CASES = [(n, d) for d in (64, 128, 72) for n in (1023, 1025, 2048)]


@check(points=2, gpu=True, hint="accumulate in float32 and cast p to v's dtype (bfloat16) for the second tl.dot")
def gpu_bfloat16(ctx):
    """bfloat16 at B=2, H=4, N 1023/1025/2048, D 64/128/72, Nq != Nk, and D 160/256."""
    cases = [(n, n, d) for n, d in _GPU_CASES] + [(1025, 2048, 64), (2048, 1023, 128), (1025, 1025, 160),
                                                 (1025, 1025, 256)]
    for nq, nk, d in cases:
        q, k, v = _qkv(ctx, 2, 4, nq, nk, d, dtype=torch.bfloat16)
        _attention_close(ctx, q, k, v, ref_device=runtime.DEVICE)


@check(points=1, gpu=True, hint="accumulate in float32 and cast p to v's dtype (float16) for the second tl.dot")
def gpu_float16(ctx):
    """float16 at B=2, H=4, N 1023/1025/2048, D 64/128/72, and strided inputs."""
    for n, d in _GPU_CASES:
        q, k, v = _qkv(ctx, 2, 4, n, n, d, dtype=torch.float16)
        _attention_close(ctx, q, k, v, ref_device=runtime.DEVICE)
    q, k, v = (ctx.randn(2, n, 4, 80, dtype=torch.float16).transpose(1, 2) for n in (1025, 1023, 1023))
    _attention_close(ctx, q, k, v, ref_device=runtime.DEVICE, what="transposed")


@check(points=1, gpu=True, hint="a float32 tl.dot runs in TF32 on a GPU; keep m_i, l_i and acc in float32")
def gpu_float32_tf32(ctx):
    """float32 at real sizes, within twice the error of PyTorch making the same TF32 matmuls."""
    for nq, nk, d in ((1023, 1023, 64), (1025, 2048, 128), (2048, 1025, 72)):
        q, k, v = _qkv(ctx, 2, 4, nq, nk, d)
        _attention_close(ctx, q, k, v, ref_device=runtime.DEVICE)
