"""Checks for stage 7: sliding-window attention whose work grows with the window, not the sequence."""

from __future__ import annotations

from kernels import runtime

import torch

from grader.check import check
from grader.checks.attention import attend
from grader.checks.masked_attention import expect_visits_exact, needed_tiles, visits

WINDOW_HINT = "row i sees key j iff i' - W < j <= i' with i' = i + (Nk - Nq): exactly W keys, its own included"


def _qkv(ctx, b, hq, hkv, nq, nk, d, dtype=torch.float32):
    q = ctx.randn(b, hq, nq, d, dtype=dtype)
    return q, ctx.randn(b, hkv, nk, d, dtype=dtype), ctx.randn(b, hkv, nk, d, dtype=dtype)


@check(points=2, hint=WINDOW_HINT)
def window_sizes(ctx):
    """N = 129 with windows 1, 2, 16, 40, 128, 129 and 500 (longer than the sequence)."""
    q, k, v = _qkv(ctx, 1, 2, 2, 129, 129, 16)
    for w in (1, 2, 16, 40, 128, 129, 500):
        attend(ctx, q, k, v, block_m=32, block_n=32, causal=True, window=w)


@check(points=1, hint=WINDOW_HINT)
def window_short_sequences(ctx):
    """Sequence lengths 1, 17, 127 and 128 with windows 1, 5 and 64."""
    for n in (1, 17, 127, 128):
        q, k, v = _qkv(ctx, 1, 1, 1, n, n, 16)
        for w in (1, 5, 64):
            attend(ctx, q, k, v, block_m=32, block_n=32, causal=True, window=w)


@check(points=2, hint="the window is aligned with the diagonal, bottom-right: it ends at i' = i + (Nk - Nq), "
                      "so the last query's window ends at the last key")
def window_bottom_right(ctx):
    """Nq != Nk both ways: the window ends at each row's bottom-right aligned diagonal."""
    for nq, nk, w, bm, bn in ((17, 129, 5, 16, 32), (129, 17, 3, 32, 16), (100, 37, 20, 16, 16),
                              (1, 100, 7, 16, 16), (60, 200, 150, 32, 32)):
        q, k, v = _qkv(ctx, 1, 2, 2, nq, nk, 16)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=w)


@check(points=2, hint="rows of one query block start their windows at different keys: a row can meet its "
                      "first tile with every key hidden, m = -inf: the NaN-safe update of stage 5 must hold")
def window_asymmetric_blocks(ctx):
    """Tiles of 128x32, 32x128, 16x64 and 64x16 with windows 1, 20 and 70: no NaN, no lost key."""
    for bm, bn, w in ((128, 32, 20), (32, 128, 70), (16, 64, 1), (64, 16, 20), (128, 32, 1), (64, 16, 70)):
        q, k, v = _qkv(ctx, 1, 1, 1, 140, 140, 16)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=w)


@check(points=1, hint="the window composes with GQA and the causal features of stage 5 and 6; keep p in "
                      "v's dtype for tl.dot")
def window_gqa_float16(ctx):
    """float16 with GQA (Hq = 4, Hkv = 2), head dim 48, and a window, causal rows with no key (Nq > Nk)."""
    q, k, v = _qkv(ctx, 1, 4, 2, 130, 90, 48, dtype=torch.float16)
    for w in (10, 64):
        attend(ctx, q, k, v, block_m=32, block_n=16, causal=True, window=w)
    q, k, v = _qkv(ctx, 1, 4, 1, 100, 100, 32, dtype=torch.float16)
    attend(ctx, q, k, v, causal=True)                                     # window=None: plain causal
    attend(ctx, q, k, v)


@check(points=2, hint="start the loop at the block holding key start_m + (Nk - Nq) - W + 1 (rounded down), "
                      "not at block 0: masking the keys outside the window gives the right answer in O(N^2)")
