"""The one attention judge: a learner's ``(o, lse)`` against the float64 reference.

Every attention stage (1, 3, 4 and the masked stages 5-8) calls its ``flash_attention`` through
``attend`` (or judges what came back with ``judge``), so every stage holds the same contract to
the same tolerance and teaches with the same words:

1. the answer is the pair ``(o, lse)``, ``o`` in q's dtype and shape, ``lse`` float32 ``(B, H, Nq)``;
2. ``o`` and ``lse`` are within the tolerance rule of ``kernels.reference.attention`` in float64
   (``kernels.tolerance``: twice plain PyTorch's own error in the inputs' dtype, and the
   attention floor for ``o``);
3. when they are not, the likely mistake comes first (``grader.diagnose.attention``), or, when no
   known mistake fits, what went wrong in the rows that see no key, which teaches best.
"""

from __future__ import annotations

from kernels import masks, reference, tolerance

import torch

from grader.check import CheckFailed
from grader.isolation.outcomes import describe_value

MASK_OPTIONS = ("causal", "window", "sink_tokens")
Q_DIMS = ("b", "h", "i", "d")


def label(q, k, **opts) -> str:
    """A short description of a call, for messages: '(Nq=129, Nk=17, causal, 16x64 tiles, float16)'."""
    parts = [f"Nq={q.shape[2]}, Nk={k.shape[2]}"]
    if q.shape[1] != k.shape[1]:
        parts.append(f"Hq={q.shape[1]}, Hkv={k.shape[1]}")
    if opts.get("causal"):
        parts.append("causal")
    if opts.get("window") is not None:
        parts.append(f"window={opts['window']}")
    if opts.get("sink_tokens"):
        parts.append(f"sink_tokens={opts['sink_tokens']}")
    if opts.get("sinks") is not None:
        s = opts["sinks"]
        parts.append(f"sinks in [{float(s.min()):.3g}, {float(s.max()):.3g}]")
    if opts.get("block_m") or opts.get("block_n"):
        parts.append(f"{opts.get('block_m', 'default')}x{opts.get('block_n', 'default')} tiles")
    parts.append(str(q.dtype).replace("torch.", ""))
    return "(" + ", ".join(parts) + ")"


def visible(nq: int, nk: int, **opts) -> torch.Tensor:
    """The dense (nq, nk) mask of these options, from kernels.masks (the reference's own)."""
    mask_opts = {key: opts[key] for key in MASK_OPTIONS if opts.get(key) is not None}
    return masks.materialize(masks.attention_mask(nq, nk, **mask_opts), nq, nk)


def empty_rows(nq: int, nk: int, **opts) -> torch.Tensor:
    """Boolean (nq,): the query rows that see no key at all."""
    return ~visible(nq, nk, **opts).any(dim=1)


def references(q, k, v, *, device=None, baseline=None, **opts):
    """``(o_ref, lse_ref, o_pt, lse_pt)``: the float64 reference, and plain PyTorch in ``baseline``.

    ``baseline`` is the dtype the tolerance measures PyTorch's own error in: by default
    ``tolerance.baseline_dtype(q.dtype)`` (TF32 matmuls for float32 on a GPU).  ``device`` is where
    both are computed: the GPU for real sizes, else the inputs' own.
    """
    if device is not None:
        q, k, v = (t.to(device) for t in (q, k, v))
        opts = {key: val.to(device) if isinstance(val, torch.Tensor) else val for key, val in opts.items()}  # sinks
    baseline = tolerance.baseline_dtype(q.dtype) if baseline is None else baseline
    o_ref, lse_ref = reference.attention(q, k, v, **opts)
    o_pt, lse_pt = reference.attention(q, k, v, **opts, compute_dtype=baseline)
    return o_ref, lse_ref, o_pt, lse_pt


def reports(o, lse, refs, *, what: str, block_m=None) -> tuple[tolerance.Report, tolerance.Report]:
    """The tolerance's reports on ``o`` (with the attention floor) and ``lse``; messages name the query block."""
    o_ref, lse_ref, o_pt, lse_pt = refs
    rep_o = tolerance.compare(o, o_ref, o_pt, name=f"o {what}".rstrip(), dims=Q_DIMS, row_dim=2, block_m=block_m,
                              floor=tolerance.attention_floor(o_ref, lse_ref))
    rep_l = tolerance.compare(lse, lse_ref, lse_pt, name=f"lse {what}".rstrip(), dims=Q_DIMS[:3], row_dim=2,
                              block_m=block_m)
    return rep_o, rep_l


