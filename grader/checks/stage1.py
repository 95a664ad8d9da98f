"""Checks for stage 1: online softmax and tiled attention in PyTorch."""

from __future__ import annotations

from kernels import reference

import torch

from grader.check import check
from grader.checks.attention import attend


def _softmax_close(ctx, x, *, name, **kwargs):
    y = ctx.learner.online_softmax(x, **kwargs)
    ctx.expect_dtype(y, x.dtype, name=name)
    ctx.close_softmax(y, x, reference.softmax(x), reference.softmax(x, compute_dtype=x.dtype), name=name,
                      block=kwargs.get("block", 128))


@check(points=1, hint="compare with the TODO(1a) formula: l must be rescaled by exp(m - m_new) "
                      "every time the running max grows")
def softmax_awkward_lengths(ctx):
    """online_softmax on rows of length 1, 17, 127, 128, 129 and 1000, several blocks each."""
    for n in (1, 17, 127, 128, 129, 1000):
        _softmax_close(ctx, ctx.randn(3, n, scale=3.0), name=f"online_softmax, rows of length {n}")
    _softmax_close(ctx, ctx.randn(2, 5, 70, scale=3.0), block=16, name="online_softmax, (2, 5, 70) with block=16")


@check(points=1, hint="subtract the running max before exp; a row's max can be 1e4, and exp(1e4) is inf")
def softmax_large_values(ctx):
    """Values of +-1e4 must not overflow: exp is only ever taken of x - max."""
    x = ctx.uniform(4, 300, low=-1e4, high=1e4)
    x[0, 250] = 1e4                        # the max arrives late, in the last block
    x[1, 0] = 1e4                          # ... or in the first
    _softmax_close(ctx, x, name="online_softmax, values in [-1e4, 1e4]")


@check(points=1, hint="while a row has seen only -inf its max is -inf, and exp(-inf - (-inf)) is NaN: "
                      "subtract 0 instead of -inf in that case")
def softmax_minus_inf(ctx):
    """-inf entries (masked positions), including whole blocks and whole rows of them."""
    x = ctx.randn(5, 260, scale=2.0)
    x[0, :200] = float("-inf")             # the first blocks of a row are all masked
    x[1, ::3] = float("-inf")              # scattered masked entries
    x[2, :] = float("-inf")                # a row that sees nothing: zeros, not NaN
    x[3, 1:] = float("-inf")               # only the first entry survives
    _softmax_close(ctx, x, name="online_softmax with -inf entries")


@check(points=1)
def softmax_float16(ctx):
    """float16 in, float16 out, as accurate as torch.softmax in float16."""
    _softmax_close(ctx, ctx.randn(4, 333, dtype=torch.float16, scale=4.0), name="online_softmax, float16")


def _attention_close(ctx, q, k, v, *, block_m, block_n, sm_scale=None, label=""):
    # Stage 1 is plain PyTorch: its baseline is PyTorch in q's dtype, without the TF32 of Triton's dots.
    attend(ctx, q, k, v, what=label, block_m=block_m, block_n=block_n, sm_scale=sm_scale, baseline=q.dtype)


@check(points=2, hint="rescale both l and acc by alpha = exp(m_old - m_new) before adding the new tile")
def attention_matches_reference(ctx):
    """Tiled attention with Nq, Nk that are and are not multiples of the blocks."""
    for nq, nk, bm, bn in ((64, 64, 16, 16), (17, 129, 16, 32), (128, 127, 32, 16), (1, 77, 16, 16)):
        q, k, v = ctx.randn(2, 3, nq, 32), ctx.randn(2, 3, nk, 32), ctx.randn(2, 3, nk, 32)
        _attention_close(ctx, q, k, v, block_m=bm, block_n=bn, label=f"(Nq={nq}, Nk={nk}, {bm}x{bn} tiles)")


@check(points=1, hint="lse = m + log(l), in float32, with the natural log")
def attention_lse_and_scale(ctx):
    """A custom sm_scale, float16 inputs and head dims 16 and 64."""
    for d, dtype, scale in ((16, torch.float32, 0.3), (64, torch.float16, None)):
        q, k, v = (ctx.randn(1, 2, n, d, dtype=dtype) for n in (33, 50, 50))
        _attention_close(ctx, q, k, v, block_m=16, block_n=32, sm_scale=scale, label=f"(D={d}, {dtype})")


@check(points=1, hint="index q, k and v with slicing; do not assume a contiguous layout")
def attention_non_contiguous(ctx):
    """Inputs in (B, N, H, D) memory, transposed to (B, H, N, D) views."""
    q, k, v = (ctx.randn(2, n, 4, 32).transpose(1, 2) for n in (40, 70, 70))
    _attention_close(ctx, q, k, v, block_m=16, block_n=16, label="(non-contiguous q, k, v)")


@check(points=1, validation=True)
def attention_bad_input(ctx):
    """Wrong rank, mismatched shapes and mixed dtypes raise errors that name the argument."""
    q, k = ctx.randn(1, 2, 8, 16), ctx.randn(1, 2, 8, 16)
    ctx.expect_error("flash_attention", q[0], k, k, block_m=16, block_n=16, mentions=["q"],
                     why="q of rank 3")
    ctx.expect_error("flash_attention", q, k, ctx.randn(1, 2, 9, 16), block_m=16, block_n=16,
                     mentions=["v"], why="k and v of different lengths")
    ctx.expect_error("flash_attention", q, k.half(), k, block_m=16, block_n=16, mentions=["dtype"],
                     why="q float32 with k float16")
