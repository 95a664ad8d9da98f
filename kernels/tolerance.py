"""The workbook's one tolerance rule, and error reports a learner can act on.

FlashAttention's rule: a kernel's error against the float64 reference may be at most
``factor`` times (``OUTPUT_FACTOR`` = 2 for outputs, ``GRADIENT_FACTOR`` = 3 for gradients) the
error that plain PyTorch makes doing the same computation in the input's dtype, plus a small
floor.  A kernel is then held to "as accurate as PyTorch", whatever the dtype.

On a GPU, Triton's float32 ``tl.dot`` uses TF32 (10-bit mantissa): the tensor cores read the
float32 operands and ignore their low 13 mantissa bits.  ``truncate_tf32`` lets the PyTorch
baseline make the same cut, so float32 kernels are judged fairly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Report:
    ok: bool
    message: str
    max_error: float = 0.0
    allowed: float = 0.0


def truncate_tf32(x: torch.Tensor) -> torch.Tensor:
    """Cut a float32 tensor to TF32 as tensor cores do: keep 10 mantissa bits, drop the rest.

    On a tensor that requires grad the cut is straight-through: TF32 values, and gradients that
    flow as through the float32 tensor (the bit mask alone would stop autograd).
    """
    cut = (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)
    if x.requires_grad:
        return x.float() + (cut - x.float()).detach()     # exactly cut: the difference is its dropped bits
    return cut


def baseline_dtype(dtype: torch.dtype):
    """The precision plain PyTorch is measured at for the tolerance rule on this device.

    float32 on a GPU means TF32 matmuls (Triton's default for a float32 ``tl.dot``).
    """
    from kernels import runtime
    return "tf32" if dtype == torch.float32 and runtime.ON_GPU else dtype


LOG2E = 1.4426950408889634
EPS32 = float(torch.finfo(torch.float32).eps)


def attention_floor(o_ref: torch.Tensor, lse_ref: torch.Tensor) -> float:
    """The floor for an attention output ``o``: the float32 roundings of each score's exponent.

    A kernel that works in base 2 rounds every score a few more times than PyTorch does (the
    scale with log2(e) folded in, the running max subtracted, the rescale by exp2(m_old - m_new)),
    each time by up to eps x |s log2(e)|.  An error e in an exponent is a relative error e in p,
    and so in o: the floor grows with the size of the scores, which the log-sum-exp bounds
    (max s <= lse).  With scores near 5 this is about 3x the plain floor; PyTorch's own error,
    a maximum over few elements, can happen to be small on a seed, and this keeps a correct
    kernel from failing on such a seed (the sweep measures the margin).
    """
    finite = lse_ref[torch.isfinite(lse_ref)]
    score = float(finite.abs().max()) if finite.numel() else 0.0
    out = o_ref[torch.isfinite(o_ref)]
    size = float(out.abs().max()) if out.numel() else 0.0
    return EPS32 * (1.0 + size) * (4.0 + LOG2E * score)


OUTPUT_FACTOR = 2.0      # outputs may err twice as much as plain PyTorch ...
GRADIENT_FACTOR = 3.0    # ... and gradients three times


def gradient_floor(*grads: torch.Tensor) -> float:
    """One floor for the gradients ``dq, dk, dv`` of one call, from the largest of their float64 references.

    Where a gradient is exactly zero in exact arithmetic (dk with a window of 1: each p is exactly 1),
    PyTorch's own error can be zero too, and float32 rounding of the kernel is all that is left: a few
    roundings of the largest gradient of the three, rather than of each, allow for it.
    """
    return 4 * EPS32 * (1.0 + max(float(g.detach().abs().max()) for g in grads))


def stored_rounding(dtype: torch.dtype) -> float:
    """The unit roundoff of a tensor stored in ``dtype`` (half its eps): the relative error of the
    forward's ``o`` once it is written in the inputs' dtype, as the backward then reads it."""
    return float(torch.finfo(dtype).eps) / 2 if dtype.is_floating_point and dtype != torch.float64 else 0.0


def backward_floors(p, q, k, v, o, do, lse, *, scale: float, group: int,
                    stored: torch.dtype = torch.float32) -> dict[str, float]:
    """Floors for ``dq``, ``dk`` and ``dv`` from the roundings a FlashAttention backward makes and plain
    PyTorch does not, so that its own error cannot stand for them.  All float64: ``p`` (B, Hq, Nq, Nk)
    the reference's probabilities, ``k`` and ``v`` repeated to (B, Hq, Nk, D), ``lse`` (B, Hq, Nq).

    * ``p = exp2(s log2(e) - lse log2(e))`` is rounded in its exponent by eps x (4 + log2(e) |s|)
      (as in ``attention_floor``): a relative error in every p, so in dv = P^T dO and in
      dS = p * (dp - delta), whence dq = scale dS K and dk = scale dS^T Q.
    * ``dp - delta`` subtracts two sums that are equal in exact arithmetic wherever a row sees one
      key (a window of 1): ``dp = dO . v`` from the values and ``delta = rowsum(dO * O)`` from the
      output.  Each is rounded by about eps x the sum of its |terms|, and nothing cancels that, so
      dq and dk inherit eps x scale x (p * (|dO| |V|^T + rowsum|dO O|)) @ |K| (and @ |Q|).
      PyTorch's autograd takes its delta from the same products as dp, which cancel exactly there,
      so its own error can be zero where the kernel's cannot.
    * ``delta`` reads the output as the forward stored it, in the inputs' dtype ``stored``: each
      ``O`` is off by its unit roundoff (``stored_rounding``), so delta by that x rowsum|dO O|.
    """
    finite = lse[torch.isfinite(lse)]
    exponent = EPS32 * (4.0 + LOG2E * (float(finite.abs().max()) if finite.numel() else 0.0))
    dp = do @ v.transpose(-1, -2)                                         # (B, Hq, Nq, Nk)
    delta = (do * o).sum(dim=-1, keepdim=True)
    ds = (p * (dp - delta)).abs()
    row = (do * o).abs().sum(dim=-1, keepdim=True)                       # rowsum |dO O|, (B, Hq, Nq, 1)
    sums = p * (do.abs() @ v.abs().transpose(-1, -2) + row)
    rounded = exponent * ds + 2 * EPS32 * sums + stored_rounding(stored) * p * row   # |error of dS|
    dq = scale * (rounded @ k.abs())
    dk = scale * (rounded.transpose(-1, -2) @ q.abs())
    dv = exponent * (p.transpose(-1, -2) @ do.abs())
    dk, dv = (x.unflatten(1, (-1, group)).sum(dim=2) for x in (dk, dv))     # a K/V head gets its group's sum
    return {"dq": float(dq.max()), "dk": float(dk.max()), "dv": float(dv.max())}


def sink_gradient_floor(lse: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor, *,
                        row: torch.Tensor | None = None, stored: torch.dtype = torch.float32) -> float:
    """The floor for ``dsinks``, from the float64 reference's ``lse`` and ``delta`` (B, Hq, Nq).

    ``dsinks[h] = -sum over b, i of exp(sinks[h] - lse) * delta``: a sum of B x Nq terms of either sign,
    so it can cancel to a small number while float32 rounding still errs in proportion to the terms
    themselves. A few roundings of the largest head's sum of |terms| allow for that accumulation,
    where a floor from |dsinks| alone (or PyTorch's own error, as lucky as the kernel's) would not.
    Each delta comes from the output as the forward stored it, in the inputs' dtype ``stored``: off
    by its unit roundoff x ``row`` = rowsum|dO O| (B, Hq, Nq), weighted like its term.
    """
    weight = torch.exp(sinks.detach().to(lse)[None, :, None] - lse)
    terms = weight * delta
    floor = 4 * EPS32 * (1.0 + float(terms.abs().sum(dim=(0, 2)).max()))
    if row is not None:
        floor += stored_rounding(stored) * float((weight * row).sum(dim=(0, 2)).max())
    return floor


def _position(index: tuple[int, ...], dims: tuple[str, ...] | None) -> str:
    if dims is None or len(dims) != len(index):
        return str(index)
    return "(" + ", ".join(f"{d}={i}" for d, i in zip(dims, index)) + ")"


def _baseline_error(ref: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    finite = torch.isfinite(ref) & torch.isfinite(base)
    return torch.where(finite, (base - ref).abs(), torch.zeros_like(ref))


def default_floor(ref: torch.Tensor) -> float:
    """A few float32 roundings of the largest finite value of ``ref``."""
    finite = ref[torch.isfinite(ref)]
    return 4 * EPS32 * (1.0 + (float(finite.abs().max()) if finite.numel() else 1.0))


def allowed(ref: torch.Tensor, baseline: torch.Tensor, *, factor: float = OUTPUT_FACTOR,
            floor: float | None = None) -> float:
    """The largest error the rule allows against the float64 ``ref``: ``factor`` x the error of the plain
    PyTorch ``baseline`` + a floor (``default_floor`` unless given).  For checks that judge a quantity
    derived from outputs (notebooks' identities), with the grader's own numbers."""
    ref = ref.detach().to(torch.float64)
    base_err = _baseline_error(ref, baseline.detach().to(ref.device, torch.float64))
    floor = default_floor(ref) if floor is None else floor
    return factor * float(base_err.max()) + floor if base_err.numel() else floor


def compare(out, ref: torch.Tensor, baseline: torch.Tensor, *, name: str = "o", factor: float = OUTPUT_FACTOR,
            floor: float | None = None, dims: tuple[str, ...] | None = None,
            row_dim: int | None = None, block_m: int | None = None) -> Report:
    """Judge ``out`` against the float64 ``ref``, allowing ``factor`` x the error of ``baseline``.

    ``dims`` names the axes in messages (``("b", "h", "i", "d")``); with ``row_dim`` and
    ``block_m`` the message also names the query block (the tile row) of the worst element.
    Positions where ``ref`` is infinite (``lse = -inf`` for rows that see no key) must match it
    exactly.  NaN in ``out`` always fails.
    """
    if not isinstance(out, torch.Tensor):
        return Report(False, f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(ref.shape):
        return Report(False, f"{name}: expected shape {tuple(ref.shape)}, got {tuple(out.shape)}")
    ref = ref.detach().to(torch.float64)          # where the reference was computed: the GPU for real sizes
    got = out.detach().to(ref.device, torch.float64)
    base = baseline.detach().to(ref.device, torch.float64)

    n_nan = int(torch.isnan(got).sum())
    inf_ref = torch.isinf(ref)
    bad_inf = (torch.isinf(got) | inf_ref) & (got != ref)
    n_bad_inf = int(bad_inf.sum())
    finite = ~inf_ref
    err = torch.where(finite, (got - ref).abs(), torch.zeros_like(ref))
    err = torch.where(torch.isnan(err) | bad_inf, torch.full_like(err, float("inf")), err)
    floor = default_floor(ref) if floor is None else floor
    limit = allowed(ref, base, factor=factor, floor=floor)
    max_err = float(err.max()) if err.numel() else 0.0
    if max_err <= limit and n_nan == 0:
        return Report(True, f"{name}: max error {max_err:.2e} <= allowed {limit:.2e}", max_err, limit)

    worst = tuple(int(i) for i in torch.unravel_index(torch.argmax(err), err.shape))
    where = _position(worst, dims)
    if row_dim is not None and block_m:
        where += f", query block {worst[row_dim] // block_m} (rows {worst[row_dim] // block_m * block_m}.."
        where += f"{worst[row_dim] // block_m * block_m + block_m - 1})"
    fin_err = err[torch.isfinite(err)]
    mean = float(fin_err.mean()) if fin_err.numel() else float("nan")
    base_err = float(_baseline_error(ref, base).max()) if ref.numel() else 0.0
    parts = [f"{name}: max error {max_err:.3g} > allowed {limit:.3g} "
             f"({factor:g} x PyTorch's own error {base_err:.3g} + {floor:.1g})",
             f"mean error {mean:.3g}; worst at {where}: got {float(got[worst]):.6g}, expected {float(ref[worst]):.6g}"]
    if n_nan:
        parts.append(f"{n_nan} NaN of {got.numel()} (a masked row divided by zero, exp(-inf - -inf), "
                     "or an element never written)")
    if n_bad_inf:
        parts.append(f"{n_bad_inf} elements where the reference or the output is infinite and they differ")
    return Report(False, "; ".join(parts), max_err, limit)
