"""Correctness before timing: each provider's output (and gradients) against the float64 reference,
under the workbook's tolerance rule, on a slice of the case small enough for float64."""

from __future__ import annotations

import torch

from grader.bench.cases import Case, Inputs

Q_DIMS = ("b", "h", "i", "d")
KV_DIMS = ("b", "h_kv", "j", "d")


def checked_heads(case: Case) -> tuple[int, int]:
    """(query heads, kv heads) re-checked on batch 0: heads 0.. of each.

    Forward: two query heads (and the kv heads they read).  Backward: the whole group of query
    heads that share kv head 0 (at least two heads), since dk and dv sum over the group.
    """
    group = case.heads // case.hkv
    if case.backward:
        n_kv = min(case.hkv, -(-2 // group))
        return n_kv * group, n_kv
    n_q = min(2, case.heads)
    return n_q, -(-n_q // group)


def references(case: Case, x: Inputs) -> dict:
    """{name: (float64 reference, PyTorch-in-bf16 baseline, dims, factor, floor)} on the checked heads.

    The slice (batch 0, the checked heads) is a whole attention problem of its own, so the float64
    reference costs a few (heads x Nq x Nk) matrices: at most 2 GB each for 4 heads at N8192.
    """
    from kernels import reference, tolerance
    n_q, n_kv = checked_heads(case)
    q, k, v = x.q[:1, :n_q], x.k[:1, :n_kv], x.v[:1, :n_kv]
    sinks = x.sinks[:n_q] if x.sinks is not None else None
    base_dtype = tolerance.baseline_dtype(case.dtype)
    if not case.backward:
        ref, _ = reference.attention(q, k, v, sinks=sinks, **case.mask)
        base, _ = reference.attention(q, k, v, sinks=sinks, compute_dtype=base_dtype, **case.mask)
        return {"o": (ref, base, Q_DIMS, tolerance.OUTPUT_FACTOR, None)}

    do = x.do[:1, :n_q]
    ref = reference.attention_grads(q, k, v, do, sinks=sinks, **case.mask)
    base = reference.attention_grads(q, k, v, do, sinks=sinks, compute_dtype=base_dtype, **case.mask)
    floors, factor = reference.gradient_floors(q, k, v, do, ref, sinks=sinks, **case.mask), tolerance.GRADIENT_FACTOR
    return {"o": (ref[0], base[0], Q_DIMS, tolerance.OUTPUT_FACTOR, None),
            "dq": (ref[1], base[1], Q_DIMS, factor, floors["dq"]),
            "dk": (ref[2], base[2], KV_DIMS, factor, floors["dk"]),
            "dv": (ref[3], base[3], KV_DIMS, factor, floors["dv"])}


def verify(outputs: dict, refs: dict, case: Case) -> str | None:
    """None if every output passes the tolerance rule on the checked heads, else why not."""
    from kernels import tolerance
    n_q, n_kv = checked_heads(case)
    for name, (ref, base, dims, factor, floor) in refs.items():
        out = outputs[name]
        full = (case.batch, case.heads if dims is Q_DIMS else case.hkv, case.n_q if dims is Q_DIMS else case.n_k,
                case.head_dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != full:
            return f"{name}: returned {type(out).__name__} of shape {tuple(getattr(out, 'shape', ()))}; expected {full}"
        heads = n_q if dims is Q_DIMS else n_kv
        report = tolerance.compare(out[:1, :heads], ref, base, name=name, factor=factor, floor=floor, dims=dims)
        if not report.ok:
            return report.message
    return None
