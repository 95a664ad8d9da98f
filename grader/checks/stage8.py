"""Checks for stage 8: attention sinks, both kinds: sink tokens (StreamingLLM) and learned sinks (gpt-oss)."""

from __future__ import annotations

from kernels import runtime

import torch

from grader.check import check
from grader.checks.attention import attend
from grader.checks.masked_attention import expect_visits_exact, needed_tiles, visits

TOKENS_HINT = ("keys j < sink_tokens stay visible whatever the window (but never past the row's diagonal): "
               "visit their blocks as a range of their own, masked, that stops where the window's range starts")
SINKS_HINT = ("a learned sink is a key with logit sinks[h] (natural log) and value 0: start m at sinks[h] * log2(e) "
              "and l at 1, so lse = log(exp(sinks[h]) + sum exp(s)) and a row with no key gets lse = sinks[h]")


def _qkv(ctx, b, hq, hkv, nq, nk, d, dtype=torch.float32):
    q = ctx.randn(b, hq, nq, d, dtype=dtype)
    return q, ctx.randn(b, hkv, nk, d, dtype=dtype), ctx.randn(b, hkv, nk, d, dtype=dtype)


def _sinks(ctx, hq, low=-30.0, high=40.0):
    """One logit per query head, spread over [low, high] with both ends present."""
    s = ctx.uniform(hq, low=low, high=high)
    s[0], s[-1] = low, high
    return s


@check(points=2, hint=TOKENS_HINT)
def sink_tokens_with_window(ctx):
    """N = 129, windows 1, 16 and 64 with 1, 4 and 40 sink tokens (40 spans more than one key block)."""
    q, k, v = _qkv(ctx, 1, 2, 2, 129, 129, 16)
    for w, s, bm, bn in ((1, 1, 32, 32), (16, 4, 32, 32), (64, 4, 16, 64), (1, 40, 32, 32), (16, 40, 64, 16),
                         (64, 40, 16, 16)):
        attend(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=w, sink_tokens=s)


@check(points=1, hint="sink tokens only widen a window: without one, causal attention sees them anyway, and "
                      "sink_tokens=0 is stage 7")
def sink_tokens_edge_cases(ctx):
    """sink_tokens 0, 1 and 4 without a window, 0 with one, more sink tokens than keys, and N = 1 and 17."""
    q, k, v = _qkv(ctx, 1, 2, 1, 100, 100, 16)
    for s in (0, 1, 4):
        attend(ctx, q, k, v, block_m=32, block_n=32, causal=True, sink_tokens=s)
    attend(ctx, q, k, v, block_m=32, block_n=32, causal=True, window=8, sink_tokens=0)
    attend(ctx, q, k, v, block_m=32, block_n=32, causal=True, window=8, sink_tokens=500)
    for n in (1, 17):
        q, k, v = _qkv(ctx, 1, 1, 1, n, n, 16)
        attend(ctx, q, k, v, block_m=16, block_n=16, causal=True, window=2, sink_tokens=4)


@check(points=1, hint="sink tokens are visible only causally: with Nq > Nk the first rows still see no key, "
                      "and their o is 0 and lse -inf")
def sink_tokens_bottom_right(ctx):
    """Nq != Nk both ways with a window and sink tokens, asymmetric tiles."""
    for nq, nk, w, s, bm, bn in ((17, 129, 5, 4, 16, 32), (129, 17, 3, 4, 32, 16), (60, 200, 20, 40, 16, 64),
                                 (200, 60, 10, 4, 128, 32)):
        q, k, v = _qkv(ctx, 1, 2, 2, nq, nk, 16)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=w, sink_tokens=s)


@check(points=2, hint="visit only the sink tokens' own blocks, [0, cdiv(S, block_n) * block_n) and not past "
                      "the window's first block, then the window's ranges: never every block from 0")
def sink_tokens_visited_not_scanned(ctx):
    """The kernel's own count of key blocks loaded: exactly the tiles with a visible key, O(N * (W + S))."""
    for nq, nk, w, s, bm, bn in ((256, 256, 16, 4, 32, 32), (256, 256, 16, 4, 16, 64), (256, 256, 30, 40, 64, 16),
                                 (200, 200, 1, 40, 16, 16), (100, 260, 20, 4, 32, 32), (260, 100, 20, 4, 32, 32)):
        q, k, v = _qkv(ctx, 1, 1, 1, nq, nk, 16)
        expect_visits_exact(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=w, sink_tokens=s)
    counts = {}
    for n in (256, 512):
        q, k, v = _qkv(ctx, 1, 1, 1, n, n, 16)
        counts[n] = int(visits(ctx, q, k, v, block_m=32, block_n=32, causal=True, window=32, sink_tokens=4).sum())
    expected = {n: int(needed_tiles(n, n, 32, 32, causal=True, window=32, sink_tokens=4).sum()) for n in counts}
    ctx.expect(counts[512] <= 2.2 * counts[256],
               f"visits (window 32, 4 sink tokens, 32x32 tiles): {counts[256]} key blocks at N = 256 but "
               f"{counts[512]} at N = 512; work that grows with N * (W + S) should about double "
               f"({expected[256]} -> {expected[512]}), not quadruple like N^2")


