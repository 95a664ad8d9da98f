"""What every diagnosis uses: how well an output fits a variant, where an error shows, the stage's
base of exponentials, and a diagnosis that may fail without taking the verdict with it."""

from __future__ import annotations

import math
import os

import torch

from grader.diagnose.causes import Diagnosis, stage_number

LN2 = math.log(2.0)
LOG2E = 1.0 / LN2
FIT = 4.0           # a variant fits when the output is within FIT x the tolerance of it
DENSE_LIMIT = 1 << 22    # score-matrix elements above which the tiled variants (x4: all) are left out


def uses_exp2(stage: str) -> bool:
    """Whether ``stage``'s code computes its exponentials in base 2 (the Triton and CUDA stages, 3 on)."""
    number = stage_number(stage)
    return number is None or number >= 3


def safely(fn, *args, **kwargs) -> Diagnosis | None:
    """A diagnosis, or None if working it out failed: a verdict never waits on its explanation.

    ``WORKBOOK_STRICT_DIAGNOSIS=1`` (the tests) lets such a failure raise instead.
    """
    try:
        return fn(*args, **kwargs)
    except Exception:  # the FAIL stands with its numbers
        if os.environ.get("WORKBOOK_STRICT_DIAGNOSIS"):
            raise
        return None


# -- how close ---------------------------------------------------------------------------------------
def max_gap(a, b) -> float:
    """Max |a - b| where both are finite; inf where exactly one is infinite, or they are unequal infinities."""
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    both = torch.isfinite(a) & torch.isfinite(b)
    if bool(((~both) & ~((a == b) | (torch.isnan(a) & torch.isnan(b)))).any()):
        return float("inf")
    return float((a - b).abs()[both].max()) if bool(both.any()) else 0.0


def row_gap(a, b) -> torch.Tensor:
    """Per row (every dim but the head dim, for o): max |a - b|, inf where one is NaN/inf and the other differs."""
    a, b = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    gap = torch.where(same, torch.zeros_like(a), (a - b).abs().nan_to_num(nan=float("inf")))
    return gap.amax(dim=-1) if gap.dim() == 4 else gap


def fits(o, lse, var_o, var_lse, o_ref, lse_ref, allowed, heads=None) -> tuple | None:
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
    gap_var = row_gap(o, var_o) / a_o
    gap_ref = row_gap(o, o_ref) / a_o
    var_ref = row_gap(var_o, o_ref) / a_o
    if var_lse is not None:
        gap_var = torch.maximum(gap_var, row_gap(lse, var_lse) / a_l)
        var_ref = torch.maximum(var_ref, row_gap(var_lse, lse_ref) / a_l)
    gap_ref = torch.maximum(gap_ref, row_gap(lse, lse_ref) / a_l)
    if heads is not None:
        gap_var, gap_ref, var_ref = gap_var[heads], gap_ref[heads], var_ref[heads]
    wrong = gap_ref > FIT
    if not bool(wrong.any()) or not bool((gap_var[wrong] <= FIT).all()):
        return None
    if not bool((var_ref[wrong] > 2 * FIT).any()):
        return None
    missed = int(((var_ref > 2 * FIT) & ~wrong).sum())      # the variant differs there; the output does not
    return (missed, float(gap_var[wrong].max()))


def best_fit(got, ref, candidates, allowed) -> Diagnosis | None:
    """The candidate ``(cause, message, variant[, rows])`` that ``got`` fits best (ties: the first), or None.

    For outputs with no lse: ``allowed`` is the tolerance, or a function of the variant giving it;
    ``rows``, when given, limits the comparison to those rows."""
    best = None
    for cause, message, var, *rows in candidates:
        tol = allowed(var) if callable(allowed) else allowed
        fit = fits(got, got, var, None, ref, ref, (tol, tol), rows[0] if rows else None)
        if fit is not None and (best is None or fit < best[0]):
            best = (fit, cause, message)
    return Diagnosis(best[1], best[2]) if best else None


# -- where an error shows ----------------------------------------------------------------------------
def worst(got, ref):
    err = (got.detach().double() - ref.double()).abs()
    err = torch.where(torch.isfinite(ref) | torch.isfinite(got.double()), err, torch.zeros_like(err))
    err = err.nan_to_num(nan=float("inf"))
    return tuple(int(i) for i in torch.unravel_index(torch.argmax(err), err.shape))


def where(idx, block_m=None) -> str:
    b, h, i = idx[:3]
    text = f"b={b}, head {h}, row {i}"
    if block_m:
        text += f" (query block {i // block_m})"
    return text


def rows(found: torch.Tensor) -> str:
    """"rows 3..9", "row 4", "rows 1, 5, 8, ...": the indices where ``found`` (1-D bool) is set."""
    idx = found.nonzero().flatten().tolist()
    if len(idx) > 1 and idx == list(range(idx[0], idx[-1] + 1)):
        return f"rows {idx[0]}..{idx[-1]}"
    return f"row{'s' if len(idx) > 1 else ''} " + ", ".join(map(str, idx[:6])) + (", ..." if len(idx) > 6 else "")


def tile_state(visible, block_m, block_n):
    """Per (row, padded key): whether the key's tile, for the row's query block, is full (every pair
    visible), partial (some), or empty; as two bool (Nq, padded Nk) tensors (full, partial)."""
    nq, nk = visible.shape
    n_m, n_n = -(-nq // block_m), -(-nk // block_n)
    padded = torch.zeros(n_m * block_m, n_n * block_n, dtype=torch.bool)
    padded[:nq, :nk] = visible
    some = padded.view(n_m, block_m, n_n, block_n).any(dim=3).any(dim=1)          # (n_m, n_n)
    padded[nq:, :nk] = True              # rows past N_Q do not matter; keys past N_K always need the mask
    full = padded.view(n_m, block_m, n_n, block_n).all(dim=3).all(dim=1)

    def expand(t):
        return t[:, None, :, None].expand(n_m, block_m, n_n, block_n).reshape(n_m * block_m, -1)[:nq]

    return expand(full), expand(some & ~full)
