"""Which known mistake explains wrong gradients (stage 9): NaN by where it is, else the float64
backward with one mistake switched on that dq, dk, dv and d(sinks) fit together."""

from __future__ import annotations

import math

import torch

from grader.diagnose import dense
from grader.diagnose.causes import Diagnosis, found, headline, say
from grader.diagnose.common import DENSE_LIMIT, FIT, rows, safely


def _grads(q, k, v, do, *, scale, visible, sinks=None, minus_delta=True, dq_scale=True, dk_scale=True,
           group_sum=True, sink_in_lse=True, dsinks_sign=1.0, mask_p=True, dq_kv_head_modulo=False):
    """dq, dk, dv, dsinks of dense float64 attention by the backward's own formulas, with one
    known mistake switched on:

        P = exp(S - lse)          (lse with the sink unless ``sink_in_lse`` is off; masked keys
                                   left in P with ``mask_p`` off, the forward's o and lse kept)
        delta = rowsum(dO * O)    dS = P * (dP - delta)      (no "- delta": ``minus_delta`` off)
        dq = scale dS K           dk = scale dS^T Q          dv = P^T dO
        dk, dv summed over each GQA group's query heads (only its first: ``group_sum`` off)
        dsinks = -sum over rows of exp(sink - lse) * delta
        dq of query head h from K/V head h // group (h % Hkv with ``dq_kv_head_modulo``, its
        lse and delta kept)
    """
    q, k, v, do = (t.detach().to("cpu", torch.float64) for t in (q, k, v, do))
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    kr, vr = dense.per_query_head(k, Hq), dense.per_query_head(v, Hq)
    raw = (q @ kr.transpose(-1, -2)) * scale
    s = raw.masked_fill(~visible, float("-inf"))
    keys_lse = torch.logsumexp(s, dim=-1)
    sink = sinks.detach().to(torch.float64).view(1, Hq, 1) if sinks is not None else None
    lse = torch.logaddexp(keys_lse, sink.expand_as(keys_lse)) if sink is not None else keys_lse

    def safe(x):                                               # rows that see nothing: -inf becomes 0
        return torch.where(torch.isinf(x), torch.zeros_like(x), x)

    o = torch.exp(s - safe(lse)[..., None]) @ vr
    used = lse if sink_in_lse else keys_lse
    p = torch.exp((s if mask_p else raw) - safe(used)[..., None])
    dp = do @ vr.transpose(-1, -2)
    delta = (do * o).sum(dim=-1)
    ds = p * (dp - delta[..., None]) if minus_delta else p * dp
    if dq_kv_head_modulo:                                      # only dq's K and V come from the wrong head
        kw, vw = (t[:, torch.arange(Hq) % Hkv] for t in (k, v))
        pw = torch.exp(((q @ kw.transpose(-1, -2)) * scale).masked_fill(~visible, float("-inf"))
                       - safe(used)[..., None])
        dq = (pw * (do @ vw.transpose(-1, -2) - delta[..., None])) @ kw * (scale if dq_scale else 1.0)
    else:
        dq = (ds @ kr) * (scale if dq_scale else 1.0)
    dk_h = (ds.transpose(-1, -2) @ q) * (scale if dk_scale else 1.0)
    dv_h = p.transpose(-1, -2) @ do

    def fold(t):
        t = t.view(B, Hkv, group, Nk, D)
        return t.sum(dim=2) if group_sum else t[:, :, 0]

    dsinks = None
    if sink is not None:
        dsinks = -dsinks_sign * (torch.exp(sink - safe(used)) * delta).sum(dim=(0, 2))
    return dq, fold(dk_h), fold(dv_h), dsinks


def _sink_takes_all(q, k, scale, vis, sinks, rows) -> bool:
    """Whether every (b, h, i) in ``rows`` gives its sink at least 99 % of its weight."""
    keys = torch.logsumexp(dense.scores(q, k, scale).masked_fill(~vis, float("-inf")), dim=-1)
    sink = sinks.detach().double().view(1, -1, 1).expand_as(keys)
    share = torch.exp(sink - torch.logaddexp(keys, sink))
    return bool(rows.any()) and bool((share[rows] > 0.99).all())


#: The backward's known mistakes, each the switch of ``_grads`` that makes it (None: d(sinks) zeroed).
GRADIENT_VARIANTS = {
    "backward_without_delta": dict(minus_delta=False),
    "dq_unscaled": dict(dq_scale=False),
    "dk_unscaled": dict(dk_scale=False),
    "gqa_first_head_only": dict(group_sum=False),
    "lse_without_sink": dict(sink_in_lse=False),
    "mask_ignored": dict(mask_p=False),
    "dsinks_sign_flipped": dict(dsinks_sign=-1.0),
    "gqa_head_mapping": dict(dq_kv_head_modulo=True),
}
_FORM = {"gqa_head_mapping": "dq"}              # the backward's message of a cause the forward has too


