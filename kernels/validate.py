"""Input checks shared by every attention stage and the reference.

A kernel handed the wrong shape does not fail loudly: it reads past the end of a tensor or
quietly mixes heads.  So every wrapper calls ``attention_inputs`` first, and bad input gets
a ``ValueError``/``TypeError`` that names the argument, what it got and what was expected.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def tensor(x, name: str, *, ndim: int | None = None, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    """Check that ``x`` is a tensor of the given rank and one of ``dtypes``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        raise TypeError(f"{name}.dtype is {x.dtype}; expected one of {', '.join(map(str, dtypes))}")
    return x


def attention_inputs(q, k, v, *, causal: bool = False, window=None, sink_tokens: int = 0,
                     sinks=None, sm_scale=None, head_dims: tuple[int, int] | None = None,
                     dtypes=FLOAT_DTYPES) -> tuple[int, int, int, int, int, int]:
    """Validate attention arguments; return ``(B, Hq, Hkv, Nq, Nk, D)``.

    ``head_dims=(lo, hi)`` limits the head dim a kernel supports; ``dtypes`` the dtypes.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        tensor(x, name, ndim=4, dtypes=dtypes)
    B, Hq, Nq, D = q.shape
    Bk, Hkv, Nk, Dk = k.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"k has batch {Bk} but q has batch {B}; expected the same batch size")
    if Dk != D:
        raise ValueError(f"k has head dim {Dk} but q has head dim {D}; expected the same head dim")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"q has {Hq} heads and k/v have {Hkv}: the number of query heads must be a multiple "
            "of the number of key/value heads (Hq % Hkv == 0)"
        )
    if Nk == 0:
        raise ValueError(f"k and v have no keys (Nk = 0); expected at least one, shape {tuple(k.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if head_dims is not None and not head_dims[0] <= D <= head_dims[1]:
        raise ValueError(f"head dim (q.shape[-1]) is {D}; this kernel supports {head_dims[0]} to {head_dims[1]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int or None, got {window!r}")
        if window < 1:
            raise ValueError(f"window must be at least 1 (the query's own key), got {window}")
        if not causal:
            raise ValueError("window needs causal=True: a sliding window looks back from the query's position")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    if sinks is not None:
        tensor(sinks, "sinks", ndim=1, dtypes=(torch.float32, torch.float64))
        if sinks.shape[0] != Hq:
            raise ValueError(f"sinks must have shape ({Hq},), one logit per query head; got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}; expected one device")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive number or None, got {sm_scale!r}")
    return B, Hq, Hkv, Nq, Nk, D


def block_size(value, name: str) -> int:
    """Block sizes are powers of two of at least 16 (tl.dot's smallest tile)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
    return value


def backward_inputs(q, o, lse, do) -> None:
    """o and do of q's shape and dtype, lse the forward's float32 (B, Hq, Nq): a fast backward's
    checks beyond ``attention_inputs``."""
    for name, x in (("o", o), ("do", do)):
        if not isinstance(x, torch.Tensor) or x.shape != q.shape or x.dtype != q.dtype:
            raise ValueError(f"{name} must be a {q.dtype} tensor of q's shape {tuple(q.shape)}, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not isinstance(lse, torch.Tensor) or lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"lse must be the forward's float32 tensor of shape {tuple(q.shape[:3])}, got "
                         f"{tuple(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__}")
