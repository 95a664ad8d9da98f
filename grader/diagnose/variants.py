"""The attention's known wrong variants: the same attention in float64 with one mistake made on purpose.

Each family is a generator of ``(cause, message, (o, lse))`` (and, for a variant that is only known
for some heads, the (B, Hq) bool of those heads) for one failing call, a :class:`Call`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grader.diagnose import dense
from grader.diagnose.causes import say
from grader.diagnose.common import LN2, LOG2E, tile_state

BLOCKS = (16, 32, 64, 128)      # the key blocks tried where the check did not say


@dataclass
class Call:
    """One failing call, as the variants need it: inputs, options, the mask, and where the error shows."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    given_scale: float | None
    vis: torch.Tensor           # (Nq, Nk) bool: the right mask
    causal: bool
    window: int | None
    sink_tokens: int
    sinks: torch.Tensor | None
    block_m: int | None
    block_n: int | None
    at: str                     # "b=0, head 1, row 5 (query block 0)": the worst error
    o_ref: torch.Tensor
    lse_ref: torch.Tensor
    exp2: bool = True           # the stage's code uses exp2 (advice about log2(e) applies)

    @property
    def shape(self):
        return (*self.q.shape, self.k.shape[1], self.k.shape[2])    # B, Hq, Nq, D, Hkv, Nk

    def attend(self, **change):
        """The float64 attention of this call with ``change`` made (another mask, scale, q, ...)."""
        args = dict(q=self.q, k=self.k, v=self.v, scale=self.scale, visible=self.vis, sinks=self.sinks) | change
        return dense.attend(args.pop("q"), args.pop("k"), args.pop("v"), **args)

    def visible(self, **opts):
        """The dense mask of ``opts`` (causal, window, sink_tokens, shift, top_left) at this call's lengths."""
        return dense.visible(self.q.shape[2], self.k.shape[2], **opts)

    def tiles(self):
        return f"tiles {self.block_m}x{self.block_n}; at {self.at}"


def base_and_scale(c: Call):
    """lse in the wrong base, o not normalised, another softmax scale."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    m_row = dense.row_max(c.q, c.k, c.scale, c.vis, c.sinks)
    l_row = torch.exp(c.lse_ref - torch.where(torch.isinf(m_row), torch.zeros_like(m_row), m_row))
    yield ("lse_log2", say("lse_log2", "in_base_2_exp2" if c.exp2 else "in_base_2", at=c.at),
           (c.o_ref, c.lse_ref * LOG2E))
    yield ("lse_log2", say("lse_log2", "mixed_bases", at=c.at), (c.o_ref, m_row + torch.log2(l_row)))
    yield ("o_not_normalised", say("o_not_normalised", at=c.at), (c.o_ref * l_row[..., None], c.lse_ref))
    # What the output was scaled with, in words: "the scale 1/D = 0.01562", "no scale at all (1)".
    scales = {f"the scale 1/D = {1.0 / D:.4g}": 1.0 / D, "no scale at all: scores are q.k, unscaled": 1.0}
    if c.exp2:
        scales[f"sm_scale x log2(e) = {c.scale * LOG2E:.4g} with exp, not exp2"] = c.scale * LOG2E
        scales[f"sm_scale without log2(e), {c.scale * LN2:.4g} in natural units, while using exp2"] = c.scale * LN2
    pad = 1 << (D - 1).bit_length()
    if pad != D:
        scales[f"the scale 1/sqrt({pad}) = {1.0 / math.sqrt(pad):.4g}, from the padded head dim"] = 1.0 / math.sqrt(pad)
    if c.given_scale is not None:
        scales[f"the default scale 1/sqrt(D) = {1.0 / math.sqrt(D):.4g}, not the sm_scale={c.given_scale:g} passed "
               "in"] = 1.0 / math.sqrt(D)
    for name, other in scales.items():
        if abs(other - c.scale) > 1e-9 * c.scale:    # its lse is off in a way of its own: o alone is compared
            yield ("wrong_scale", say("wrong_scale", "exp2" if c.exp2 else "", used=name, scale=c.scale, at=c.at),
                   (c.attend(scale=other)[0], None))


def edge_heads(B, Hq, Hkv):
    """(B, Hq) bool: the heads whose last row of q, or of their k, ends the tensor."""
    edge = torch.zeros(B, Hq, dtype=torch.bool)
    edge[-1, -1] = True
    edge[-1, Hq - Hq // Hkv:] = True
    return edge


def _unmasked_columns(t, width):
    """What a kernel reads loading ``width`` >= D columns of each row of a contiguous ``t`` without the
    head-dim mask: the next row's first numbers (0 past the end of the tensor)."""
    B, H, N, D = t.shape
    flat = t.detach().reshape(-1).double()
    idx = torch.arange(B * H * N)[:, None] * D + torch.arange(width)[None, :]
    inside = idx < flat.numel()
    return torch.where(inside, flat[idx.clamp(max=flat.numel() - 1)], torch.zeros(())).view(B, H, N, width)


