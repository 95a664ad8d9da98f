"""The one reference attention every test, notebook and benchmark compares against.

It is deliberately naive: it builds the whole score matrix in float64, so it is easy to
trust and only suitable for test sizes.
"""

from __future__ import annotations

import math
import warnings

from kernels import masks, tolerance, validate

import torch

# A backward on the GPU started from one of the grader's check threads makes PyTorch warn that no
# CUDA context was current there and that it is setting the primary one, which it does: the
# results are unaffected, so a learner should not see it.
warnings.filterwarnings("ignore", message="Attempting to run cuBLAS, but there was no current CUDA context",
                        category=UserWarning)


def attention(q, k, v, *, causal=False, window=None, sink_tokens=0, sinks=None, sm_scale=None,
              compute_dtype=torch.float64):
    """Scaled dot-product attention with every feature of the workbook, as the specification.

    Shapes (the workbook's layout is ``(batch, heads, sequence, head dim)``)::

        q      (B, Hq,  Nq, D)    queries; may be non-contiguous
        k, v   (B, Hkv, Nk, D)    keys and values; Hq % Hkv == 0
        sinks  (Hq,)              float32 learned sink logits, or None
        o      (B, Hq,  Nq, D)    returned in ``compute_dtype`` (float64 by default)
        lse    (B, Hq,  Nq)       natural-log log-sum-exp of each row's scaled scores

    Scores are ``s[i, j] = sm_scale * q[i] . k[j]`` with ``sm_scale = 1/sqrt(D)`` by default.
    ``o[i] = sum_j p[i, j] v[j]`` with ``p = exp(s - lse)`` over the visible keys.

    **GQA / MQA.**  Query head ``h`` reads key/value head ``h // (Hq // Hkv)``: with Hq = 8 and
    Hkv = 2, heads 0-3 share kv head 0 and heads 4-7 share kv head 1 (MQA is Hkv = 1).

    **Causal, aligned bottom-right.**  Query ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)``, so
    the last query always sees the last key.  ``#`` is visible, ``.`` masked::

        Nq = 3, Nk = 5 (offset +2)       Nq = 5, Nk = 3 (offset -2)
              k0 k1 k2 k3 k4                   k0 k1 k2
          q0   #  #  #  .  .               q0   .  .  .    <- sees no key
          q1   #  #  #  #  .               q1   .  .  .    <- sees no key
          q2   #  #  #  #  #               q2   #  .  .
                                           q3   #  #  .
                                           q4   #  #  #

    **Sliding window** ``window=W`` (needs ``causal=True``): query ``i`` sees key ``j`` iff
    ``i' - W < j <= i'`` with ``i' = i + (Nk - Nq)``: exactly ``W`` keys counting its own::

        W = 3, Nq = Nk = 6
              k0 k1 k2 k3 k4 k5
          q0   #  .  .  .  .  .
          q1   #  #  .  .  .  .
          q2   #  #  #  .  .  .
          q3   .  #  #  #  .  .
          q4   .  .  #  #  #  .
          q5   .  .  .  #  #  #

    **Sink tokens** ``sink_tokens=S`` (StreamingLLM): keys ``j < S`` stay visible to every
    query that may see them causally, whatever the window.  ``S`` has no effect without a
    window, since causal attention sees them anyway::

        W = 2, S = 1, Nq = Nk = 6
              k0 k1 k2 k3 k4 k5
          q0   #  .  .  .  .  .
          q1   #  #  .  .  .  .
          q2   #  #  #  .  .  .
          q3   #  .  #  #  .  .
          q4   #  .  .  #  #  .
          q5   #  .  .  .  #  #

    **Learned sinks** ``sinks`` (gpt-oss): one logit per query head, a virtual key whose
    value is zero.  It adds ``exp(sinks[h])`` to every row's softmax denominator, so the
    visible keys' weights sum to less than one::

        lse[b, h, i] = log( exp(sinks[h]) + sum over visible j of exp(s[i, j]) )

    **Rows that see no key** (possible when Nq > Nk with causal alignment) give ``o = 0`` and
    ``lse = -inf``, or ``lse = sinks[h]`` with learned sinks: never NaN.

    ``compute_dtype`` exists for the tolerance rule: the same computation in the input's
    dtype measures how much error plain PyTorch makes at that precision.  ``"tf32"`` computes
    in float32 with every matmul operand cut to TF32, as a GPU's float32 ``tl.dot`` does.

    Args:
        q: (B, Hq, Nq, D) queries, a floating dtype, any strides.
        k, v: (B, Hkv, Nk, D) keys and values, one shape, q's dtype and device; Hq % Hkv == 0
            (GQA: Hq // Hkv query heads per key/value head) and Nk >= 1.
        causal: mask keys after the query's position, the diagonal aligned bottom-right.
        window: W >= 1, the keys a query sees counting its own (needs ``causal``); None: no window.
        sink_tokens: S >= 0 leading keys kept visible whatever the window.
        sinks: (Hq,) float32 (or float64) learned sink logits on q's device, or None.
        sm_scale: the scores' scale, a positive number; None means ``1 / sqrt(D)``.
        compute_dtype: the dtype everything is computed in (float64 by default), or ``"tf32"``.

    Returns:
        ``(o, lse)``: o (B, Hq, Nq, D) and lse (B, Hq, Nq), both in ``compute_dtype`` (float32
        for ``"tf32"``); lse is in natural log (base e).

    Raises:
        ValueError, TypeError: an argument that breaks the above (``validate.attention_inputs``),
        named in the message.
    """
    p, vc, lse, operand = _probabilities(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens,
                                         sinks=sinks, sm_scale=sm_scale, compute_dtype=compute_dtype)
    o = torch.matmul(operand(p), vc)                              # (B, Hq, Nq, D)
    return o, lse


