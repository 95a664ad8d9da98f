"""Attention masks as small functions that compose: the one place the workbook says which
(query, key) pairs are visible.

A mask is a function ``mask(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's ``mask_mod``
shape): it says whether query ``q_idx`` may attend to key ``kv_idx``.  Called with
broadcastable integer tensors it returns a boolean tensor, so the same function serves the
float64 reference (``materialize``), the grader's diagnoses, the benchmark's FLOP counts
(``count``), FlexAttention's block masks and the notebook pictures.

Positions follow the workbook's conventions (see ``kernels.reference.attention``):

    causal, bottom-right aligned      query i sees key j  iff  j <= i + (Nk - Nq)
    sliding window W (with causal)    i' - W < j <= i'          where i' = i + (Nk - Nq)
    sink tokens S                     keys j < S stay visible whatever the window
    grouped-query heads               query head h reads K/V head h // (Hq // Hkv)

The diagonal's place, ``i' - i``, is ``diagonal(nq, nk) = Nk - Nq``; ``causal`` and ``window``
take another ``offset`` (0 aligns them top-left; a 0-d tensor is read when the mask is called).

>>> visible = and_masks(causal(nq=4, nk=6), or_masks(window(2, nq=4, nk=6), sink_tokens(1)))
>>> materialize(visible, 4, 6).int()
tensor([[1, 1, 1, 0, 0, 0],
        [1, 0, 1, 1, 0, 0],
        [1, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 1, 1]], dtype=torch.int32)
"""

from __future__ import annotations

from typing import Callable

import torch

Mask = Callable[[object, object, torch.Tensor, torch.Tensor], torch.Tensor]


def diagonal(nq: int, nk: int) -> int:
    """Where query i lines up among the keys, less i: the last query with the last key (bottom-right)."""
    return nk - nq


def _offset(nq, nk, offset):
    if offset is not None:
        return offset
    if nq is None or nk is None:
        raise TypeError("a mask needs nq and nk, or the offset of its diagonal")
    return diagonal(nq, nk)


def full() -> Mask:
    """Every query sees every key."""
    return lambda b, h, q, kv: torch.ones_like(q + kv, dtype=torch.bool)


def causal(nq: int | None = None, nk: int | None = None, *, offset=None) -> Mask:
    """Bottom-right aligned causal mask: the last query sees the last key.

    Query i sees keys j <= i + offset; ``offset`` is ``diagonal(nq, nk)`` unless given.
    """
    offset = _offset(nq, nk, offset)
    return lambda b, h, q, kv: kv <= q + offset


def window(w, nq: int | None = None, nk: int | None = None, *, offset=None) -> Mask:
    """The ``w`` most recent keys up to the query's own (aligned) position, inclusive.

    Use it with ``causal``: on its own it also admits keys in the future.  ``w`` may be a 0-d
    tensor, read when the mask is called.
    """
    if not isinstance(w, torch.Tensor) and w < 1:
        raise ValueError(f"window must be at least 1, got {w}")
    offset = _offset(nq, nk, offset)
    return lambda b, h, q, kv: kv > q + offset - w


def sink_tokens(s) -> Mask:
    """The first ``s`` keys (StreamingLLM's attention sinks)."""
    return lambda b, h, q, kv: kv < s


def kv_head(h, hq: int, hkv: int):
    """The K/V head query head ``h`` (an int or a tensor of them) reads with grouped-query attention:
    each K/V head serves ``hq // hkv`` consecutive query heads (one: multi-head; all: multi-query)."""
    return h // (hq // hkv)


def and_masks(*masks: Mask) -> Mask:
    """Visible where every mask says visible."""
    def mask(b, h, q, kv):
        out = masks[0](b, h, q, kv)
        for m in masks[1:]:
            out = out & m(b, h, q, kv)
        return out
    return mask


def or_masks(*masks: Mask) -> Mask:
    """Visible where any mask says visible."""
    def mask(b, h, q, kv):
        out = masks[0](b, h, q, kv)
        for m in masks[1:]:
            out = out | m(b, h, q, kv)
        return out
    return mask


def attention_mask(nq: int | None = None, nk: int | None = None, *, causal: bool = False,
                   window=None, sink_tokens=0, offset=None) -> Mask:
    """The mask the workbook's attention uses for these options.

    ``causal AND (window OR sink_tokens)``: sink tokens only widen a window, and neither
    ever lets a query see a key in its future.  ``offset`` places the diagonal elsewhere (see
    ``causal``); a 0-d tensor ``window`` or ``sink_tokens`` is read when the mask is called.
    """
    if not causal:
        return full()
    offset = _offset(nq, nk, offset)
    m = _causal(offset=offset)
    if window is None:
        return m
    w = _window(window, offset=offset)
    if isinstance(sink_tokens, torch.Tensor) or sink_tokens > 0:
        w = or_masks(w, _sink_tokens(sink_tokens))
    return and_masks(m, w)


_causal, _window, _sink_tokens = causal, window, sink_tokens


def materialize(mask: Mask, nq: int, nk: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """The mask as a dense ``(nq, nk)`` boolean tensor.  Only for references and pictures."""
    q = torch.arange(nq, device=device)[:, None]
    kv = torch.arange(nk, device=device)[None, :]
    return mask(0, 0, q, kv).expand(nq, nk)


def count(mask: Mask, nq: int, nk: int, *, rows: int = 1024) -> int:
    """How many (query, key) pairs ``mask`` lets through, ``rows`` query rows at a time (a dense
    mask at a benchmark's sizes would take gigabytes)."""
    kv = torch.arange(nk)[None, :]
    total = 0
    for start in range(0, nq, rows):
        q = torch.arange(start, min(start + rows, nq))[:, None]
        total += int(mask(0, 0, q, kv).expand(q.shape[0], nk).sum())
    return total
