"""Helpers for the checks of the masked attention stages (5 causal, 6 GQA, 7 window, 8 sinks).

Every check compares the learner's ``flash_attention`` with the float64 reference under the
workbook's tolerance rule, and the block-skipping checks compare the number of key blocks the
learner's kernel says it loaded (``return_visits=True``) with the tiles that hold a visible key,
counted here from the mask itself.
"""

from __future__ import annotations

import torch

from grader.check import CheckFailed
from kernels import masks, reference, tolerance

MASK_OPTIONS = ("causal", "window", "sink_tokens")


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


def _span(rows: torch.Tensor) -> str:
    idx = rows.nonzero().flatten().tolist()
    if not idx:
        return "none"
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"rows {idx[0]}..{idx[-1]}" if len(idx) > 1 else f"row {idx[0]}"
    return f"{len(idx)} rows ({', '.join(map(str, idx[:6]))}{', ...' if len(idx) > 6 else ''})"


def attention(ctx, q, k, v, *, block_m=None, block_n=None, **opts):
    """Call the learner's flash_attention and judge (o, lse) against the float64 reference."""
    kwargs = dict(opts)
    if block_m is not None:
        kwargs["block_m"] = block_m
    if block_n is not None:
        kwargs["block_n"] = block_n
    what = label(q, k, **kwargs)
    out = ctx.learner.flash_attention(q, k, v, **kwargs)
    ctx.expect(isinstance(out, tuple) and len(out) == 2,
               f"flash_attention{what} must return the pair (o, lse); got {type(out).__name__}"
               + (f" of length {len(out)}" if isinstance(out, tuple) else ""))
    o, lse = out
    o_ref, lse_ref = reference.attention(q, k, v, **opts)
    o_pt, lse_pt = reference.attention(q, k, v, **opts, compute_dtype=tolerance.baseline_dtype(q.dtype))
    ctx.expect_dtype(o, q.dtype, name=f"o {what}")
    ctx.expect_dtype(lse, torch.float32, name=f"lse {what}")
    ctx.expect(tuple(o.shape) == tuple(q.shape), f"o {what}: expected shape {tuple(q.shape)}, got {tuple(o.shape)}")
    ctx.expect(tuple(lse.shape) == tuple(q.shape[:3]),
               f"lse {what}: expected shape {tuple(q.shape[:3])}, got {tuple(lse.shape)}")
    try:
        ctx.close_attention(o, lse, q, k, v, refs=(o_ref, lse_ref, o_pt, lse_pt), opts=opts, what=what,
                            block_m=block_m, block_n=block_n)
    except CheckFailed as exc:
        if exc.diagnosis:              # a known mistake explains it: that comes first
            raise
        _judge_empty_rows(ctx, o, lse, q, k, what, opts)   # else rows that see no key teach best, if wrong
        raise
    return o, lse


def _judge_empty_rows(ctx, o, lse, q, k, what, opts) -> None:
    """Rows that see no key: o = 0 and lse = -inf (or sinks[h]), never NaN.  Judged first, to teach."""
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
