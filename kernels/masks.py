"""Attention masks as small functions that compose.

A mask is a function ``mask(b, h, q_idx, kv_idx) -> bool`` (FlexAttention's ``mask_mod``
shape): it says whether query ``q_idx`` may attend to key ``kv_idx``.  Called with
broadcastable integer tensors it returns a boolean tensor, so the same function serves the
float64 reference (``materialize``) and the notebook pictures.

Positions follow the workbook's conventions (see ``kernels.reference.attention``):

    causal, bottom-right aligned      query i sees key j  iff  j <= i + (Nk - Nq)
    sliding window W (with causal)    i' - W < j <= i'          where i' = i + (Nk - Nq)
    sink tokens S                     keys j < S stay visible whatever the window

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


def full() -> Mask:
    """Every query sees every key."""
    return lambda b, h, q, kv: torch.ones_like(q + kv, dtype=torch.bool)


def causal(nq: int, nk: int) -> Mask:
    """Bottom-right aligned causal mask: the last query sees the last key."""
    offset = nk - nq
    return lambda b, h, q, kv: kv <= q + offset


def window(w: int, nq: int, nk: int) -> Mask:
    """The ``w`` most recent keys up to the query's own (aligned) position, inclusive.

    Use it with ``causal``: on its own it also admits keys in the future.
    """
    if w < 1:
        raise ValueError(f"window must be at least 1, got {w}")
    offset = nk - nq
    return lambda b, h, q, kv: kv > q + offset - w


def sink_tokens(s: int) -> Mask:
    """The first ``s`` keys (StreamingLLM's attention sinks)."""
    return lambda b, h, q, kv: kv < s


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


def attention_mask(nq: int, nk: int, *, causal: bool = False, window: int | None = None,
                   sink_tokens: int = 0) -> Mask:
    """The mask the workbook's attention uses for these options.

    ``causal AND (window OR sink_tokens)``: sink tokens only widen a window, and neither
    ever lets a query see a key in its future.
    """
    if not causal:
        return full()
    m = _causal(nq, nk)
    if window is None:
        return m
    w = _window(window, nq, nk)
    if sink_tokens > 0:
        w = or_masks(w, _sink_tokens(sink_tokens))
    return and_masks(m, w)


_causal, _window, _sink_tokens = causal, window, sink_tokens


def materialize(mask: Mask, nq: int, nk: int, *, device: torch.device | str = "cpu") -> torch.Tensor:
    """The mask as a dense ``(nq, nk)`` boolean tensor.  Only for references and pictures."""
    q = torch.arange(nq, device=device)[:, None]
    kv = torch.arange(nk, device=device)[None, :]
    return mask(0, 0, q, kv).expand(nq, nk)
