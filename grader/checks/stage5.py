"""Checks for stage 5: causal attention with block skipping and a NaN-safe online softmax."""

from __future__ import annotations

from kernels import runtime

import torch

from grader.check import check
from grader.checks.attention import attend
from grader.checks.masked_attention import expect_visits_exact, needed_tiles, visits

CAUSAL = dict(causal=True)


@check(points=2, hint="a MASKED block hides key j from row i when j > i + (Nk - Nq); the whole blocks "
                      "[0, full_hi) need no mask, the band [full_hi, hi) does")
def causal_square(ctx):
    """Causal attention with Nq = Nk of 1, 17, 127, 128 and 129 (partial blocks at the edges)."""
    for n in (1, 17, 127, 128, 129):
        q, k, v = (ctx.randn(1, 2, n, 32) for _ in range(3))
        attend(ctx, q, k, v, block_m=32, block_n=32, **CAUSAL)


@check(points=2, hint="bottom-right alignment: row i sees keys j <= i + (Nk - Nq), so the last query sees "
                      "the last key; shift = N_K - N_Q can be negative")
def causal_bottom_right(ctx):
    """Nq != Nk both ways: the diagonal is aligned to the bottom-right corner."""
    for nq, nk, bm, bn in ((17, 129, 16, 32), (129, 17, 32, 16), (1, 100, 16, 16), (64, 200, 32, 32),
                           (200, 64, 32, 32), (100, 37, 16, 16)):
        q = ctx.randn(1, 2, nq, 32)
        k, v = ctx.randn(1, 2, nk, 32), ctx.randn(1, 2, nk, 32)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, **CAUSAL)


@check(points=2, hint="with block_m != block_n a row can be fully masked inside a tile: its row max there is "
                      "-inf.  Subtract the running max (made safe: 0 while it is -inf), never the tile's own max")
def causal_asymmetric_blocks(ctx):
    """Tiles of 128x32, 32x128, 16x64 and 64x16: rows fully masked inside a tile must not turn NaN."""
    for nq, nk, bm, bn in ((129, 129, 128, 32), (129, 129, 32, 128), (129, 129, 16, 64), (129, 129, 64, 16),
                           (100, 160, 16, 64), (160, 100, 128, 32), (90, 130, 32, 128)):
        q = ctx.randn(1, 2, nq, 32, scale=2.0)
        k, v = ctx.randn(1, 2, nk, 32), ctx.randn(1, 2, nk, 32)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, **CAUSAL)


@check(points=2, hint="a row that sees no key keeps m = -inf and l = 0 to the end: o = acc / 1 = 0, "
                      "lse = -inf; anything computed as -inf - (-inf) or 0 / 0 is NaN")
def rows_that_see_no_key(ctx):
    """Nq > Nk: the first Nq - Nk rows see no key (whole query blocks of them): o = 0, lse = -inf."""
    for nq, nk, bm, bn in ((150, 40, 32, 16), (150, 40, 16, 64), (70, 3, 16, 16)):
        q = ctx.randn(2, 1, nq, 16)
        k, v = ctx.randn(2, 1, nk, 16), ctx.randn(2, 1, nk, 16)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, **CAUSAL)


@check(points=1, hint="cast p to v's dtype before tl.dot; keep m, l and acc in float32")
def causal_float16_head_dims(ctx):
    """float16 inputs, head dims 16, 48 (padded to 64) and 64, a custom sm_scale, default tiles."""
    for d, n, scale in ((16, 129, None), (48, 127, 0.2), (64, 100, None)):
        q, k, v = (ctx.randn(1, 2, n, d, dtype=torch.float16) for _ in range(3))
        attend(ctx, q, k, v, sm_scale=scale, **CAUSAL)


@check(points=1, hint="causal=False is stage 3's attention: every key visible, only keys past N_K masked")
def non_causal_unchanged(ctx):
    """causal=False still works (Nq != Nk both ways, float16), and non-contiguous inputs work either way."""
    q = ctx.randn(2, 129, 2, 32, dtype=torch.float16).transpose(1, 2)
    k, v = (ctx.randn(2, 17, 2, 32, dtype=torch.float16).transpose(1, 2) for _ in range(2))
    attend(ctx, q, k, v, block_m=32, block_n=16)
    attend(ctx, k, q, q, block_m=16, block_n=32)
    q, k, v = (ctx.randn(1, 2, n, 32).transpose(1, 2).contiguous().transpose(1, 2) for n in (65, 65, 65))
    attend(ctx, q, k, v, block_m=16, block_n=64, **CAUSAL)