def _probabilities(q, k, v, *, causal, window, sink_tokens, sinks, sm_scale, compute_dtype):
    """``attention``'s softmax: ``(p, v, lse, operand)``, p (B, Hq, Nq, Nk) over the real keys (zero where
    masked; a learned sink's share is what the row lacks of 1), v with its heads repeated for GQA,
    lse (B, Hq, Nq), and the cut every matmul operand gets (TF32 or none)."""
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(
        q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, sm_scale=sm_scale)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    group = Hq // Hkv
    tf32 = compute_dtype == "tf32"
    compute_dtype = torch.float32 if tf32 else compute_dtype
    operand = tolerance.truncate_tf32 if tf32 else (lambda t: t)
    qc, kc, vc = (operand(t.to(compute_dtype)) for t in (q, k, v))
    kc = kc.repeat_interleave(group, dim=1)                       # (B, Hq, Nk, D)
    vc = vc.repeat_interleave(group, dim=1)

    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale           # (B, Hq, Nq, Nk)
    visible = masks.materialize(
        masks.attention_mask(Nq, Nk, causal=causal, window=window, sink_tokens=sink_tokens),
        Nq, Nk, device=q.device)
    s = s.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(compute_dtype).view(1, Hq, 1, 1).expand(B, Hq, Nq, 1)
        s = torch.cat([s, sink_col], dim=-1)                     # (B, Hq, Nq, Nk + 1)

    lse = torch.logsumexp(s, dim=-1)                             # (B, Hq, Nq); -inf if empty
    safe_lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse[..., None])                       # exp(-inf) = 0 on masked keys
    if sinks is not None:
        p = p[..., :Nk]                                          # the sink's value is zero
    return p.to(compute_dtype), vc, lse, operand


