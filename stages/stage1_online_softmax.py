"""Stage 1: the online softmax, and attention computed one tile at a time, in plain PyTorch.

What you will learn
-------------------
* Why softmax needs the row maximum, and how to keep a *running* maximum so a row can be
  read in blocks, once, without ever holding the whole row (the "online softmax").
* How the same trick turns attention into a loop over tiles of keys: each query block keeps
  a running max ``m``, a running denominator ``l`` and an unnormalised output ``acc``, and
  rescales them whenever ``m`` grows.  That is FlashAttention's forward pass.
* Why the log-sum-exp ``lse = m + log(l)`` is worth returning: the backward pass (stage 9)
  rebuilds every probability from it.

Everything here is PyTorch on whole tensors: no kernels yet.  The loops are the loops a GPU
kernel will run; stage 3 moves them into Triton.

Conventions (see kernels/reference.py): q is (B, H, Nq, D), k and v are (B, H, Nk, D); o is
(B, H, Nq, D) in q's dtype and lse is (B, H, Nq) float32, natural log.
"""

from __future__ import annotations

import math

import torch

from kernels import validate


def online_softmax(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Softmax over the last dimension, reading each row in blocks of ``block`` columns.

    Rows may hold ``-inf`` (masked entries) and values of +-1e4; a row that is all ``-inf``
    gives zeros, not NaN.  Computed in float32, returned in ``x``'s dtype.
    """
    validate.tensor(x, "x")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension, got a scalar")
    xf = x.float()
    n = xf.shape[-1]
    m = torch.full(xf.shape[:-1], float("-inf"))          # running max of each row
    l = torch.zeros(xf.shape[:-1])                         # running sum of exp(x - m)
    m, l = m.to(xf.device), l.to(xf.device)
    # Pass 1: one read of the row, block by block.
    for start in range(0, n, block):
        xb = xf[..., start:start + block]
        # TODO(1a): update the running max m and the running sum l with this block.
        # When the max grows from m to m_new, every term already in l was computed against
        # the old max: multiply l by exp(m - m_new).  Careful: while a row has seen only
        # -inf, m_new is -inf and exp(-inf - -inf) is NaN; subtract 0 instead of -inf then.
        raise NotImplementedError("stage1_online_softmax.py: TODO(1a) is not written yet")
    # Pass 2: normalise.  (Attention needs no second pass: the output is normalised at the end.)
    # TODO(1b): return exp(x - m) / l, with zeros (not NaN) for rows whose l is 0.
    raise NotImplementedError("stage1_online_softmax.py: TODO(1b) is not written yet")


def flash_attention(q, k, v, *, block_m: int, block_n: int, sm_scale: float | None = None):
    """Attention computed tile by tile with the online softmax; returns ``(o, lse)``.

    Any Nq and Nk: the last block of each may be partial.  ``block_m`` query rows and
    ``block_n`` keys make one tile.  No mask: every query sees every key.

    Args:
        q: (B, H, Nq, D) queries, a floating dtype (float16, bfloat16, float32, float64).
        k, v: (B, H, Nk, D) keys and values: q's batch, heads, head dim, dtype and device; Nk >= 1.
        block_m: query rows per tile, a positive int.
        block_n: keys per tile, a positive int.
        sm_scale: the scores' scale, a positive number; None means ``1 / sqrt(D)``.

    Returns:
        ``(o, lse)``: o (B, H, Nq, D) in q's dtype; lse (B, H, Nq) float32, the log-sum-exp of each
        row's scaled scores in natural log (base e).
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(q, k, v, sm_scale=sm_scale)
    if Hq != Hkv:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}; stage 1 expects the same number of heads")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    o = torch.empty_like(q)                                              # (B, H, Nq, D)
    lse = torch.empty(B, Hq, Nq, dtype=torch.float32, device=q.device)   # (B, H, Nq)

    for i0 in range(0, Nq, block_m):                                     # one query block
        qi = q[:, :, i0:i0 + block_m].float()                            # (B, H, bm, D)
        m = torch.full(qi.shape[:-1], float("-inf"), device=q.device)    # (B, H, bm)
        l = torch.zeros(qi.shape[:-1], device=q.device)                  # (B, H, bm)
        acc = torch.zeros_like(qi)                                       # (B, H, bm, D)
        for j0 in range(0, Nk, block_n):                                 # one key block
            kj = k[:, :, j0:j0 + block_n].float()                        # (B, H, bn, D)
            vj = v[:, :, j0:j0 + block_n].float()
            # TODO(1c): scores of this tile, then the online-softmax update of m, l and acc.
            # s = scale * qi @ kj^T; the new max m_new; alpha = exp(m - m_new) rescales the old
            # l and acc; p = exp(s - m_new); l += rowsum(p); acc += p @ vj.
            raise NotImplementedError("stage1_online_softmax.py: TODO(1c) is not written yet")
        # TODO(1d): write this block's output acc / l (in q's dtype) and its lse = m + log(l).
        raise NotImplementedError("stage1_online_softmax.py: TODO(1d) is not written yet")
    return o, lse