@check(points=2, hint=SINKS_HINT)
def learned_sinks(ctx):
    """Learned sinks from -30 to +40 (one per head), causal and not, Nq != Nk: o and lse (which includes the sink)."""
    for nq, nk, causal in ((129, 129, False), (100, 150, True), (17, 129, False)):
        q, k, v = _qkv(ctx, 1, 6, 2, nq, nk, 16)
        sinks = _sinks(ctx, 6)
        attend(ctx, q, k, v, block_m=32, block_n=32, causal=causal, sinks=sinks)
    q, k, v = _qkv(ctx, 1, 4, 4, 64, 64, 16, dtype=torch.float16)
    attend(ctx, q, k, v, block_m=16, block_n=32, causal=True, sinks=_sinks(ctx, 4, low=-3.0, high=3.0))


@check(points=1, hint="with a learned sink every row starts at m = sinks[h] * log2(e), l = 1: a row that sees "
                      "no key keeps them, so o = 0 / 1 = 0 and lse = sinks[h]")
def learned_sinks_rows_that_see_no_key(ctx):
    """Nq > Nk causal with learned sinks: rows that see no key give o = 0 and lse = sinks[h], never NaN."""
    for nq, nk, bm, bn in ((150, 40, 32, 16), (70, 3, 16, 64)):
        q, k, v = _qkv(ctx, 2, 4, 2, nq, nk, 16)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, sinks=_sinks(ctx, 4))


@check(points=2, hint="the complete forward: every feature at once; the usual suspect is a range of key blocks "
                      "visited twice, or a mask term applied in one phase and not another")
def everything_together(ctx):
    """GQA, causal, Nq != Nk, a window, sink tokens and learned sinks at once, float16 and float32, odd tiles."""
    for dtype, (nq, nk, w, s, bm, bn, d) in ((torch.float16, (130, 90, 10, 4, 32, 16, 48)),
                                             (torch.float32, (90, 130, 24, 40, 16, 64, 32)),
                                             (torch.float16, (129, 129, 1, 1, 128, 32, 64))):
        q, k, v = _qkv(ctx, 1, 4, 2, nq, nk, d, dtype=dtype)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=w, sink_tokens=s, sinks=_sinks(ctx, 4))


@check(points=1, validation=True)
def sinks_bad_input(ctx):
    """sinks of the wrong shape or dtype and negative sink_tokens are errors that name the argument."""
    q, k, v = _qkv(ctx, 1, 4, 2, 8, 8, 16)
    ctx.expect_error("flash_attention", q, k, v, sinks=ctx.randn(2), errors=("ValueError",), mentions=["sinks"],
                     why="sinks of shape (2,) for 4 query heads")
    ctx.expect_error("flash_attention", q, k, v, sinks=ctx.randn(4, dtype=torch.float16), mentions=["sinks"],
                     why="sinks in float16")
    ctx.expect_error("flash_attention", q, k, v, causal=True, window=4, sink_tokens=-1, errors=("ValueError",),
                     mentions=["sink_tokens"], why="sink_tokens=-1")


# -- GPU: compiled Triton at real sizes, float16 and bfloat16 ---------------------------------

@check(points=2, gpu=True, hint=SINKS_HINT)
def gpu_sinks_real_sizes(ctx):
    """On a GPU: gpt-oss-like GQA (Hq 32, Hkv 8), N = 2048, D = 64 and 128, window + sink tokens + learned sinks."""
    for dtype in (torch.float16, torch.bfloat16):
        for b, hq, hkv, nq, nk, d, opts in (
                (1, 8, 2, 2048, 2048, 64, dict(causal=True, window=128, sink_tokens=4)),
                (1, 32, 8, 2048, 2048, 64, dict(causal=True, window=128, sink_tokens=4, sinks=True)),
                (1, 8, 2, 2048, 2048, 128, dict(sinks=True)),
                (2, 8, 2, 1023, 1023, 128, dict(causal=True, sinks=True)),
                (1, 16, 4, 1000, 2048, 64, dict(causal=True, window=300, sink_tokens=70, sinks=True)),
                (1, 16, 4, 2048, 1000, 64, dict(causal=True, window=300, sink_tokens=70, sinks=True))):
            q, k, v = _qkv(ctx, b, hq, hkv, nq, nk, d, dtype=dtype)
            if opts.get("sinks"):
                opts = dict(opts, sinks=_sinks(ctx, hq))
            attend(ctx, q, k, v, device=runtime.DEVICE, **opts)


@check(points=1, gpu=True, hint=TOKENS_HINT)
def gpu_sink_tokens_visited_not_scanned(ctx):
    """On a GPU: exact block counts at N = 4096 with W = 256 and 4 or 200 sink tokens, 128x64 and 64x128 tiles."""
    for bm, bn, s in ((128, 64, 4), (64, 128, 200), (128, 64, 200)):
        q, k, v = _qkv(ctx, 1, 2, 1, 4096, 4096, 64, dtype=torch.bfloat16)
        expect_visits_exact(ctx, q, k, v, block_m=bm, block_n=bn, causal=True, window=256, sink_tokens=s)