def judge(ctx, out, q, k, v, *, what: str, opts=None, fn: str = "flash_attention", block_m=None, block_n=None,
          device=None, baseline=None):
    """Fail the check unless ``out``, what the learner's ``fn(q, k, v, **opts)`` returned, is right.

    ``what`` describes the call in messages; ``opts`` are the reference's options (causal, window,
    sink_tokens, sinks, sm_scale); ``block_m`` and ``block_n`` the tiles the call asked for, which
    messages and the diagnosis name; ``device`` and ``baseline`` go to ``references``.  Returns
    ``(o, lse)``.
    """
    opts = dict(opts or {})
    call = f"{fn}{'' if what.startswith('(') else ' '}{what}"
    ctx.expect(isinstance(out, tuple) and len(out) == 2,
               f"{fn} returned {describe_value(out)}: {call} must return the pair (o, lse)")
    o, lse = out
    ctx.expect_dtype(o, q.dtype, name=f"o {what} (o comes back in q's dtype)")
    ctx.expect_dtype(lse, torch.float32, name=f"lse {what} (lse is always float32)")
    ctx.expect(tuple(o.shape) == tuple(q.shape), f"o {what}: expected shape {tuple(q.shape)}, got {tuple(o.shape)}")
    ctx.expect(tuple(lse.shape) == tuple(q.shape[:3]),
               f"lse {what}: expected shape {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    rep_o, rep_l = reports(o, lse, references(q, k, v, device=device, baseline=baseline, **opts), what=what,
                           block_m=block_m)
    ctx.record(rep_o, f"o {what}")
    ctx.record(rep_l, f"lse {what}")
    if rep_o.ok and rep_l.ok:
        return o, lse
    from grader import diagnose
    found = diagnose.safely(diagnose.attention, o, lse, q, k, v, opts, allowed=(rep_o.allowed, rep_l.allowed),
                            block_m=block_m, block_n=block_n, exp2=diagnose.uses_exp2(ctx.stage))
    numbers = "; ".join(r.message for r in (rep_o, rep_l) if not r.ok)
    if found:                      # a known mistake explains it: that comes first
        raise CheckFailed(f"{ctx.headline(found)}\n{numbers}", found.cause, found.also)
    _judge_empty_rows(ctx, o, lse, q, k, what, opts)   # else rows that see no key teach best, if wrong
    raise CheckFailed(numbers)


def attend(ctx, q, k, v, *, fn: str = "flash_attention", what: str | None = None, block_m=None, block_n=None,
           num_warps=None, device=None, baseline=None, **opts):
    """Call the learner's ``fn(q, k, v, **opts)``, with the tiles and warps asked for, and ``judge`` it.

    ``opts`` go to the learner as given and to the reference; ``block_m``, ``block_n`` and
    ``num_warps`` go to the learner only when given.  ``what`` describes the call in messages
    (by default ``label`` of it).  Returns ``(o, lse)``.
    """
    tiles = {"block_m": block_m, "block_n": block_n, "num_warps": num_warps}
    call = dict(opts, **{key: val for key, val in tiles.items() if val is not None})
    out = getattr(ctx.learner, fn)(q, k, v, **call)
    return judge(ctx, out, q, k, v, what=label(q, k, **call) if what is None else what, opts=opts, fn=fn,
                 block_m=block_m, block_n=block_n, device=device, baseline=baseline)


def _span(rows: torch.Tensor) -> str:
    idx = rows.nonzero().flatten().tolist()
    if not idx:
        return "none"
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"rows {idx[0]}..{idx[-1]}" if len(idx) > 1 else f"row {idx[0]}"
    return f"{len(idx)} rows ({', '.join(map(str, idx[:6]))}{', ...' if len(idx) > 6 else ''})"


def _judge_empty_rows(ctx, o, lse, q, k, what, opts) -> None:
    """Rows that see no key: o = 0 and lse = -inf (or sinks[h]), never NaN."""
    nq, nk = q.shape[2], k.shape[2]
    rows = empty_rows(nq, nk, **opts)
    if not bool(rows.any()):
        return
    o_rows, lse_rows = o[:, :, rows].double(), lse[:, :, rows].double()
    sinks = opts.get("sinks")
    where = f"{_span(rows)} of {nq} see no key"
    if opts.get("causal") and nq > nk:
        where += f" (causal, bottom-right: row i sees keys j <= i - {nq - nk})"
    n_nan = int(torch.isnan(o_rows).sum())
    if n_nan or not bool(torch.isfinite(o_rows).all()):
        ctx.fail(f"o {what}: {where}, and their o has {n_nan} NaN / "
                 f"{int(torch.isinf(o_rows).sum())} inf of {o_rows.numel()}; expected o = 0.  Such a row keeps "
                 "m = -inf and l = 0: exp2(-inf - (-inf)) is NaN and 0 / 0 is NaN.  Subtract 0 while m is "
                 "-inf, and divide by 1 where l is 0", diagnosis="nan_empty_rows")
    ctx.expect(float(o_rows.abs().max()) == 0.0,
               f"o {what}: {where}; expected o = 0 there (they attend to nothing), got values up to "
               f"{float(o_rows.abs().max()):.3g}")
    if sinks is None:
        expected = torch.full_like(lse_rows, float("-inf"))
        rule = "lse = -inf (the log of an empty sum)"
    else:
        expected = sinks.double().view(1, -1, 1).expand_as(lse_rows)
        rule = "lse = sinks[h] (the sink is the only term of the sum)"
    bad = ~((lse_rows == expected) | ((lse_rows - expected).abs() <= 1e-5 * (1 + expected.abs())))
    if bool(bad.any()):
        b, h, r = (int(x) for x in bad.nonzero()[0])
        row = int(rows.nonzero().flatten()[r])
        ctx.fail(f"lse {what}: {where}; expected {rule}, got {float(lse_rows[b, h, r]):.6g} at "
                 f"(b={b}, h={h}, i={row}) where {float(expected[b, h, r]):.6g} was expected")
