"""NaN in an attention's output: diagnosed only where NaN occurred, and by which rows hold it."""

from __future__ import annotations

import torch

from grader.diagnose.causes import Diagnosis, found
from grader.diagnose.common import rows, tile_state, where


def nan(o, lse, visible, block_m, block_n=None) -> Diagnosis | None:
    """Why (o, lse) hold NaN, from the rows that do (``visible``: the (Nq, Nk) mask); None without NaN."""
    bad = torch.isnan(o.detach().double()).flatten(3).any(dim=3) | torch.isnan(lse.detach().double())
    if not bool(bad.any()):
        return None
    in_rows = bad.any(dim=1).any(dim=0)                 # (Nq,) rows with NaN in some batch and head
    b, h, i = (int(x) for x in bad.nonzero()[0])
    at = f"{int(bad.sum())} rows, first at {where((b, h, i), block_m)}"
    empty = ~visible.any(dim=1)
    if bool(empty.any()) and bool((in_rows <= empty).all()):
        return found("nan_empty_rows", rows=rows(empty), at=at)
    first_key = torch.where(visible.any(dim=1), visible.float().argmax(dim=1), torch.zeros(visible.shape[0]).long())
    blind = first_key > 0                               # rows whose first key tile may hold nothing for them
    if block_m and block_n:                             # rows with a tile, visited for their block, blind to them
        full, partial = tile_state(visible, block_m, block_n)
        nk = visible.shape[1]
        seen = (full | partial)[:, :nk]
        tile_of = torch.arange(nk) // block_n
        blind = torch.zeros(visible.shape[0], dtype=torch.bool)
        for t in range(-(-nk // block_n)):
            cols = tile_of == t
            blind |= seen[:, cols].any(dim=1) & ~visible[:, cols].any(dim=1)
    if bool((blind[in_rows & ~empty]).all()):
        return found("nan_masked_tile", at=at)
    if block_m and bool(in_rows.any()):
        blocks = sorted({i // block_m for i in in_rows.nonzero().flatten().tolist()})
        full = [blk for blk in blocks if bool(in_rows[blk * block_m:(blk + 1) * block_m].all())]
        if full and len(full) == len(blocks):
            return found("nan_unwritten", blocks=blocks[:6], at=at)
    return found("nan", at=at)