def _restrided(t, row_stride=None, contiguous=False):
    """``t``'s own memory read with another row stride (or as if it were contiguous), or None if that
    would reach outside its storage."""
    if contiguous:
        strides = torch.empty(t.shape).stride()
    else:
        strides = (t.stride(0), t.stride(1), row_stride, t.stride(3))
    if strides == t.stride():
        return None
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, strides))
    if last >= t.untyped_storage().nbytes() // t.element_size():
        return None
    base = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    return torch.as_strided(base, t.shape, strides, t.storage_offset())


def layout(c: Call):
    """Padding columns read without the head-dim mask; a tensor read with the wrong strides."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    pad = 1 << (D - 1).bit_length()
    if pad != D and c.q.is_contiguous() and c.k.is_contiguous() and B * Hq > 1:
        rest = ~edge_heads(B, Hq, Hkv)    # the last heads read past the tensor: what is there is unknown
        yield ("padding_columns_unmasked", say("padding_columns_unmasked", first=D, last=pad - 1, at=c.at),
               c.attend(q=_unmasked_columns(c.q, pad), k=_unmasked_columns(c.k, pad)), rest)
    named = {"q": c.q, "k": c.k, "v": c.v}
    for name, t in named.items():
        tries = [(dict(form="row_stride", other=other), _restrided(t, t2.stride(2)))
                 for other, t2 in named.items() if other != name]
        tries.append((dict(form="contiguous"), _restrided(t, contiguous=True)))
        for how, wrong in tries:
            if wrong is not None:
                yield ("wrong_strides", say("wrong_strides", **how, tensor=name, at=c.at), c.attend(**{name: wrong}))


def masks(c: Call):
    """The causal diagonal, the window, the sinks and the GQA head mapping, each misplaced."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    if c.causal:
        kw = dict(causal=True, window=c.window, sink_tokens=c.sink_tokens)
        if Nq != Nk:
            yield ("causal_top_left", say("causal_top_left", diagonal=Nk - Nq, at=c.at),
                   c.attend(visible=c.visible(top_left=True, **kw)))
        yield ("causal_off_by_one", say("causal_off_by_one", "hides_own_key", at=c.at),
               c.attend(visible=c.visible(shift=-1, **kw)))
        yield ("causal_off_by_one", say("causal_off_by_one", "one_key_too_many", at=c.at),
               c.attend(visible=c.visible(shift=1, **kw)))
        yield ("mask_leak", say("mask_leak", "causal", at=c.at), c.attend(visible=c.visible()))
    if c.window is not None:
        yield ("mask_leak", say("mask_leak", "window", at=c.at), c.attend(visible=c.visible(causal=True)))
        for w, form in ((c.window + 1, "wide"), (c.window - 1, "narrow")):
            if w >= 1:
                yield ("window_off_by_one", say("window_off_by_one", form, at=c.at),
                       c.attend(visible=c.visible(causal=True, window=w, sink_tokens=c.sink_tokens)))
        if Nq != Nk:
            yield ("window_top_left", say("window_top_left", at=c.at),
                   c.attend(visible=dense.window_at_row(Nq, Nk, c.window, c.sink_tokens) & c.visible(causal=True)))
        if c.sink_tokens:
            yield ("sink_tokens_hidden", say("sink_tokens_hidden", sink_tokens=c.sink_tokens, at=c.at),
                   c.attend(visible=c.visible(causal=True, window=c.window)))
    if c.sinks is not None:
        yield ("sinks_ignored", say("sinks_ignored", at=c.at), c.attend(sinks=None))
        yield ("sinks_sign", say("sinks_sign", at=c.at), c.attend(sinks=-c.sinks))
        yield ("sinks_base", say("sinks_base", at=c.at), c.attend(sinks=c.sinks * LN2))
    if Hkv not in (1, Hq):
        yield ("gqa_head_mapping", say("gqa_head_mapping", hq=Hq, hkv=Hkv, group=Hq // Hkv, at=c.at),
               c.attend(head_map=torch.arange(Hq) % Hkv))


def tiles(c: Call):
    """The tiles a diagonal or a window's edge cuts (the masked phase of the loop), mishandled."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    if not (c.causal and c.block_m and c.block_n):
        return
    full, partial = tile_state(c.vis, c.block_m, c.block_n)
    if bool(partial.any()):
        yield ("masked_tiles_dropped", say("masked_tiles_dropped", tiles=c.tiles()),
               c.attend(visible=c.vis & full[:, :Nk]))
        yield ("masked_tiles_unmasked", say("masked_tiles_unmasked", tiles=c.tiles()),
               c.attend(visible=c.vis | partial[:, :Nk], pad_keys=partial.shape[1] - Nk, pad_visible=partial[:, Nk:]))
    if c.window is None:
        return
    causal = c.visible(causal=True)
    causal_full, _ = tile_state(causal, c.block_m, c.block_n)
    far = (partial & causal_full)[:, :Nk]          # tiles cut by the window's far edge only
    visited = (full | partial)[:, :Nk]
    if Nq != Nk:
        yield ("window_top_left", say("window_top_left", "tiles", tiles=c.tiles()),
               c.attend(visible=dense.window_at_row(Nq, Nk, c.window, c.sink_tokens) & causal & visited))
    yield ("window_mask_missing", say("window_mask_missing", tiles=c.tiles()), c.attend(visible=causal & visited))
    if c.sink_tokens:
        w_vis = c.visible(causal=True, window=c.window)
        first = torch.where(w_vis.any(dim=1), w_vis.float().argmax(dim=1), torch.full((Nq,), Nk))
        lo = torch.stack([first[i:i + c.block_m].min() for i in range(0, Nq, c.block_m)]) // c.block_n
        row_lo = lo.repeat_interleave(c.block_m)[:Nq, None]
        yield ("sink_blocks_skipped", say("sink_blocks_skipped", sink_tokens=c.sink_tokens, tiles=c.tiles()),
               c.attend(visible=c.vis & (torch.arange(Nk)[None, :] // c.block_n >= row_lo)))
    if bool(far.any()):
        yield ("window_edge_unmasked", say("window_edge_unmasked", tiles=c.tiles()), c.attend(visible=c.vis | far))
        yield ("window_edge_tile_dropped", say("window_edge_tile_dropped", tiles=c.tiles()),
               c.attend(visible=c.vis & ~far))


def key_blocks(c: Call, heavy: bool):
    """The last, partial key block mishandled; the online softmax's rescale left out."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    blocks = (c.block_n,) if c.block_n else tuple(b for b in BLOCKS if b < 2 * max(Nk, 16))
    for bn in blocks:
        tail = Nk % bn
        if not tail:
            continue
        dropped = c.vis.clone()
        dropped[:, Nk - tail:] = False
        keys = f"key {Nk - 1}" if tail == 1 else f"keys {Nk - tail}..{Nk - 1}"
        yield ("drops_last_key_block", say("drops_last_key_block", keys=keys, block=bn, at=c.at),
               c.attend(visible=dropped))
        if not c.causal:
            yield ("keys_past_nk", say("keys_past_nk", nk=Nk, lanes=bn - tail, first=Nk, last=Nk - tail + bn - 1,
                                       at=c.at), c.attend(pad_keys=bn - tail))
    if heavy:
        return
    for bn in blocks:
        if Nk <= bn:
            continue
        kw = dict(scale=c.scale, visible=c.vis, sinks=c.sinks, block_n=bn)
        yield ("acc_not_rescaled", say("acc_not_rescaled", block=bn, at=c.at),
               dense.tiled(c.q, c.k, c.v, rescale_acc=False, **kw))
        yield ("l_not_rescaled", say("l_not_rescaled", block=bn, at=c.at),
               dense.tiled(c.q, c.k, c.v, rescale_l=False, **kw))
        yield ("no_rescale", say("no_rescale", block=bn, at=c.at),
               dense.tiled(c.q, c.k, c.v, rescale_acc=False, rescale_l=False, **kw))


FAMILIES = (base_and_scale, layout, masks, tiles)