def window_work_is_o_n_w(ctx):
    """The kernel's own count of key blocks loaded: exactly the tiles with a key in some row's window, O(N*W)."""
    for nq, nk, w, bm, bn in ((256, 256, 16, 32, 32), (256, 256, 100, 64, 16), (100, 300, 40, 16, 64),
                              (300, 100, 8, 32, 32), (200, 200, 1, 16, 16), (200, 200, 70, 128, 32)):
        q, k, v = _qkv(ctx, 1, 1, 1, nq, nk, 16)
        expect_visits_exact(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=w)
    counts = {}
    for n in (256, 512):
        q, k, v = _qkv(ctx, 1, 1, 1, n, n, 16)
        counts[n] = int(visits(ctx, q, k, v, block_m=32, block_n=32, causal=True, window=32).sum())
    expected = {n: int(needed_tiles(n, n, 32, 32, causal=True, window=32).sum()) for n in counts}
    ctx.expect(counts[512] <= 2.2 * counts[256],
               f"visits (window 32, 32x32 tiles): {counts[256]} key blocks at N = 256 but {counts[512]} at N = 512; "
               f"work that grows with N * W should about double ({expected[256]} -> {expected[512]}), not "
               "quadruple like N^2")


@check(points=1, validation=True)
def window_bad_input(ctx):
    """A window without causal, and windows of 0 or -3, are ValueErrors that say what is wrong."""
    q, k, v = _qkv(ctx, 1, 2, 2, 8, 8, 16)
    ctx.expect_error("flash_attention", q, k, v, window=4, errors=("ValueError",), mentions=["causal"],
                     why="window=4 without causal=True")
    for w in (0, -3):
        ctx.expect_error("flash_attention", q, k, v, causal=True, window=w, errors=("ValueError",),
                         mentions=["window"], why=f"window={w}")


# -- GPU: compiled Triton at real sizes, float16 and bfloat16 ---------------------------------

@check(points=2, gpu=True, hint=WINDOW_HINT)
def gpu_window_real_sizes(ctx):
    """On a GPU: windows 1, 128, 1000 and 4096 at N = 2048, GQA 32/8, D = 64 and 128, float16 and bfloat16."""
    for dtype in (torch.float16, torch.bfloat16):
        for b, hq, hkv, nq, nk, d, w in ((1, 32, 8, 2048, 2048, 128, 128), (1, 8, 2, 2048, 2048, 64, 1),
                                         (2, 8, 8, 1023, 1023, 64, 1000), (1, 8, 2, 2048, 2048, 128, 4096),
                                         (1, 8, 2, 1000, 2048, 128, 300), (1, 8, 2, 2048, 1000, 64, 300)):
            q, k, v = _qkv(ctx, b, hq, hkv, nq, nk, d, dtype=dtype)
            attend(ctx, q, k, v, causal=True, window=w, device=runtime.DEVICE)


@check(points=1, gpu=True, hint="start the loop at the first key block inside the window, not at block 0")
def gpu_window_work_is_o_n_w(ctx):
    """On a GPU: exact block counts at N = 4096, W = 256 with 128x64 and 64x128 tiles; N = 8192 about doubles them."""
    for bm, bn in ((128, 64), (64, 128)):
        q, k, v = _qkv(ctx, 1, 2, 1, 4096, 4096, 64, dtype=torch.bfloat16)
        expect_visits_exact(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=256)
    counts = {}
    for n in (4096, 8192):
        q, k, v = _qkv(ctx, 1, 1, 1, n, n, 64, dtype=torch.float16)
        counts[n] = int(visits(ctx, q, k, v, block_m=128, block_n=64, causal=True, window=256).sum())
    ctx.expect(counts[8192] <= 2.1 * counts[4096],
               f"visits (window 256, 128x64 tiles): {counts[4096]} key blocks at N = 4096 but {counts[8192]} at "
               "N = 8192; work that grows with N * W should about double")
