"""Which known mistake explains a wrong row softmax (stages 1 and 2) or weighted row sum (stage 2)."""

from __future__ import annotations

import torch

from grader.diagnose.causes import Diagnosis, found, say
from grader.diagnose.common import best_fit


def _softmax_tiled(x, block, *, rescale=True, pad_zero=False, drop_last=False):
    """A row softmax by blocks of ``block`` in float64, with one known mistake."""
    x = x.detach().double()
    n = x.shape[-1]
    m = torch.full(x.shape[:-1], float("-inf"), dtype=torch.float64)
    l = torch.zeros(x.shape[:-1], dtype=torch.float64)
    stop = (n - 1) // block * block if drop_last else n      # where the last block, whole or partial, starts
    for j0 in range(0, stop, block):
        xb = x[..., j0:j0 + block]
        if pad_zero and xb.shape[-1] < block:
            xb = torch.cat([xb, torch.zeros(*xb.shape[:-1], block - xb.shape[-1], dtype=torch.float64)], dim=-1)
        m_new = torch.maximum(m, xb.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m) - m_safe)
        l = (l * alpha if rescale else l) + torch.exp(xb - m_safe[..., None]).sum(dim=-1)
        m = m_new
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(x - m_safe[..., None])
    return e / torch.where(l == 0, torch.ones_like(l), l)[..., None]


def softmax(out, x, *, allowed: float, block: int | None = None) -> Diagnosis | None:
    """The most likely known mistake behind a wrong row softmax of ``x`` (last dim), or None."""
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    got, xd = out.detach().double(), x.detach().double()
    ref = _softmax_tiled(xd, max(1, xd.shape[-1]))
    bad = ~torch.isfinite(got)
    flat_bad = bad.reshape(-1, x.shape[-1]).any(dim=1)
    xrows = xd.reshape(-1, x.shape[-1])
    # All NaN, though every row has a value to take (a row of -inf alone gives NaN by a missing m_safe):
    if got.numel() > 1 and bool(torch.isnan(got).all()) and bool(torch.isfinite(xrows).any(dim=1).all()):
        return found("nan_unwritten", "softmax")
    if bool(flat_bad.any()):
        rows = flat_bad.nonzero().flatten().tolist()
        masked_rows = [r for r in rows if bool(torch.isneginf(xrows[r]).any())]
        finite = torch.where(torch.isfinite(xrows), xrows.abs(), torch.zeros_like(xrows))
        big = [r for r in rows if float(finite[r].max()) > 80]
        where = f"rows {rows[:6]}{' ...' if len(rows) > 6 else ''}"
        if len(masked_rows) == len(rows):
            return found("nan_masked_tile", "softmax", rows=where)
        if len(big) == len(rows):
            return found("overflow", rows=where, peak=float(finite[big[0]].max()))
        return found("nan", "softmax", rows=where)
    allowed = max(allowed, 1e-12)
    blocks = (block,) if block else tuple(b for b in (16, 32, 64, 128, 256, 1024) if b < x.shape[-1])
    candidates = []
    for bn in blocks:
        candidates.append(("softmax_no_rescale", say("softmax_no_rescale", block=bn),
                           _softmax_tiled(xd, bn, rescale=False)))
        if x.shape[-1] % bn:
            candidates.append(("softmax_pads_with_zero", say("softmax_pads_with_zero", block=bn),
                               _softmax_tiled(xd, bn, pad_zero=True)))
        candidates.append(("softmax_drops_last_block", say("softmax_drops_last_block", block=bn),
                           _softmax_tiled(xd, bn, drop_last=True)))
    # a variant may reach far past 1 (no max taken): the tolerance grows with it
    return best_fit(got, ref, candidates, lambda var: allowed * max(1.0, float(var.abs().max())))


def _read_as(t, strides):
    """What a kernel reads addressing 2-D ``t``'s memory with other ``strides``: (values, rows read
    wholly inside the tensor's storage); elements outside it are unknown (0 here, rows left out)."""
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage()).double()
    offsets = (t.storage_offset() + torch.arange(t.shape[0])[:, None] * strides[0]
               + torch.arange(t.shape[1])[None, :] * strides[1])
    inside = (offsets >= 0) & (offsets < flat.numel())
    values = torch.where(inside, flat[offsets.clamp(0, max(flat.numel() - 1, 0))], torch.zeros(()))
    return values, inside.all(dim=1)


def row_sum(out, x, w, *, allowed: float, block: int | None = None) -> Diagnosis | None:
    """The most likely known mistake behind a wrong ``(x * w).sum(-1)``, or None."""
    if not isinstance(out, torch.Tensor) or out.shape != x.shape[:1]:
        return None
    got, xd, wd = out.detach().double(), x.detach().double(), w.detach().double()
    ref = (xd * wd).sum(-1)
    n = x.shape[1]
    allowed = max(allowed, 1e-12)
    candidates = []
    for bn in (block,) if block else (16, 32, 64, 128, 256):
        blocks = -(-n // bn)
        for kept, form in (((blocks - 1) * bn, "last_block"), (n // bn * bn, "whole_blocks")):
            if 0 <= kept < n:
                lost = f"column {kept} is" if kept == n - 1 else f"columns {kept}..{n - 1} are"
                message = say("row_sum_drops_last_block", form, block=bn, lost=lost)
                candidates.append(("row_sum_drops_last_block", message, (xd[:, :kept] * wd[:kept]).sum(-1), None))
    for strides, form in (((x.stride(0), 1), "x_column_stride"), ((n, x.stride(1)), "x_row_start")):
        if strides != tuple(x.stride()):
            values, rows = _read_as(x, strides)
            candidates.append(("wrong_strides", say("wrong_strides", form, strides=tuple(x.stride())),
                               (values * wd).sum(-1), rows))
    return best_fit(got, ref, candidates, allowed)
