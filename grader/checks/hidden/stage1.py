"""Hidden checks for stage 1 (an example: a course keeps its own in a private copy)."""

from __future__ import annotations

import torch

from grader.check import check
from grader.checks.stage1 import _attention_close


@check(points=1, hidden=True, hint="slice q, k and v with i0:i0 + block_m and j0:j0 + block_n; Python clips "
                                   "a slice at the end of the tensor")
def attention_tiles_larger_than_the_sequence(ctx):
    """Tiles larger than the whole sequence, a single key, and a single query."""
    for nq, nk, bm, bn in ((5, 3, 64, 128), (9, 1, 16, 16), (1, 40, 32, 8)):
        q, k, v = (ctx.randn(1, 2, n, 16, dtype=torch.float16, scale=2.0) for n in (nq, nk, nk))
        _attention_close(ctx, q, k, v, block_m=bm, block_n=bn, label=f"(Nq={nq}, Nk={nk}, {bm}x{bn} tiles)")
