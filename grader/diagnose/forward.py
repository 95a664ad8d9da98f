"""Which known mistake explains a wrong attention forward ``(o, lse)``: NaN first, by where it is;
else the float64 variant (grader/diagnose/variants.py) the output fits best."""

from __future__ import annotations

import math
import os
import sys

import torch

from grader.diagnose import dense, variants
from grader.diagnose.causes import Diagnosis, headline
from grader.diagnose.common import DENSE_LIMIT, FIT, fits, max_gap, safely, where, worst
from grader.diagnose.nan import nan as nan_cause


def attention(o, lse, q, k, v, opts: dict, *, allowed: tuple[float, float], block_m=None,
              block_n=None, exp2: bool = True) -> Diagnosis | None:
    """The most likely known mistake behind a wrong ``(o, lse)``, or None when none explains it.

    ``exp2``: the stage's code uses exp2 (stages 3 on); without it, no advice about log2(e) is given."""
    if not (isinstance(o, torch.Tensor) and isinstance(lse, torch.Tensor)):
        return None
    if o.shape != q.shape or lse.shape != q.shape[:3]:
        return None
    causal, window = bool(opts.get("causal")), opts.get("window")
    sink_tokens, sinks = opts.get("sink_tokens") or 0, opts.get("sinks")
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    given_scale = opts.get("sm_scale")
    scale = given_scale if given_scale is not None else 1.0 / math.sqrt(D)
    vis = dense.visible(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens)
    nan = nan_cause(o, lse, vis, block_m, block_n)
    Hkv = k.shape[1]
    edge_only = False                # NaN only where a load past the tensor's end would land: see variants.layout
    if nan and (1 << (D - 1).bit_length()) != D and B * Hq > 1:
        bad = torch.isnan(o.detach().double()).flatten(2).any(dim=2) | torch.isnan(lse.detach().double()).any(dim=2)
        edge_only = bool((bad <= variants.edge_heads(B, Hq, Hkv)).all())
    if nan and not edge_only:
        return nan
    if B * Hq * Nq * Nk > 4 * DENSE_LIMIT:
        return nan                   # real GPU sizes: some twenty float64 attentions would take minutes
    o_ref, lse_ref = dense.attend(q, k, v, scale=scale, visible=vis, sinks=sinks)
    allowed = (max(allowed[0], 1e-12), max(allowed[1], 1e-12))
    idx = worst(o, o_ref) if max_gap(o, o_ref) / allowed[0] >= max_gap(lse, lse_ref) / allowed[1] \
        else worst(lse, lse_ref)
    call = variants.Call(q, k, v, scale, given_scale, vis, causal, window, sink_tokens, sinks, block_m, block_n,
                         where(idx, block_m), o_ref, lse_ref, exp2)
    heavy = B * Hq * Nq * Nk > DENSE_LIMIT
    candidates = [*(x for family in variants.FAMILIES for x in family(call)), *variants.key_blocks(call, heavy)]
    if edge_only:                    # the other heads say whether the padding columns were read unmasked
        candidates = [x for x in variants.layout(call) if x[0] == "padding_columns_unmasked"]

    fitting = []
    for cause, message, (var_o, var_lse), *heads in candidates:
        fit = fits(o, lse, var_o, var_lse, o_ref, lse_ref, allowed, heads[0] if heads else None)
        if os.environ.get("WORKBOOK_DIAGNOSIS_DEBUG"):        # for whoever adds a variant: how each one fits
            print(f"diagnose: {cause:28} fit {fit}", file=sys.stderr)
        if fit is not None:
            fitting.append((fit, cause, message, var_o))
    if not fitting:
        return nan
    fit, cause, message, var_o = min(fitting, key=lambda f: f[0])
    twins = []                       # causes that fit as well: these inputs cannot tell them apart
    for other_fit, other, _, other_o in fitting:
        if other != cause and other not in twins and (other_fit[0] == fit[0] and
                                                      max_gap(var_o, other_o) <= FIT * allowed[0]):
            twins.append(other)
    if twins:
        message += f".  These inputs cannot tell it from: {', '.join(twins)}"
    return Diagnosis(cause, message, tuple(twins))


def explain_attention(o, lse, q, k, v, *, block_m=None, block_n=None, exp2=True, **opts) -> str:
    """For notebooks' check cells: "likely cause: ..." for a wrong (o, lse), or "" when no known mistake fits.

    The tolerance is the grader's (PyTorch's own error in this dtype, the attention floor); tensors may
    live on any device.  ``exp2=False`` for a stage whose code has no exp2 (stage 1): no advice about it.
    """
    from kernels import reference, tolerance

    def cpu(t):
        return t.detach().cpu() if isinstance(t, torch.Tensor) else t

    o, lse, q, k, v = map(cpu, (o, lse, q, k, v))
    opts = {key: cpu(val) for key, val in opts.items()}
    o_ref, lse_ref = reference.attention(q, k, v, **opts)
    o_pt, lse_pt = reference.attention(q, k, v, **opts, compute_dtype=tolerance.baseline_dtype(q.dtype))
    allowed = (tolerance.allowed(o_ref, o_pt, floor=tolerance.attention_floor(o_ref, lse_ref)),
               tolerance.allowed(lse_ref, lse_pt))
    found = safely(attention, o, lse, q, k, v, opts, allowed=allowed, block_m=block_m, block_n=block_n, exp2=exp2)
    return headline(found) if found else ""
