"""Checks for stage 6: grouped-query and multi-query attention, K/V heads read in place."""

from __future__ import annotations

from kernels import runtime

import torch

from grader.check import check
from grader.checks.attention import attend
from grader.checks.masked_attention import expect_visits_exact

GROUP_HINT = ("query head h reads K/V head h // (Hq // Hkv): heads 0..g-1 share K/V head 0, the next g "
              "share head 1 (not h % Hkv, which interleaves them)")


def _heads(ctx, b, hq, hkv, nq, nk, d, dtype=torch.float32):
    q = ctx.randn(b, hq, nq, d, dtype=dtype)
    return q, ctx.randn(b, hkv, nk, d, dtype=dtype), ctx.randn(b, hkv, nk, d, dtype=dtype)


@check(points=2, hint=GROUP_HINT)
def gqa_groups(ctx):
    """Hq = 8 with Hkv = 8 (MHA), 4, 2 and 1 (groups of 1, 2, 4, 8), causal and not."""
    for hkv in (8, 4, 2, 1):
        q, k, v = _heads(ctx, 1, 8, hkv, 65, 65, 16)
        attend(ctx, q, k, v, block_m=32, block_n=32, causal=True)
        q, k, v = _heads(ctx, 1, 8, hkv, 40, 33, 16)
        attend(ctx, q, k, v, block_m=32, block_n=32)


@check(points=1, hint=GROUP_HINT + "; with Hkv = 1 every query head reads K/V head 0")
def mqa(ctx):
    """Multi-query attention (Hkv = 1) with 6 query heads, Nq != Nk both ways, float16."""
    for nq, nk in ((17, 129), (129, 17)):
        q, k, v = _heads(ctx, 1, 6, 1, nq, nk, 32, dtype=torch.float16)
        attend(ctx, q, k, v, block_m=16, block_n=32, causal=True)


@check(points=1, hint="index K and V by (b, K/V head) with k's and v's own strides; the batch index comes "
                      "from pid // Hq, the query head from pid % Hq")
def gqa_batches_and_strides(ctx):
    """B = 3, groups of 3 (Hq = 6, Hkv = 2), q and k/v non-contiguous with different layouts."""
    q = ctx.randn(3, 50, 6, 32).transpose(1, 2)                            # (B, N, H, D) memory
    k = ctx.randn(3, 2, 32, 70).transpose(2, 3)                            # (B, H, D, N) memory
    v = ctx.randn(70, 3, 2, 32).permute(1, 2, 0, 3)                        # (N, B, H, D) memory
    attend(ctx, q, k, v, block_m=16, block_n=16, causal=True)
    attend(ctx, q, k, v, block_m=32, block_n=16)


@check(points=2, hint="stage 5's rules hold per query head: bottom-right alignment, safe max, l = 0 rows "
                      "give o = 0 and lse = -inf")
def gqa_causal_edge_cases(ctx):
    """Stage 5 still holds under GQA: Nq > Nk (rows with no key), asymmetric tiles, lengths 1 and 129."""
    for nq, nk, bm, bn in ((150, 40, 32, 16), (129, 129, 128, 32), (1, 129, 16, 64), (129, 1, 16, 16)):
        q, k, v = _heads(ctx, 1, 4, 2, nq, nk, 16)
        attend(ctx, q, k, v, block_m=bm, block_n=bn, causal=True)


@check(points=1, hint="one program per (batch, query head) and query block: the grid is "
                      "(cdiv(Nq, block_m), B * Hq), and each skips the blocks above its diagonal")
def gqa_blocks_skipped(ctx):
    """Every query head's program loads exactly the key blocks that hold a visible key."""
    q, k, v = _heads(ctx, 2, 4, 1, 100, 130, 16)
    expect_visits_exact(ctx, q, k, v, block_m=32, block_n=16, causal=True)


@check(points=1, validation=True)
def gqa_bad_heads(ctx):
    """Hq % Hkv != 0 is a ValueError that names the heads (6 and 4; 2 and 4)."""
    for hq, hkv in ((6, 4), (2, 4)):
        q, k, v = _heads(ctx, 1, hq, hkv, 8, 8, 16)
        ctx.expect_error("flash_attention", q, k, v, causal=True, errors=("ValueError",), mentions=["heads"],
                         why=f"q with {hq} heads and k/v with {hkv}")


# -- GPU: compiled Triton at real sizes, float16 and bfloat16 ---------------------------------

@check(points=2, gpu=True, hint=GROUP_HINT)
def gpu_gqa_real_sizes(ctx):
    """On a GPU: Hq = 32 with Hkv = 8 and MQA, N = 1023 and 2048, D = 64 and 128, float16 and bfloat16."""
    for dtype in (torch.float16, torch.bfloat16):
        for b, hq, hkv, nq, nk, d, causal in ((1, 32, 8, 1023, 1023, 128, True), (1, 32, 8, 2048, 2048, 64, False),
                                              (1, 16, 1, 2048, 2048, 128, True), (1, 8, 2, 1000, 2048, 64, True),
                                              (2, 8, 2, 2048, 1000, 128, True)):
            q, k, v = _heads(ctx, b, hq, hkv, nq, nk, d, dtype=dtype)
            attend(ctx, q, k, v, causal=causal, device=runtime.DEVICE)
