"""Helpers for the checks of the masked attention stages (5 causal, 6 GQA, 7 window, 8 sinks).

Every check judges the learner's ``flash_attention`` with the one attention judge
(grader/checks/attention.py), and the block-skipping checks compare the number of key blocks the
learner's kernel says it loaded (``return_visits=True``) with the tiles that hold a visible key,
counted here from the mask itself.
"""

from __future__ import annotations

import torch

from grader.checks.attention import label, visible


def needed_tiles(nq: int, nk: int, block_m: int, block_n: int, **opts) -> torch.Tensor:
    """(query blocks, key blocks) bool: the tiles that hold at least one visible (query, key) pair."""
    dense = visible(nq, nk, **opts)
    n_m, n_n = -(-nq // block_m), -(-nk // block_n)
    padded = torch.zeros(n_m * block_m, n_n * block_n, dtype=torch.bool)
    padded[:nq, :nk] = dense
    return padded.view(n_m, block_m, n_n, block_n).any(dim=3).any(dim=1)


def visits(ctx, q, k, v, *, block_m, block_n, **opts) -> torch.Tensor:
    """The learner's count of key blocks loaded per (b, h, query block), checked for shape and type."""
    what = label(q, k, block_m=block_m, block_n=block_n, **opts)
    out = ctx.learner.flash_attention(q, k, v, block_m=block_m, block_n=block_n, return_visits=True, **opts)
    ctx.expect(isinstance(out, tuple) and len(out) == 3,
               f"flash_attention{what} with return_visits=True must return (o, lse, visits)")
    count = out[2]
    n_m = -(-q.shape[2] // block_m)
    shape = (q.shape[0], q.shape[1], n_m)
    ctx.expect(isinstance(count, torch.Tensor) and tuple(count.shape) == shape,
               f"visits {what}: expected a tensor of shape {shape} (batch, query head, query block), got "
               f"{tuple(count.shape) if isinstance(count, torch.Tensor) else type(count).__name__}")
    ctx.expect(not count.is_floating_point(), f"visits {what}: expected an integer tensor, got {count.dtype}")
    return count


def expect_visits_exact(ctx, q, k, v, *, block_m, block_n, **opts) -> torch.Tensor:
    """Every program loads exactly the key blocks that hold a key visible to one of its rows."""
    count = visits(ctx, q, k, v, block_m=block_m, block_n=block_n, **opts).long()
    what = label(q, k, block_m=block_m, block_n=block_n, **opts)
    tiles = needed_tiles(q.shape[2], k.shape[2], block_m, block_n, **opts)
    need = tiles.sum(dim=1)                                                 # (query blocks,)
    diff = count - need.view(1, 1, -1)
    if bool((count < 0).any()):
        b, h, r = (int(x) for x in (count < 0).nonzero()[0])
        ctx.fail(f"visits {what}: the entry of query block {r} (b={b}, h={h}) was never written (it holds "
                 f"{int(count[b, h, r])}): no program ran for this (batch, head, query block), or it did not "
                 "store its count")
    if bool((diff != 0).any()):
        b, h, r = (int(x) for x in (diff != 0).nonzero()[0])
        blocks = tiles[r].nonzero().flatten().tolist()
        listing = _ranges(blocks) if blocks else "none"
        got, want = int(count[b, h, r]), int(need[r])
        rows = f"rows {r * block_m}..{min(q.shape[2], (r + 1) * block_m) - 1}"
        if got > want:
            cause = ("it loads key blocks in which no row of the block sees any key: the loop should start at "
                     "the first block that holds a visible key and stop after the last one")
        else:
            cause = ("fewer than the blocks that hold visible keys: either it skips keys it needs, or "
                     "visits is not counted once per key block loaded")
        ctx.fail(f"visits {what}: query block {r} ({rows}, b={b}, h={h}) loaded {got} key blocks; "
                 f"{want} hold a key its rows can see (key blocks {listing}).  {got - want:+d}: {cause}")
    return count


def _ranges(blocks: list[int]) -> str:
    out, start = [], blocks[0]
    for prev, cur in zip(blocks, blocks[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}..{prev}" if prev != start else f"{start}")
            start = cur
    return ", ".join(out)
