"""Diagnoses: when an output is wrong, which known mistake explains it, and where it shows.

A fixed hint per check names the usual cause, which is often not this learner's.  Here the
learner's output is compared with the float64 reference *and* with the outputs of known wrong
variants, each computed in float64 from the same inputs: the lse in base 2, a missing rescale,
another softmax scale, a mask one key off, the wrong GQA head mapping, keys past N_K let in, ...
A variant explains the output when the output is as close to it as a right answer must be to
the reference (a few times the tolerance) and far from the reference.  The best-fitting
variant is the diagnosis; when none fits, there is none, and no cause is invented.  NaN is
diagnosed only where NaN occurred, and by which rows hold it.

    found = attention(o, lse, q, k, v, opts, allowed=(allowed_o, allowed_lse), block_m=..., block_n=...)
    if found: print(found.cause, found.message)
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from kernels import masks

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
_FIT = 4.0          # a variant fits when the output is within _FIT x the tolerance of it
_BLOCKS = (16, 32, 64, 128)
_DENSE_LIMIT = 1 << 22   # score-matrix elements above which the tiled variants (x4: all) are left out


@dataclass(frozen=True)
class Diagnosis:
    cause: str          # a stable name: "lse_log2", "acc_not_rescaled", ... (tests assert it)
    message: str        # what it is, why it gives these numbers, where it shows, what to change
    also: tuple[str, ...] = ()   # other causes these numbers cannot tell apart from it (same variant output)


# -- which TODO a cause belongs to ---------------------------------------------------------------------
#: Per stage, the hole each known mistake is made in: a label, or {learner function called: label} where
#: the same mistake can sit in two holes (stage 2's two kernels; stage 9's PyTorch and Triton backwards).
#: A cause missing from a stage's table belongs to its given code, and no hole is named.
_TODO_OF: dict[int, dict[str, str | dict[str, str]]] = {
    1: {"softmax_no_rescale": "TODO(1a)", "softmax_drops_last_block": "TODO(1a)", "softmax_pads_with_zero": "TODO(1a)",
        "nan_masked_tile": {"online_softmax": "TODO(1a)", "flash_attention": "TODO(1c)"},
        "overflow": "TODO(1a) or TODO(1b)",
        "nan_unwritten": {"online_softmax": "TODO(1b)", "flash_attention": "TODO(1d)"},
        "wrong_scale": "TODO(1c)", "acc_not_rescaled": "TODO(1c)", "l_not_rescaled": "TODO(1c)",
        "no_rescale": "TODO(1c)", "drops_last_key_block": "TODO(1c)", "keys_past_nk": "TODO(1c)",
        "lse_log2": "TODO(1d)", "o_not_normalised": "TODO(1d)"},
    2: {"wrong_strides": "TODO(2a)", "row_sum_drops_last_block": "TODO(2a)",
        "nan_unwritten": {"weighted_row_sum": "TODO(2c)", "softmax": "TODO(2f)"},
        "softmax_no_rescale": "TODO(2d)", "softmax_drops_last_block": "TODO(2d)", "softmax_pads_with_zero": "TODO(2d)",
        "nan_masked_tile": "TODO(2d)", "overflow": "TODO(2d)"},
    3: {"padding_columns_unmasked": "TODO(3a) and TODO(3b)", "wrong_strides": "TODO(3a) and TODO(3b)",
        "wrong_scale": "TODO(3b)", "acc_not_rescaled": "TODO(3b)", "l_not_rescaled": "TODO(3b)",
        "no_rescale": "TODO(3b)", "drops_last_key_block": "TODO(3b)", "keys_past_nk": "TODO(3b)",
        "nan_masked_tile": "TODO(3b)", "lse_log2": "TODO(3c)", "o_not_normalised": "TODO(3c)",
        "nan_unwritten": "TODO(3c)"},
    4: {cause: {"flash_attention": label} | ({"emulate_attention": "TODO(4e)"} if emulated else {})
        for cause, label, emulated in (("wrong_scale", "TODO(4a)", True), ("keys_past_nk", "TODO(4b)", False),
                                       ("causal_off_by_one", "TODO(4b)", False), ("causal_top_left", "TODO(4b)", False),
                                       ("mask_leak", "TODO(4b)", False), ("acc_not_rescaled", "TODO(4b)", True),
                                       ("l_not_rescaled", "TODO(4b)", True), ("no_rescale", "TODO(4b)", True),
                                       ("nan_masked_tile", "TODO(4b)", True), ("lse_log2", "TODO(4d)", False),
                                       ("o_not_normalised", "TODO(4d)", False), ("nan_empty_rows", "TODO(4d)", True))},
    5: {"causal_off_by_one": "TODO(5a)", "causal_top_left": "TODO(5a)", "mask_leak": "TODO(5a)",
        "keys_past_nk": "TODO(5a)", "nan_masked_tile": "TODO(5a)", "acc_not_rescaled": "TODO(5a)",
        "l_not_rescaled": "TODO(5a)", "no_rescale": "TODO(5a)", "masked_tiles_dropped": "TODO(5b)",
        "masked_tiles_unmasked": "TODO(5b)", "drops_last_key_block": "TODO(5b)",
        "nan_empty_rows": "TODO(5a) or TODO(5c)",
        "lse_log2": "TODO(5c)", "o_not_normalised": "TODO(5c)", "nan_unwritten": "TODO(5c)"},
    6: {"gqa_head_mapping": "TODO(6a)"},
    7: {"window_off_by_one": "TODO(7a)", "window_top_left": "TODO(7a)", "window_mask_missing": "TODO(7a)",
        "mask_leak": "TODO(7a)", "window_edge_unmasked": "TODO(7b)", "window_edge_tile_dropped": "TODO(7b)"},
    8: {"sink_tokens_hidden": "TODO(8a)", "sink_blocks_skipped": "TODO(8c)", "sinks_ignored": "TODO(8b)",
        "sinks_sign": "TODO(8b)", "sinks_base": "TODO(8b)"},
    9: {cause: {"tiled_attention_backward": "TODO(9a)", "tiled_attention": "TODO(9a)", "attention_op": label,
                "attention": label}
        for cause, label in (("backward_without_delta", "TODO(9c) and TODO(9d)"), ("dq_unscaled", "TODO(9d)"),
                             ("dk_unscaled", "TODO(9c)"), ("gqa_first_head_only", "TODO(9c)"),
                             ("gqa_head_mapping", "TODO(9d)"), ("lse_without_sink", "TODO(9c) and TODO(9d)"),
                             ("mask_ignored", "TODO(9c) and TODO(9d)"), ("nan_empty_rows", "TODO(9c) and TODO(9d)"),
                             ("dsinks_sign_flipped", "TODO(9b)"), ("dsinks_left_out", "TODO(9b)"))},
}


def todo_of(cause: str, stage: str, called=()) -> str:
    """The TODO label ("TODO(1c)") of the hole where ``cause`` is made in ``stage`` (its module name,
    "stage1_online_softmax", or "stage1"), given the learner functions the failing check ``called``;
    "" when the cause belongs to no hole of that stage (it would sit in given code)."""
    number = stage[5:].split("_")[0] if stage.startswith("stage") else ""
    entry = _TODO_OF.get(int(number), {}).get(cause, "") if number.isdigit() else ""
    if isinstance(entry, dict):
        return next((entry[fn] for fn in entry if fn in set(called)), "")
    return entry


def headline(found: "Diagnosis", stage: str = "", called=()) -> str:
    """"likely cause, TODO(1c): ..." (the hole's label when the cause has one in ``stage``)."""
    label = todo_of(found.cause, stage, called) if stage else ""
    return f"likely cause{', ' + label if label else ''}: {found.message}"


def uses_exp2(stage: str) -> bool:
    """Whether ``stage``'s code computes its exponentials in base 2 (the Triton and CUDA stages, 3 on)."""
    number = stage[5:].split("_")[0] if stage.startswith("stage") else ""
    return not number.isdigit() or int(number) >= 3


def safely(fn, *args, **kwargs) -> Diagnosis | None:
    """A diagnosis, or None if working it out failed: a verdict never waits on its explanation.

    ``WORKBOOK_STRICT_DIAGNOSIS=1`` (the tests) lets such a failure raise instead.
    """
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the FAIL stands with its numbers
        if os.environ.get("WORKBOOK_STRICT_DIAGNOSIS"):
            raise
        return None


# -- float64 attention with every knob a mistake can turn -------------------------------------------
def _attend(q, k, v, *, scale, visible, sinks=None, head_map=None, pad_keys=0, pad_visible=None):
    """Dense float64 attention: ``visible`` (Nq, Nk) bool; ``head_map`` maps query head -> kv head;
    ``pad_keys`` appends that many keys with k = v = 0 (an unmasked tail), visible to every row or
    where ``pad_visible`` (Nq, pad_keys) says."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    B, Hq, Nq, D = q.shape
    Hkv = k.shape[1]
    if head_map is None:
        head_map = torch.arange(Hq) // (Hq // Hkv)
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


def _tiled(q, k, v, *, scale, visible, sinks, block_n, rescale_acc=True, rescale_l=True):
    """The online softmax over key blocks of ``block_n``, in float64, with a rescale left out."""
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    B, Hq, Nq, D = q.shape
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
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


def _max_gap(a, b) -> float:
    """Max |a - b| where both are finite; inf where exactly one is infinite, or they are unequal infinities."""
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    both = torch.isfinite(a) & torch.isfinite(b)
    if bool(((~both) & ~((a == b) | (torch.isnan(a) & torch.isnan(b)))).any()):
        return float("inf")
    return float((a - b).abs()[both].max()) if bool(both.any()) else 0.0


def _row_gap(a, b) -> torch.Tensor:
    """Per row (every dim but the head dim, for o): max |a - b|, inf where one is NaN/inf and the other differs."""
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    gap = torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(nan=float("inf")))
    return gap.amax(dim=-1) if gap.dim() == 4 else gap


def _fits(o, lse, var_o, var_lse, o_ref, lse_ref, allowed, heads=None) -> tuple | None:
    """How well (o, lse) fit a variant, row by row; None when the variant does not explain them.

    A row fits when it is within a few tolerances of the variant.  The variant explains the
    output when every row that is wrong (does not fit the reference) fits the variant, and the
    variant differs from the reference somewhere (else it fits any right answer).  Mistakes that
    show in some rows only (at block edges, say) are explained so.  The result sorts best first:
    (rows where the variant expected a difference that did not come, worst gap in the wrong rows).
    A variant lse of None leaves the lse out (a mistake whose lse is off in a way of its own);
    ``heads``, a (B, Hq) bool, limits the comparison to those (batch, head) pairs.
    """
    a_o, a_l = allowed
    gap_var = _row_gap(o, var_o) / a_o
    gap_ref = _row_gap(o, o_ref) / a_o
    var_ref = _row_gap(var_o, o_ref) / a_o
    if var_lse is not None:
        gap_var = torch.maximum(gap_var, _row_gap(lse, var_lse) / a_l)
        var_ref = torch.maximum(var_ref, _row_gap(var_lse, lse_ref) / a_l)
    gap_ref = torch.maximum(gap_ref, _row_gap(lse, lse_ref) / a_l)
    if heads is not None:
        gap_var, gap_ref, var_ref = gap_var[heads], gap_ref[heads], var_ref[heads]
    wrong = gap_ref > _FIT
    if not bool(wrong.any()) or not bool((gap_var[wrong] <= _FIT).all()):
        return None
    if not bool((var_ref[wrong] > 2 * _FIT).any()):
        return None
    missed = int(((var_ref > 2 * _FIT) & ~wrong).sum())      # the variant differs there; the output does not
    return (missed, float(gap_var[wrong].max()))


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


# -- where an error shows ----------------------------------------------------------------------------
def _worst(got, ref):
    err = (got.detach().double() - ref.double()).abs()
    err = torch.where(torch.isfinite(ref) | torch.isfinite(got.double()), err, torch.zeros_like(err))
    err = err.nan_to_num(nan=float("inf"))
    return tuple(int(i) for i in torch.unravel_index(torch.argmax(err), err.shape))


def _where(idx, block_m=None) -> str:
    b, h, i = idx[:3]
    text = f"b={b}, head {h}, row {i}"
    if block_m:
        text += f" (query block {i // block_m})"
    return text


def _rows(rows: torch.Tensor) -> str:
    idx = rows.nonzero().flatten().tolist()
    if len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1)):
        return f"rows {idx[0]}..{idx[-1]}"
    return f"row{'s' if len(idx) > 1 else ''} " + ", ".join(map(str, idx[:6])) + (", ..." if len(idx) > 6 else "")


# -- NaN ---------------------------------------------------------------------------------------------
def _tile_state(visible, block_m, block_n):
    """Per (row, padded key): whether the key's tile, for the row's query block, is full (every pair
    visible), partial (some), or empty; as two bool (Nq, padded Nk) tensors (full, partial)."""
    nq, nk = visible.shape
    n_m, n_n = -(-nq // block_m), -(-nk // block_n)
    padded = torch.zeros(n_m * block_m, n_n * block_n, dtype=torch.bool)
    padded[:nq, :nk] = visible
    some = padded.view(n_m, block_m, n_n, block_n).any(dim=3).any(dim=1)          # (n_m, n_n)
    padded[nq:, :nk] = True              # rows past N_Q do not matter; keys past N_K always need the mask
    full = padded.view(n_m, block_m, n_n, block_n).all(dim=3).all(dim=1)
    expand = lambda t: t[:, None, :, None].expand(n_m, block_m, n_n, block_n).reshape(n_m * block_m, -1)[:nq]
    return expand(full), expand(some & ~full)


def _nan(o, lse, visible, block_m, block_n=None) -> Diagnosis | None:
    bad = torch.isnan(o.detach().double()).flatten(3).any(dim=3) | torch.isnan(lse.detach().double())
    if not bool(bad.any()):
        return None
    rows = bad.any(dim=1).any(dim=0)                    # (Nq,) rows with NaN in some batch and head
    b, h, i = (int(x) for x in bad.nonzero()[0])
    at = f"{int(bad.sum())} rows, first at {_where((b, h, i), block_m)}"
    empty = ~visible.any(dim=1)
    if bool(empty.any()) and bool((rows <= empty).all()):
        return Diagnosis("nan_empty_rows", f"NaN in the rows that see no key ({_rows(empty)}): {at}.  Such a row "
                         "ends with m = -inf and l = 0, and 0 / 0 (or exp(-inf - -inf)) is NaN; divide by 1 where "
                         "l is 0 and subtract 0 while m is -inf, so they come out o = 0, lse = -inf")
    first_key = torch.where(visible.any(dim=1), visible.float().argmax(dim=1), torch.zeros(visible.shape[0]).long())
    blind = first_key > 0                               # rows whose first key tile may hold nothing for them
    if block_m and block_n:                             # rows with a tile, visited for their block, blind to them
        full, partial = _tile_state(visible, block_m, block_n)
        nk = visible.shape[1]
        seen = (full | partial)[:, :nk]
        tile_of = torch.arange(nk) // block_n
        blind = torch.zeros(visible.shape[0], dtype=torch.bool)
        for t in range(-(-nk // block_n)):
            cols = tile_of == t
            blind |= seen[:, cols].any(dim=1) & ~visible[:, cols].any(dim=1)
    if bool((blind[rows & ~empty]).all()):
        return Diagnosis("nan_masked_tile", f"NaN in rows for which a key tile the kernel visits holds only "
                         f"masked keys: {at}.  While a tile holds only masked keys for a row, its max there is -inf, and exp(-inf - (-inf)) "
                         "is NaN; use 0 in place of a max that is -inf (m_safe) before subtracting it")
    if block_m and bool(rows.any()):
        blocks = sorted({i // block_m for i in rows.nonzero().flatten().tolist()})
        full = [blk for blk in blocks if bool(rows[blk * block_m:(blk + 1) * block_m].all())]
        if full and len(full) == len(blocks):
            return Diagnosis("nan_unwritten", f"whole query blocks {blocks[:6]} are NaN ({at}): the grader fills "
                             "outputs with NaN before the kernel runs, so these were never written: is the grid "
                             "cdiv(N_Q, BLOCK_M) programs per (batch, head), and does each store its rows?")
    return Diagnosis("nan", f"NaN in the output: {at}.  Look for 0 / 0, exp(-inf - -inf), inf - inf, or "
                     "elements of the output that are never stored (the grader fills outputs with NaN first)")


# -- attention ---------------------------------------------------------------------------------------
def _visible(nq, nk, *, causal=False, window=None, sink_tokens=0, shift=0, top_left=False):
    """The dense mask, optionally misplaced: ``shift`` moves the diagonal, ``top_left`` aligns it at key 0."""
    offset = (0 if top_left else nk - nq) + shift
    qi = torch.arange(nq)[:, None]
    kj = torch.arange(nk)[None, :]
    if not causal:
        return torch.ones(nq, nk, dtype=torch.bool)
    vis = kj <= qi + offset
    if window is not None:
        win = kj > qi + offset - window
        if sink_tokens:
            win = win | (kj < sink_tokens)
        vis = vis & win
    return vis


def _window_at_row(nq, nk, window, sink_tokens):
    """The window's own condition placed at the row index i, not at its diagonal: i - W < j (or a sink token)."""
    qi, kj = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    return (kj > qi - window) | (kj < sink_tokens)


@dataclass
class _Case:
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
        return _attend(args.pop("q"), args.pop("k"), args.pop("v"), **args)

    def tiles(self):
        return f"tiles {self.block_m}x{self.block_n}; at {self.at}"


def _base_and_scale(c: _Case):
    """lse in the wrong base, o not normalised, another softmax scale."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    m_row = _row_max(c.q, c.k, c.scale, c.vis, c.sinks)
    l_row = torch.exp(c.lse_ref - torch.where(torch.isinf(m_row), torch.zeros_like(m_row), m_row))
    natural = "m + log(l), or (m_i + log2(l_i)) * ln(2) where the scores are in base 2 (exp2)" if c.exp2 else \
        "m + log(l), with torch.log"
    yield ("lse_log2", f"lse is in base 2: it is the reference x log2(e) = 1.4427 x (at {c.at}).  lse must be the "
           f"natural log: {natural}", (c.o_ref, c.lse_ref * LOG2E))
    yield ("lse_log2", f"lse mixes bases: it is m + log2(l) with m natural (at {c.at}).  Use the natural log: "
           "lse = m + log(l)", (c.o_ref, m_row + torch.log2(l_row)))
    yield ("o_not_normalised", f"o is not divided by the softmax sum: it equals acc = o x l (at {c.at}).  Divide "
           "acc by l_i before storing o", (c.o_ref * l_row[..., None], c.lse_ref))
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
    fold = "; with exp2, fold log2(e) into that scale once" if c.exp2 else ""
    for name, other in scales.items():
        if abs(other - c.scale) > 1e-9 * c.scale:    # its lse is off in a way of its own: o alone is compared
            yield ("wrong_scale", f"the output is attention computed with {name}, where it should be "
                   f"sm_scale = {c.scale:.4g} (at {c.at}).  Scores are sm_scale * q.k (sm_scale = 1/sqrt(D) unless "
                   f"given){fold}", (c.attend(scale=other)[0], None))


def _edge_heads(B, Hq, Hkv):
    """(B, Hq) bool: the heads whose last row of q, or of their k, ends the tensor."""
    edge = torch.zeros(B, Hq, dtype=torch.bool)
    edge[-1, -1] = True
    edge[-1, Hq - Hq // Hkv:] = True
    return edge


def _layout(c: _Case):
    """Padding columns read without the head-dim mask; a tensor read with the wrong strides."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    pad = 1 << (D - 1).bit_length()
    if pad != D and c.q.is_contiguous() and c.k.is_contiguous() and B * Hq > 1:
        rest = ~_edge_heads(B, Hq, Hkv)    # the last heads read past the tensor: what is there is unknown
        yield ("padding_columns_unmasked", f"the padding columns {D}..{pad - 1} of q and k are loaded without the "
               f"head-dim mask, so they hold the next row's numbers and add to q.k (at {c.at}).  Load with "
               "mask=... & (offs_d < HEAD_DIM)[None, :], other=0.0",
               c.attend(q=_unmasked_columns(c.q, pad), k=_unmasked_columns(c.k, pad)), rest)
    named = {"q": c.q, "k": c.k, "v": c.v}
    for name, t in named.items():
        tries = [(f"{name} is read with {other}'s row stride (stride_{other}n)", _restrided(t, t2.stride(2)))
                 for other, t2 in named.items() if other != name]
        tries.append((f"{name} is read as if it were contiguous, not with its own strides",
                      _restrided(t, contiguous=True)))
        for how, wrong in tries:
            if wrong is not None:
                yield ("wrong_strides", f"{how} (at {c.at}).  Address every tensor with its own strides",
                       c.attend(**{name: wrong}))


def _masks(c: _Case):
    """The causal diagonal, the window, the sinks and the GQA head mapping, each misplaced."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    if c.causal:
        kw = dict(causal=True, window=c.window, sink_tokens=c.sink_tokens)
        if Nq != Nk:
            yield ("causal_top_left", f"the causal diagonal is aligned top-left (query i sees keys j <= i); the "
                   f"workbook aligns it bottom-right: j <= i + (N_K - N_Q) = i + {Nk - Nq} (at {c.at})",
                   c.attend(visible=_visible(Nq, Nk, top_left=True, **kw)))
        yield ("causal_off_by_one", f"the causal mask hides each row's own key (j < i + shift instead of "
               f"j <= i + shift) (at {c.at})", c.attend(visible=_visible(Nq, Nk, shift=-1, **kw)))
        yield ("causal_off_by_one", f"the causal mask lets each row see one key too many, the next one "
               f"(j <= i + shift + 1) (at {c.at})", c.attend(visible=_visible(Nq, Nk, shift=1, **kw)))
        yield ("mask_leak", f"the output is attention without the causal mask: rows see keys in their future "
               f"(at {c.at})", c.attend(visible=torch.ones(Nq, Nk, dtype=torch.bool)))
    if c.window is not None:
        yield ("mask_leak", f"the output ignores the window (keys that left it still count; at {c.at}).  Mask keys "
               "with j <= i' - W in the blocks at the window's far edge", c.attend(visible=_visible(Nq, Nk, causal=True)))
        for w, how in ((c.window + 1, "W + 1 keys (j >= i' - W instead of j > i' - W)"),
                       (c.window - 1, "W - 1 keys (the far edge is one key short)")):
            if w >= 1:
                yield ("window_off_by_one", f"the window keeps {how} (at {c.at})",
                       c.attend(visible=_visible(Nq, Nk, causal=True, window=w, sink_tokens=c.sink_tokens)))
        if Nq != Nk:
            yield ("window_top_left", f"the window is placed at the row index i instead of its diagonal "
                   f"i' = i + (N_K - N_Q) (at {c.at})",
                   c.attend(visible=_window_at_row(Nq, Nk, c.window, c.sink_tokens) & _visible(Nq, Nk, causal=True)))
        if c.sink_tokens:
            yield ("sink_tokens_hidden", f"the first {c.sink_tokens} keys (the sink tokens) are hidden from rows "
                   f"whose window has moved past them; they stay visible to every row (at {c.at})",
                   c.attend(visible=_visible(Nq, Nk, causal=True, window=c.window)))
    if c.sinks is not None:
        yield ("sinks_ignored", f"the learned sinks are left out: the output is attention without them (at {c.at}).  "
               "Each row's sum starts at exp(sinks[h]) (start m at sinks[h] in base 2 and l at 1)",
               c.attend(sinks=None))
        yield ("sinks_sign", f"the sink adds exp(-sinks[h]) to the sum instead of exp(sinks[h]) (at {c.at})",
               c.attend(sinks=-c.sinks))
        yield ("sinks_base", f"the sink logit is used in base 2 without converting it: the sum gets 2^sinks[h] "
               f"instead of e^sinks[h]; multiply it by log2(e) first (at {c.at})", c.attend(sinks=c.sinks * LN2))
    if Hkv not in (1, Hq):
        yield ("gqa_head_mapping", f"query heads use the wrong K/V head: h % Hkv instead of h // (Hq // Hkv) "
               f"(Hq={Hq}, Hkv={Hkv}; at {c.at}).  A group is {Hq // Hkv} consecutive query heads",
               c.attend(head_map=torch.arange(Hq) % Hkv))


def _tiles(c: _Case):
    """The tiles a diagonal or a window's edge cuts (the masked phase of the loop), mishandled."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    if not (c.causal and c.block_m and c.block_n):
        return
    full, partial = _tile_state(c.vis, c.block_m, c.block_n)
    if bool(partial.any()):
        yield ("masked_tiles_dropped", f"the keys of the tiles that need a mask (the diagonal band, a window's "
               f"edge) are left out: only whole visible tiles count ({c.tiles()}).  Run the masked phase over those "
               "tiles too", c.attend(visible=c.vis & full[:, :Nk]))
        yield ("masked_tiles_unmasked", f"the tiles that need a mask run without it: every key of the diagonal "
               f"band's tiles counts, the future ones and the padding past N_K too ({c.tiles()}).  Mask "
               "j <= i + (N_K - N_Q) in those tiles", c.attend(visible=c.vis | partial[:, :Nk],
                                                               pad_keys=partial.shape[1] - Nk,
                                                               pad_visible=partial[:, Nk:]))
    if c.window is None:
        return
    causal_full, _ = _tile_state(_visible(Nq, Nk, causal=True), c.block_m, c.block_n)
    far = (partial & causal_full)[:, :Nk]          # tiles cut by the window's far edge only
    visited = (full | partial)[:, :Nk]
    causal = _visible(Nq, Nk, causal=True)
    if Nq != Nk:
        yield ("window_top_left", f"the window's mask is placed at the row index i instead of its diagonal "
               f"i' = i + (N_K - N_Q), in the key blocks the loop loads ({c.tiles()})",
               c.attend(visible=_window_at_row(Nq, Nk, c.window, c.sink_tokens) & causal & visited))
    yield ("window_mask_missing", f"the window's mask is never applied: in the key blocks it loads, a row sees "
           f"every key up to its own, also those that left the window ({c.tiles()}).  Mask j > i' - W as well as "
           "j <= i'", c.attend(visible=causal & visited))
    if c.sink_tokens:
        w_vis = _visible(Nq, Nk, causal=True, window=c.window)
        first = torch.where(w_vis.any(dim=1), w_vis.float().argmax(dim=1), torch.full((Nq,), Nk))
        lo = torch.stack([first[i:i + c.block_m].min() for i in range(0, Nq, c.block_m)]) // c.block_n
        row_lo = lo.repeat_interleave(c.block_m)[:Nq, None]
        yield ("sink_blocks_skipped", f"the key blocks of the sink tokens are never visited: rows whose window has "
               f"moved past them lose the first {c.sink_tokens} keys ({c.tiles()}).  Loop over the sink tokens' "
               "blocks as well as the window's",
               c.attend(visible=c.vis & (torch.arange(Nk)[None, :] // c.block_n >= row_lo)))
    if bool(far.any()):
        yield ("window_edge_unmasked", f"the tiles at the window's far edge run without the window's mask: keys "
               f"that left the window still count there ({c.tiles()}).  Mask j > i' - W in the tiles the window's "
               "edge cuts", c.attend(visible=c.vis | far))
        yield ("window_edge_tile_dropped", f"the tile at the window's far edge is skipped: its keys that are still "
               f"inside the window are lost (the first key block is rounded up instead of down; {c.tiles()})",
               c.attend(visible=c.vis & ~far))


def _key_blocks(c: _Case, heavy: bool):
    """The last, partial key block mishandled; the online softmax's rescale left out."""
    B, Hq, Nq, D, Hkv, Nk = c.shape
    blocks = (c.block_n,) if c.block_n else tuple(b for b in _BLOCKS if b < 2 * max(Nk, 16))
    for bn in blocks:
        tail = Nk % bn
        if not tail:
            continue
        last = (f"key {Nk - 1}" if tail == 1 else f"keys {Nk - tail}..{Nk - 1}") + f", the partial last key block of {bn}"
        dropped = c.vis.clone()
        dropped[:, Nk - tail:] = False
        yield ("drops_last_key_block", f"the output leaves out {last}: the loop must run over every key block, "
               f"range(0, N_K, BLOCK_N) (at {c.at})", c.attend(visible=dropped))
        if not c.causal:
            yield ("keys_past_nk", f"keys past N_K={Nk} count: the {bn - tail} padding lanes of the last key block "
                   f"(keys {Nk}..{Nk - tail + bn - 1}) score 0 instead of -inf and join the softmax sum (at {c.at}).  "
                   "Set s to -inf where cols >= N_K before the row max", c.attend(pad_keys=bn - tail))
    if heavy:
        return
    for bn in blocks:
        if Nk <= bn:
            continue
        kw = dict(scale=c.scale, visible=c.vis, sinks=c.sinks, block_n=bn)
        yield ("acc_not_rescaled", f"acc is not rescaled when the running max grows: acc = acc * alpha + p @ v, "
               f"alpha = exp(m_old - m_new) (key blocks of {bn}; the error shows in rows whose max arrives after "
               f"key block 0, e.g. {c.at})", _tiled(c.q, c.k, c.v, rescale_acc=False, **kw))
        yield ("l_not_rescaled", f"l is not rescaled when the running max grows: l = l * alpha + rowsum(p) (key "
               f"blocks of {bn}; at {c.at})", _tiled(c.q, c.k, c.v, rescale_l=False, **kw))
        yield ("no_rescale", f"neither l nor acc is rescaled when the running max grows: multiply both by alpha = "
               f"exp(m_old - m_new) (key blocks of {bn}; at {c.at})",
               _tiled(c.q, c.k, c.v, rescale_acc=False, rescale_l=False, **kw))


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
    vis = masks.materialize(masks.attention_mask(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens),
                            Nq, Nk).clone()
    nan = _nan(o, lse, vis, block_m, block_n)
    Hkv = k.shape[1]
    edge_only = False                # NaN only where a load past the tensor's end would land: see _layout
    if nan and (1 << (D - 1).bit_length()) != D and B * Hq > 1:
        bad = torch.isnan(o.detach().double()).flatten(2).any(dim=2) | torch.isnan(lse.detach().double()).any(dim=2)
        edge_only = bool((bad <= _edge_heads(B, Hq, Hkv)).all())
    if nan and not edge_only:
        return nan
    if B * Hq * Nq * Nk > 4 * _DENSE_LIMIT:
        return nan                   # real GPU sizes: some twenty float64 attentions would take minutes
    o_ref, lse_ref = _attend(q, k, v, scale=scale, visible=vis, sinks=sinks)
    allowed = (max(allowed[0], 1e-12), max(allowed[1], 1e-12))
    idx = _worst(o, o_ref) if _max_gap(o, o_ref) / allowed[0] >= _max_gap(lse, lse_ref) / allowed[1] \
        else _worst(lse, lse_ref)
    case = _Case(q, k, v, scale, given_scale, vis, causal, window, sink_tokens, sinks, block_m, block_n,
                 _where(idx, block_m), o_ref, lse_ref, exp2)
    heavy = B * Hq * Nq * Nk > _DENSE_LIMIT
    variants = [*_base_and_scale(case), *_layout(case), *_masks(case), *_tiles(case), *_key_blocks(case, heavy)]
    if edge_only:                    # the other heads say whether the padding columns were read unmasked
        variants = [v for v in _layout(case) if v[0] == "padding_columns_unmasked"]

    fitting = []
    for cause, message, (var_o, var_lse), *heads in variants:
        fit = _fits(o, lse, var_o, var_lse, o_ref, lse_ref, allowed, heads[0] if heads else None)
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
                                                      _max_gap(var_o, other_o) <= _FIT * allowed[0]):
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
    cpu = lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t
    o, lse, q, k, v = map(cpu, (o, lse, q, k, v))
    opts = {key: cpu(val) for key, val in opts.items()}
    o_ref, lse_ref = reference.attention(q, k, v, **opts)
    o_pt, lse_pt = reference.attention(q, k, v, **opts, compute_dtype=tolerance.baseline_dtype(q.dtype))
    allowed = (tolerance.allowed(o_ref, o_pt, floor=tolerance.attention_floor(o_ref, lse_ref)),
               tolerance.allowed(lse_ref, lse_pt))
    found = safely(attention, o, lse, q, k, v, opts, allowed=allowed, block_m=block_m, block_n=block_n, exp2=exp2)
    return f"likely cause: {found.message}" if found else ""


def _row_max(q, k, scale, vis, sinks):
    """Each row's max scaled score over its visible keys (and the sink): the m of the online softmax."""
    qd, kd = q.detach().double(), k.detach().double()
    group = q.shape[1] // k.shape[1]
    s = (qd @ kd.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    m = s.masked_fill(~vis, float("-inf")).amax(dim=-1)
    if sinks is not None:
        m = torch.maximum(m, sinks.double().view(1, -1, 1))
    return m


# -- softmax (stages 1 and 2) --------------------------------------------------------------------
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
        return Diagnosis("nan_unwritten", "every element of the output is NaN, which is how the grader hands out "
                         "a new tensor (torch.empty) before anything is stored in it: the result was never "
                         "written.  Does every block of every row reach its store (tl.store in a kernel, an "
                         "assignment in PyTorch), to the output's own pointer?")
    if bool(flat_bad.any()):
        rows = flat_bad.nonzero().flatten().tolist()
        masked_rows = [r for r in rows if bool(torch.isneginf(xrows[r]).any())]
        finite = torch.where(torch.isfinite(xrows), xrows.abs(), torch.zeros_like(xrows))
        big = [r for r in rows if float(finite[r].max()) > 80]
        where = f"rows {rows[:6]}{' ...' if len(rows) > 6 else ''}"
        if len(masked_rows) == len(rows):
            return Diagnosis("nan_masked_tile", f"NaN or inf in {where}, rows with -inf entries.  While a row (or "
                             "a block of it) has shown only -inf, its max is -inf and exp(-inf - (-inf)) is NaN: "
                             "subtract 0 instead of a max that is -inf, and divide by 1 where the sum is 0")
        if len(big) == len(rows):
            return Diagnosis("overflow", f"inf or NaN in {where}, rows with values up to "
                             f"{float(finite[big[0]].max()):.3g}: exp overflows past ~88 in float32.  Take exp "
                             "of x - max, never of x itself")
        return Diagnosis("nan", f"NaN or inf in {where}")
    allowed = max(allowed, 1e-12)
    blocks = (block,) if block else tuple(b for b in (16, 32, 64, 128, 256, 1024) if b < x.shape[-1])
    candidates = []
    for bn in blocks:
        candidates.append(("softmax_no_rescale", f"the running sum is not rescaled when the max grows (blocks of "
                           f"{bn}): l = l * exp(m - m_new) + sum(exp(x_block - m_new))",
                           _softmax_tiled(xd, bn, rescale=False)))
        if x.shape[-1] % bn:
            candidates.append(("softmax_pads_with_zero", f"the lanes past the end of the row (blocks of {bn}) load "
                               "as 0 instead of -inf, so exp(0 - m) joins the sum: load with other=-inf",
                               _softmax_tiled(xd, bn, pad_zero=True)))
        candidates.append(("softmax_drops_last_block", f"the statistics leave out the last block of the row (blocks "
                           f"of {bn}): loop over range(0, N, BLOCK_N)", _softmax_tiled(xd, bn, drop_last=True)))
    best = None
    for cause, message, var in candidates:
        scaled = allowed * max(1.0, float(var.abs().max()))     # a variant may reach far past 1 (no max taken)
        fit = _fits(got, got, var, None, ref, ref, (scaled, scaled))
        if fit is not None and (best is None or fit < best[0]):
            best = (fit, cause, message)
    return Diagnosis(best[1], best[2]) if best else None


# -- a weighted row sum (stage 2) ------------------------------------------------------------------
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
        for kept, how in (((blocks - 1) * bn, "leaves out the last column block"),
                          (n // bn * bn, "runs over whole column blocks only, leaving out a partial last one")):
            if 0 <= kept < n:
                lost = f"column {kept} is" if kept == n - 1 else f"columns {kept}..{n - 1} are"
                candidates.append(("row_sum_drops_last_block", f"the loop {how} (blocks of {bn}: {lost} never "
                                   "added).  Loop over range(0, N, BLOCK_N) and mask the last block",
                                   (xd[:, :kept] * wd[:kept]).sum(-1), None))
    for strides, how in (((x.stride(0), 1), "steps along a row with stride 1 instead of stride_xn"),
                         ((n, x.stride(1)), "starts row r at r * N instead of r * stride_xm")):
        if strides != tuple(x.stride()):
            values, rows = _read_as(x, strides)
            candidates.append(("wrong_strides", f"x is read with the wrong strides: the kernel {how}, true only "
                               f"for a contiguous x (x here has strides {tuple(x.stride())})",
                               (values * wd).sum(-1), rows))
    best = None
    for cause, message, var, rows in candidates:
        fit = _fits(got, got, var, None, ref, ref, (allowed, allowed), rows)
        if fit is not None and (best is None or fit < best[0]):
            best = (fit, cause, message)
    return Diagnosis(best[1], best[2]) if best else None


# -- gradients (stage 9) ---------------------------------------------------------------------------
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
    kr, vr = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    raw = (q @ kr.transpose(-1, -2)) * scale
    s = raw.masked_fill(~visible, float("-inf"))
    keys_lse = torch.logsumexp(s, dim=-1)
    sink = sinks.detach().to(torch.float64).view(1, Hq, 1) if sinks is not None else None
    lse = torch.logaddexp(keys_lse, sink.expand_as(keys_lse)) if sink is not None else keys_lse
    safe = lambda x: torch.where(torch.isinf(x), torch.zeros_like(x), x)      # rows that see nothing
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
    fold = lambda t: t.view(B, Hkv, group, Nk, D).sum(dim=2) if group_sum else t.view(B, Hkv, group, Nk, D)[:, :, 0]
    dsinks = None
    if sink is not None:
        dsinks = -dsinks_sign * (torch.exp(sink - safe(used)) * delta).sum(dim=(0, 2))
    return dq, fold(dk_h), fold(dv_h), dsinks


def _sink_takes_all(q, k, scale, vis, sinks, rows) -> bool:
    """Whether every (b, h, i) in ``rows`` gives its sink at least 99 % of its weight."""
    qd, kd = q.detach().double(), k.detach().double()
    s = (qd @ kd.repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2)) * scale
    keys = torch.logsumexp(s.masked_fill(~vis, float("-inf")), dim=-1)
    sink = sinks.detach().double().view(1, -1, 1).expand_as(keys)
    share = torch.exp(sink - torch.logaddexp(keys, sink))
    return bool(rows.any()) and bool((share[rows] > 0.99).all())


GRADIENT_VARIANTS = {
    "backward_without_delta": (dict(minus_delta=False), "dS is P * dP without the softmax's '- delta': dq and dk "
                               "are off while dv is right.  dS = P * (dP - delta), with delta = rowsum(dO * O)"),
    "dq_unscaled": (dict(dq_scale=False), "dq is missing the softmax scale: it is dS @ K where it should be "
                    "sm_scale * dS @ K (the scores were scaled by sm_scale in the forward)"),
    "dk_unscaled": (dict(dk_scale=False), "dk is missing the softmax scale: it is dS^T @ Q where it should be "
                    "sm_scale * dS^T @ Q"),
    "gqa_first_head_only": (dict(group_sum=False), "dk and dv hold only the first query head of each GQA group: "
                            "every query head of a group reads the same K and V, so their gradients add up over "
                            "the group"),
    "lse_without_sink": (dict(sink_in_lse=False), "P is rebuilt from an lse that leaves out the sink, as if each "
                         "row's probabilities summed to 1: use the lse the forward saved, sink included"),
    "mask_ignored": (dict(mask_p=False), "the backward rebuilds P over every key, masked ones included: apply the same "
                     "mask as the forward (causal, window, sink tokens) before the exp"),
    "dsinks_sign_flipped": (dict(dsinks_sign=-1.0), "d(sinks) has the wrong sign: the sink only adds to each "
                            "row's normalisation, so dsinks = -sum over rows of exp(sink - lse) * delta"),
    "gqa_head_mapping": (dict(dq_kv_head_modulo=True), "dq is computed from the wrong K/V head: query head h reads "
                         "K/V head h // (Hq // Hkv) (the first Hq // Hkv query heads share K/V head 0), not "
                         "h % Hkv"),
}


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
    if B * Hq * Nq * Nk > 4 * _DENSE_LIMIT:
        return None
    scale = opts.get("sm_scale") or 1.0 / math.sqrt(D)
    vis = masks.materialize(masks.attention_mask(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens),
                            Nq, Nk).clone()
    empty = ~vis.any(dim=1)
    for n in names:
        bad = ~torch.isfinite(got[n].detach().double())
        if bool(bad.any()):
            in_empty = n == "dq" and bool(empty.any()) and bool((bad.any(dim=-1).any(dim=(0, 1)) <= empty).all())
            if in_empty and sinks is not None:
                return Diagnosis("lse_without_sink", f"NaN in dq for the query rows that see no key "
                                 f"({_rows(empty)}), whose lse is the sink alone: P is rebuilt from an lse "
                                 "without the sink, -inf there.  Use the lse the forward saved, sink included")
            rows = bad.any(dim=-1) if n == "dq" else bad.view(1, -1, 1).expand(B, Hq, Nq) if n == "dsinks" else None
            if rows is not None and sinks is not None and _sink_takes_all(q, k, scale, vis, sinks, rows):
                return Diagnosis("lse_without_sink", f"NaN in {n} only where the sink takes nearly all "
                                 "the weight: an lse without the sink, worked back from the saved one as "
                                 "lse + log(1 - exp(sink - lse)), is log(0) = -inf there.  Use the lse the "
                                 "forward saved, sink included: P = exp(s - lse)")
            if in_empty:
                return Diagnosis("nan_empty_rows", f"NaN in dq for the query rows that see no key ({_rows(empty)}): "
                                 "their lse is -inf, so exp(s - lse) is exp(-inf + inf) = NaN, or inf where s was "
                                 "not masked.  Those rows must get P = 0: mask s with -inf before the exp "
                                 "(torch.where, never a product with the mask) and use 0 in place of an lse "
                                 "that is -inf")
            return Diagnosis("nan", f"NaN or inf in {n}: look for exp(-inf - -inf), 0 / 0, or gradient elements "
                             "that are never stored")
    base = dict(zip(("dq", "dk", "dv", "dsinks"), _grads(q, k, v, do, scale=scale, visible=vis, sinks=sinks)))
    tol = {n: max(float(allowed[n]), 1e-12) for n in names}

    def gap(a, b):
        return float((a.detach().double() - b).abs().max()) if a.numel() else 0.0

    wrong = [n for n in names if gap(got[n], base[n]) > _FIT * tol[n]]
    if not wrong:
        return None
    variants = dict(GRADIENT_VARIANTS)
    if sinks is not None:
        variants["dsinks_left_out"] = (None, "d(sinks) is zero: the sink's share of the gradient, "
                                       "-sum over rows of exp(sink - lse) * delta, is never added")
    fitting = []
    for cause, (switch, message) in variants.items():
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
        if not all(gap(var[n], base[n]) > 2 * _FIT * tol[n] and gap(got[n], var[n]) <= _FIT * tol[n] for n in wrong):
            continue
        fit = max(min(gap(got[n], var[n]), gap(got[n], base[n])) / tol[n] for n in names)
        if fit <= _FIT:
            fitting.append((fit, cause, message))
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
    cpu = lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t
    q, k, v, do, sinks = map(cpu, (q, k, v, do, sinks))
    names = ("dq", "dk", "dv", "dsinks")
    got = {n: cpu(g) for n, g in zip(names, got) if g is not None}
    grads64 = reference.attention_grads(q, k, v, do, sinks=sinks, **opts)
    base = reference.attention_grads(q, k, v, do, sinks=sinks, compute_dtype=tolerance.baseline_dtype(q.dtype), **opts)
    floors = reference.gradient_floors(q, k, v, do, grads64, sinks=sinks, **opts)
    allowed = {n: tolerance.compare(got[n], r, b, name=n, factor=tolerance.GRADIENT_FACTOR, floor=floors[n]).allowed
               for n, r, b in zip(names, grads64[1:], base[1:]) if n in got and r is not None}
    found = safely(gradients, got, q, k, v, do, dict(opts, sinks=sinks), allowed=allowed)
    return f"likely cause: {found.message}" if found else ""