def attention_grads(q, k, v, do, *, sinks=None, compute_dtype=torch.float64, **opts):
    """``(o, dq, dk, dv, dsinks)``: autograd through ``attention`` for the output gradient ``do``.

    The reference's gradients in ``compute_dtype``: float64 gives the answer, the input's dtype
    (``tolerance.baseline_dtype``) the error plain PyTorch makes, for the tolerance rule.  The
    leaves are float64 copies of ``q``, ``k``, ``v`` for float64 and copies in their own dtype
    otherwise; ``sinks`` keeps its dtype (float32), so ``dsinks`` comes back in it, and is None
    without learned sinks.  ``opts`` are ``attention``'s options (causal, window, sink_tokens,
    sm_scale).  Nothing given is modified.

    Args:
        q, k, v: as for :func:`attention`: (B, Hq, Nq, D) and (B, Hkv, Nk, D).
        do: (B, Hq, Nq, D), the gradient of the loss with respect to o.
        sinks: (Hq,) learned sink logits, or None.
        compute_dtype: float64 (the answer) or the inputs' dtype (the baseline).
        **opts: ``causal``, ``window``, ``sink_tokens``, ``sm_scale`` as for :func:`attention`.

    Returns:
        ``(o, dq, dk, dv, dsinks)``: o (B, Hq, Nq, D) in ``compute_dtype``; dq, dk, dv shaped like
        q, k, v in the leaves' dtype; dsinks (Hq,) in ``sinks``'s dtype, or None without sinks.
    """
    leaf_dtype = torch.float64 if compute_dtype == torch.float64 else q.dtype
    q, k, v = (t.detach().to(leaf_dtype).requires_grad_(True) for t in (q, k, v))
    s = sinks.detach().clone().requires_grad_(True) if sinks is not None else None
    o, _ = attention(q, k, v, sinks=s, compute_dtype=compute_dtype, **opts)
    o.backward(do.to(o.dtype))
    return o.detach(), q.grad, k.grad, v.grad, (s.grad if s is not None else None)


def gradient_floors(q, k, v, do, grads, *, sinks=None, **opts) -> dict:
    """The tolerance floors of each gradient, by name, for ``grads = attention_grads(...)`` in float64:
    for dq, dk and dv a few roundings of the largest of them (``tolerance.gradient_floor``) plus what
    the backward's own arithmetic rounds (``tolerance.backward_floors``, the output stored in q's dtype
    included); with learned sinks, dsinks's (``tolerance.sink_gradient_floor``, from this call's lse
    and delta).  The grader, the notebooks, the benchmark and the tests judge gradients with these.

    Args:
        q, k, v, do: the inputs ``grads`` came from, as for :func:`attention_grads`.
        grads: ``attention_grads(q, k, v, do, sinks=sinks, **opts)`` in float64.
        sinks: (Hq,) learned sink logits, or None.
        **opts: ``causal``, ``window``, ``sink_tokens``, ``sm_scale`` as for :func:`attention`.

    Returns:
        ``{"dq": float, "dk": float, "dv": float}``, and ``"dsinks"`` with learned sinks: the floor
        each gradient's allowed absolute error gets (``tolerance.allowed``'s ``floor``).
    """
    p, vc, lse, _ = _probabilities(q, k, v, sinks=sinks, compute_dtype=torch.float64, causal=opts.get("causal", False),
                                   window=opts.get("window"), sink_tokens=opts.get("sink_tokens", 0),
                                   sm_scale=opts.get("sm_scale"))
    B, Hq, Nq, D = q.shape
    group = Hq // k.shape[1]
    scale = opts["sm_scale"] if opts.get("sm_scale") is not None else 1.0 / math.sqrt(D)
    o, do64 = grads[0].to(torch.float64), do.to(torch.float64)
    kc = k.to(torch.float64).repeat_interleave(group, dim=1)
    own = tolerance.backward_floors(p, q.to(torch.float64), kc, vc, o, do64, lse, scale=scale, group=group,
                                    stored=q.dtype)
    floor = tolerance.gradient_floor(*grads[1:4])
    floors = {name: floor + own[name] for name in ("dq", "dk", "dv")}
    if sinks is not None:
        delta = (do64 * o).sum(dim=-1)
        floors["dsinks"] = tolerance.sink_gradient_floor(lse, delta, sinks, row=(do64 * o).abs().sum(dim=-1),
                                                         stored=q.dtype)
    return floors


def softmax(x: torch.Tensor, *, compute_dtype=torch.float64) -> torch.Tensor:
    """Row softmax over the last dimension; a row that is all ``-inf`` gives zeros, not NaN.

    Args:
        x: any shape, a floating dtype; the softmax runs over ``x``'s last dimension.
        compute_dtype: the dtype it is computed in (float64 by default).

    Returns:
        A tensor of ``x``'s shape in ``compute_dtype`` whose rows sum to 1 (or are all zeros).
    """
    x = x.to(compute_dtype)
    m = x.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    e = torch.exp(x - m)
    d = e.sum(dim=-1, keepdim=True)
    return e / torch.where(d == 0, torch.ones_like(d), d)