def gradients(got: dict, q, k, v, do, opts: dict, *, allowed: dict) -> Diagnosis | None:
    """The most likely known mistake behind wrong gradients, or None.

    ``got`` and ``allowed`` map "dq", "dk", "dv" (and "dsinks" with learned sinks) to the learner's
    gradient and the error the tolerance allows it.  A variant explains them when every gradient
    is within a few tolerances of the variant's and the variant differs from the right answer.
    """
    names = [n for n in ("dq", "dk", "dv", "dsinks") if got.get(n) is not None and n in allowed]
    if not all(isinstance(got[n], torch.Tensor) for n in names):
        return None
    causal, window = bool(opts.get("causal")), opts.get("window")
    sink_tokens, sinks = opts.get("sink_tokens") or 0, opts.get("sinks")
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    if B * Hq * Nq * Nk > 4 * DENSE_LIMIT:
        return None
    scale = opts.get("sm_scale") or 1.0 / math.sqrt(D)
    vis = dense.visible(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens)
    empty = ~vis.any(dim=1)
    for n in names:
        bad = ~torch.isfinite(got[n].detach().double())
        if bool(bad.any()):
            in_empty = n == "dq" and bool(empty.any()) and bool((bad.any(dim=-1).any(dim=(0, 1)) <= empty).all())
            if in_empty and sinks is not None:
                return found("lse_without_sink", "empty_rows", rows=rows(empty))
            bad_rows = bad.any(dim=-1) if n == "dq" else bad.view(1, -1, 1).expand(B, Hq, Nq) if n == "dsinks" \
                else None
            if bad_rows is not None and sinks is not None and _sink_takes_all(q, k, scale, vis, sinks, bad_rows):
                return found("lse_without_sink", "sink_takes_all", gradient=n)
            if in_empty:
                return found("nan_empty_rows", "dq", rows=rows(empty))
            return found("nan", "gradient", gradient=n)
    base = dict(zip(("dq", "dk", "dv", "dsinks"), _grads(q, k, v, do, scale=scale, visible=vis, sinks=sinks)))
    tol = {n: max(float(allowed[n]), 1e-12) for n in names}

    def gap(a, b):
        return float((a.detach().double() - b).abs().max()) if a.numel() else 0.0

    wrong = [n for n in names if gap(got[n], base[n]) > FIT * tol[n]]
    if not wrong:
        return None
    variants = dict(GRADIENT_VARIANTS)
    if sinks is not None:
        variants["dsinks_left_out"] = None
    fitting = []
    for cause, switch in variants.items():
        if cause in ("lse_without_sink", "dsinks_sign_flipped") and sinks is None:
            continue
        if cause in ("gqa_first_head_only", "gqa_head_mapping") and q.shape[1] == k.shape[1]:
            continue
        if cause == "mask_ignored" and bool(vis.all()):
            continue
        if switch is None:
            var = dict(base, dsinks=torch.zeros_like(base["dsinks"]))
        else:
            var = dict(zip(("dq", "dk", "dv", "dsinks"),
                           _grads(q, k, v, do, scale=scale, visible=vis, sinks=sinks, **switch)))
        # Every wrong gradient must be the variant's (where the variant differs from the answer),
        # and every gradient the right answer or the variant's: a mistake may touch dk and not dv.
        if not all(gap(var[n], base[n]) > 2 * FIT * tol[n] and gap(got[n], var[n]) <= FIT * tol[n] for n in wrong):
            continue
        fit = max(min(gap(got[n], var[n]), gap(got[n], base[n])) / tol[n] for n in names)
        if fit <= FIT:
            fitting.append((fit, cause, say(cause, _FORM.get(cause, ""))))
    if not fitting:
        return None
    fit, cause, message = min(fitting)
    return Diagnosis(cause, f"{message} (wrong: {', '.join(wrong)})")


def explain_gradients(got, q, k, v, do, *, sinks=None, **opts) -> str:
    """For notebooks' check cells: "likely cause: ..." for wrong gradients, or "" when no known mistake fits.

    ``got`` is ``(dq, dk, dv, dsinks)`` (dsinks None without learned sinks); ``opts`` are the
    attention's options.  The tolerance is the grader's (PyTorch's own error in this dtype, the
    gradient floors); tensors may live on any device.
    """
    from kernels import reference, tolerance

    def cpu(t):
        return t.detach().cpu() if isinstance(t, torch.Tensor) else t

    q, k, v, do, sinks = map(cpu, (q, k, v, do, sinks))
    names = ("dq", "dk", "dv", "dsinks")
    got = {n: cpu(g) for n, g in zip(names, got) if g is not None}
    grads64 = reference.attention_grads(q, k, v, do, sinks=sinks, **opts)
    base = reference.attention_grads(q, k, v, do, sinks=sinks, compute_dtype=tolerance.baseline_dtype(q.dtype), **opts)
    floors = reference.gradient_floors(q, k, v, do, grads64, sinks=sinks, **opts)
    allowed = {n: tolerance.compare(got[n], r, b, name=n, factor=tolerance.GRADIENT_FACTOR, floor=floors[n]).allowed
               for n, r, b in zip(names, grads64[1:], base[1:]) if n in got and r is not None}
    diagnosis = safely(gradients, got, q, k, v, do, dict(opts, sinks=sinks), allowed=allowed)
    return headline(diagnosis) if diagnosis else ""