@check(points=2, hint="blocks above the diagonal hold no visible key: stop the loop at "
                      "hi = start_m + BLOCK_M + (Nk - Nq) (kept within [0, Nk]); a row block above every "
                      "key loads nothing")
def blocks_above_diagonal_skipped(ctx):
    """The kernel's own count of key blocks loaded: exactly the tiles that hold a visible key."""
    for nq, nk, bm, bn in ((256, 256, 32, 32), (100, 260, 16, 64), (260, 100, 64, 16), (129, 129, 128, 32),
                           (129, 129, 32, 128), (150, 40, 32, 16)):
        q = ctx.randn(1, 2, nq, 16)
        k, v = ctx.randn(1, 2, nk, 16), ctx.randn(1, 2, nk, 16)
        expect_visits_exact(ctx, q, k, v, block_m=bm, block_n=bn, **CAUSAL)
    q, k, v = (ctx.randn(1, 1, 256, 16) for _ in range(3))
    causal = int(visits(ctx, q, k, v, block_m=32, block_n=32, causal=True).sum())
    full = int(visits(ctx, q, k, v, block_m=32, block_n=32).sum())
    ctx.expect(full == 64, f"visits without causal (Nq = Nk = 256, 32x32 tiles): expected all 8 x 8 = 64 tiles "
                           f"loaded, got {full}")
    ctx.expect(causal == 36, f"visits with causal (Nq = Nk = 256, 32x32 tiles): expected 36 of 64 tiles "
                             f"(8 on the diagonal + 28 below it), got {causal}")


@check(points=1, validation=True)
def causal_bad_input(ctx):
    """causal that is not a bool, a block size that is not a power of two, and mismatched heads are refused."""
    q = ctx.randn(1, 2, 8, 16)
    ctx.expect_error("flash_attention", q, q, q, causal="yes", mentions=["causal"], why="causal='yes'")
    ctx.expect_error("flash_attention", q, q, q, causal=True, block_m=24, mentions=["block_m"],
                     why="block_m=24 (not a power of two)")
    ctx.expect_error("flash_attention", q, ctx.randn(1, 3, 8, 16), ctx.randn(1, 3, 8, 16), causal=True,
                     errors=("ValueError",), mentions=["heads"], why="q with 2 heads and k/v with 3")


# -- GPU: compiled Triton at real sizes, float16 and bfloat16 ---------------------------------

@check(points=2, gpu=True, hint="bfloat16 has an 8-bit mantissa: cast p to v's dtype for tl.dot, but keep "
                                "m, l and acc in float32")
def gpu_causal_real_sizes(ctx):
    """On a GPU: causal float16 and bfloat16 at N = 1023 and 2048, D = 64 and 128, Nq != Nk, default tiles."""
    for dtype in (torch.float16, torch.bfloat16):
        for b, h, nq, nk, d in ((2, 4, 1023, 1023, 64), (1, 4, 2048, 2048, 128), (1, 2, 1000, 2048, 128),
                                (1, 2, 2048, 1000, 64)):
            q = ctx.randn(b, h, nq, d, dtype=dtype)
            k, v = ctx.randn(b, h, nk, d, dtype=dtype), ctx.randn(b, h, nk, d, dtype=dtype)
            attend(ctx, q, k, v, device=runtime.DEVICE, **CAUSAL)


@check(points=1, gpu=True, hint="rows fully masked inside a tile: subtract the running max made safe, never "
                                "the tile's own max")
def gpu_asymmetric_blocks_and_skipping(ctx):
    """On a GPU: bfloat16 with tiles 128x32, 32x128 and 64x128, Nq > Nk, and the count of key blocks loaded."""
    for nq, nk, bm, bn in ((1023, 1023, 128, 32), (1023, 1023, 32, 128), (1500, 700, 64, 128)):
        q = ctx.randn(1, 4, nq, 64, dtype=torch.bfloat16)
        k, v = ctx.randn(1, 4, nk, 64, dtype=torch.bfloat16), ctx.randn(1, 4, nk, 64, dtype=torch.bfloat16)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, device=runtime.DEVICE, **CAUSAL)
        expect_visits_exact(ctx, q, k, v, block_m=bm, block_n=bn, **CAUSAL)
    tiles = needed_tiles(4096, 4096, 128, 64, causal=True)
    q, k, v = (ctx.randn(1, 1, 4096, 64, dtype=torch.float16) for _ in range(3))
    count = int(visits(ctx, q, k, v, block_m=128, block_n=64, causal=True).sum())
    ctx.expect(count == int(tiles.sum()), f"visits (N = 4096, causal, 128x64 tiles): expected {int(tiles.sum())} "
                                          f"of {tiles.numel()} tiles loaded, got {count}")
