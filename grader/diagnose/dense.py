"""Float64 attention with every knob a mistake can turn: the mask (kernels/masks.py's rules, placed
where a mistake places them), the scale, the sinks, the K/V head each query head reads, padding keys
let in, and the online softmax with a rescale left out."""

from __future__ import annotations

from kernels import masks

import torch


def visible(nq, nk, *, causal=False, window=None, sink_tokens=0, shift=0, top_left=False) -> torch.Tensor:
    """The dense (nq, nk) mask of these options, optionally misplaced: ``shift`` moves the diagonal,
    ``top_left`` aligns it at key 0."""
    offset = (0 if top_left else masks.diagonal(nq, nk)) + shift
    mask = masks.attention_mask(nq, nk, causal=causal, window=window, sink_tokens=sink_tokens, offset=offset)
    return masks.materialize(mask, nq, nk).clone()


def window_at_row(nq, nk, window, sink_tokens) -> torch.Tensor:
    """The window's own condition placed at the row index i, not at its diagonal: i - W < j (or a sink token)."""
    mask = masks.or_masks(masks.window(window, offset=0), masks.sink_tokens(sink_tokens))
    return masks.materialize(mask, nq, nk)


def kv_heads(hq: int, hkv: int) -> torch.Tensor:
    """The K/V head each of ``hq`` query heads reads (kernels/masks.py's grouping)."""
    return masks.kv_head(torch.arange(hq), hq, hkv)


def per_query_head(t: torch.Tensor, hq: int) -> torch.Tensor:
    """K or V (B, Hkv, N, D) as float64 on the CPU, with the K/V head of every query head: (B, Hq, N, D)."""
    return t.detach().to("cpu", torch.float64)[:, kv_heads(hq, t.shape[1])]


def attend(q, k, v, *, scale, visible, sinks=None, head_map=None, pad_keys=0, pad_visible=None):
    """Dense float64 attention: ``visible`` (Nq, Nk) bool; ``head_map`` maps query head -> kv head;
    ``pad_keys`` appends that many keys with k = v = 0 (an unmasked tail), visible to every row or
    where ``pad_visible`` (Nq, pad_keys) says."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    B, Hq, Nq, D = q.shape
    if head_map is None:
        head_map = kv_heads(Hq, k.shape[1])
    k, v = k[:, head_map], v[:, head_map]
    if pad_keys:
        zeros = torch.zeros(B, Hq, pad_keys, D, dtype=torch.float64)
        k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
        tail = torch.ones(Nq, pad_keys, dtype=torch.bool) if pad_visible is None else pad_visible
        visible = torch.cat([visible, tail], dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.to(torch.float64).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])[..., :v.shape[2]]
    return p @ v, lse


def tiled(q, k, v, *, scale, visible, sinks, block_n, rescale_acc=True, rescale_l=True):
    """The online softmax over key blocks of ``block_n``, in float64, with a rescale left out."""
    q = q.detach().to("cpu", torch.float64)
    B, Hq, Nq, D = q.shape
    k, v = per_query_head(k, Hq), per_query_head(v, Hq)
    m = torch.full((B, Hq, Nq), float("-inf"), dtype=torch.float64)
    l = torch.zeros(B, Hq, Nq, dtype=torch.float64)
    if sinks is not None:
        m = sinks.to(torch.float64).view(1, Hq, 1).expand(B, Hq, Nq).clone()
        l = torch.ones(B, Hq, Nq, dtype=torch.float64)
    acc = torch.zeros(B, Hq, Nq, D, dtype=torch.float64)
    for j0 in range(0, k.shape[2], block_n):
        s = (q @ k[:, :, j0:j0 + block_n].transpose(-1, -2)) * scale
        s = s.masked_fill(~visible[:, j0:j0 + block_n], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, float("-inf")), m) - m_safe)
        p = torch.exp(s - m_safe[..., None])
        l = (l * alpha if rescale_l else l) + p.sum(dim=-1)
        acc = (acc * alpha[..., None] if rescale_acc else acc) + p @ v[:, :, j0:j0 + block_n]
        m = m_new
    o = acc / torch.where(l == 0, torch.ones_like(l), l)[..., None]
    lse = torch.where(l == 0, torch.full_like(l, float("-inf")), m + torch.log(l))
    return o, lse


def scores(q, k, scale) -> torch.Tensor:
    """The scaled scores q.k of every query head with its K/V head, in float64: (B, Hq, Nq, Nk)."""
    return (q.detach().double() @ per_query_head(k, q.shape[1]).transpose(-1, -2)) * scale


def row_max(q, k, scale, vis, sinks):
    """Each row's max scaled score over its visible keys (and the sink): the m of the online softmax."""
    m = scores(q, k, scale).masked_fill(~vis, float("-inf")).amax(dim=-1)
    if sinks is not None:
        m = torch.maximum(m, sinks.double().view(1, -1, 1))
    return m
