"""The SDPA-style entry, :func:`attention`: its arguments checked, then the eager path or the op.

Plain tensors with no tracer or dispatch mode about go first to native.py's C++ path, which
repeats a call key's recorded launches; a key it has no plan for goes through
:class:`_EagerAttention`, an ``autograd.Function`` around the same two bodies as the ops
(launch.py), without the dispatcher, and is recorded on the way.  Everything else
(``torch.compile``, fake tensors, a dispatch mode) goes through the ops (library.py).  Validation
is cached per shape in eager mode; under ``torch.compile`` it runs once, while tracing.
"""

from __future__ import annotations

import math

from kernels import runtime

import torch
import triton  # after kernels.runtime: it decides TRITON_INTERPRET
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from . import launch, native, plans
from .launch import _backward, _call_key, _forward, _launcher
from .library import attention_forward
from .plans import s9

LAYOUTS = ("bhnd", "bnhd")
HEAD_DIMS = s9.HEAD_DIMS


class _EagerAttention(torch.autograd.Function):
    """The same forward and backward for plain eager tensors, without the dispatcher: the
    Python that torch.library wraps around an op's autograd adds host time to every call, as
    much again as the forward's own.  Only :func:`attention` uses it, for calls no tracer sees.
    With ``bnhd`` the tensors come and go in (B, N, H, D) and reach the kernels as they are, their
    strides given in the kernels' (B, H, N, D) order (``plans._bhnd``): no transposed view is made,
    in the forward or the backward."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, causal, window, sink_tokens, scale, bnhd, raw):
        options = (causal, window, sink_tokens, scale)
        key = (_call_key(q, k, v, sinks), options, bnhd)
        raw = raw if raw is not None and _recordable(q, k, v, sinks) else None
        record = [] if raw is not None else None
        o, lse = _forward(q, k, v, sinks, *options, launch=_launcher(key, record), bnhd=bnhd, key=key)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.options, ctx.key, ctx.bnhd, ctx.raw, ctx.record = options, key, bnhd, raw, record
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        raw, forward_record = ctx.raw, ctx.record
        ctx.raw = ctx.record = None                     # a second backward (retain_graph) records nothing
        if raw is not None and raw[-1] != plans.KERNELS:
            raw = None                                  # the kernel set changed since the forward: not its key's
        if raw is not None and (do.stride() != o.stride() or do.data_ptr() % 16
                                or not _recordable(q, k, v, sinks, o, lse, do)):
            # Recorded with a dO laid out as o (a .sum()'s dO has stride 0): the C++ path copies
            # any other dO into that layout the same way.
            do = torch.empty_like(o).copy_(do)
        # The saved tensors are in the key too: a saved-tensor hook may give them back with other strides.
        key = (ctx.key, _call_key(do, q, k, v, o, lse))
        record, keep = ([], {}) if raw is not None else (None, None)
        dq, dk, dv, dsinks = _backward(q, k, v, o, lse, do, sinks, *ctx.options, launch=_launcher(key, record),
                                       bnhd=ctx.bnhd, dsinks_wanted=ctx.needs_input_grad[3], key=key, keep=keep)
        if raw is not None:         # the key's first backward: native.py repeats the call from now on
            forward = native.describe_part(forward_record, [q, k, v, sinks, o, lse], 4, [4, 5])
            buffers = [q, k, v, o, lse, do, sinks, keep["delta"], keep["dsinks_part"], dq, dk, dv]
            backward = native.describe_part(record, buffers, 7, [9, 10, 11]) if forward is not None else None
            _record(q, k, v, sinks, raw, True, forward if backward is not None else None, backward, [q, k, v, o, lse],
                    do)
        return dq, dk, dv, dsinks, None, None, None, None, None, None


def _recordable(*tensors) -> bool:
    """Whether a call's launches can be told apart by buffer: tensors on the current device (whose
    context the compiled kernels were loaded in), each starting at an address of its own.  (Two of
    the call's tensors at one address, say k passed as v, would leave a recorded pointer's role
    ambiguous; such a call is not recorded, and a later one of the same key may be.)"""
    present = [t for t in tensors if t is not None]
    return (len({t.data_ptr() for t in present}) == len(present)
            and present[0].device.index == torch.cuda.current_device())


def _record(q, k, v, sinks, raw, grad, forward, backward=None, saved=(), do=None):
    """Give native.py's C++ path a key's plan (``forward`` None: the key stays on the Python path);
    with a gradient, the backward's part, its saved tensors and dO as that backward had them."""
    module = native.module()
    if module is not None:
        module.record(q, k, v, sinks, *raw, grad, forward, backward, list(saved), do, 8)   # 8: dsinks_part


def _fail(name: str, got, expected: str, layout: str):
    raise ValueError(f"{name}: got {got}, expected {expected} (layout={layout!r})")


def _validate(q, k, v, is_causal, scale, enable_gqa, window, sink_tokens, sinks, layout) -> tuple[int, float]:
    """Check every argument; return ``(window as the op takes it, scale)``."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'bhnd' (B, H, N, D) or 'bnhd' (B, N, H, D), got {layout!r}")
    names = "(B, H, N, D)" if layout == "bhnd" else "(B, N, H, D)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 4:
            _fail(name, f"shape {tuple(x.shape)}", f"4 dimensions {names}", layout)
    h_dim, n_dim = (1, 2) if layout == "bhnd" else (2, 1)
    B, D = q.shape[0], q.shape[3]
    Hq, Hkv, Nk = q.shape[h_dim], k.shape[h_dim], k.shape[n_dim]
    for name, x in (("k", k), ("v", v)):
        if x.shape[0] != B:
            _fail(name, f"batch {x.shape[0]} (shape {tuple(x.shape)})", f"q's batch {B}", layout)
        if x.shape[3] != D:
            _fail(name, f"head dim {x.shape[3]} (shape {tuple(x.shape)})", f"q's head dim {D}", layout)
    if v.shape[h_dim] != Hkv:
        _fail("v", f"{v.shape[h_dim]} heads (shape {tuple(v.shape)})", f"k's {Hkv} heads", layout)
    if v.shape[n_dim] != Nk:
        _fail("v", f"{v.shape[n_dim]} keys (shape {tuple(v.shape)})", f"k's {Nk} keys", layout)
    if Nk == 0:
        _fail("k", f"no keys (shape {tuple(k.shape)})", "at least one key", layout)
    if Hkv == 0 or Hq % Hkv:
        _fail("k", f"{Hkv} heads against q's {Hq} (k shape {tuple(k.shape)})",
              "a number of heads that divides q's", layout)
    if Hq != Hkv and not enable_gqa:
        _fail("enable_gqa", f"False with {Hq} query heads and {Hkv} key/value heads",
              "enable_gqa=True for grouped-query attention, or as many k/v heads as q heads", layout)
    if not HEAD_DIMS[0] <= D <= HEAD_DIMS[1]:
        _fail("q", f"head dim {D}", f"{HEAD_DIMS[0]} to {HEAD_DIMS[1]}", layout)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    runtime.check_dtype(q.dtype)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be True or False, got {enable_gqa!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window must be an int or None, got {window!r}")
        if window < 1:
            raise ValueError(f"window must be at least 1 (the query's own key), got {window}")
        if not is_causal:
            raise ValueError("window needs is_causal=True: a sliding window looks back from the query's position")
    if isinstance(sink_tokens, bool) or not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an int >= 0, got {sink_tokens!r}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor):
            raise TypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
        if sinks.dtype != torch.float32:
            raise TypeError(f"sinks.dtype is {sinks.dtype}; expected torch.float32 (one logit per query head)")
        if tuple(sinks.shape) != (Hq,):
            _fail("sinks", f"shape {tuple(sinks.shape)}", f"({Hq},), one logit per query head of q", layout)
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}; expected one device")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    return (window or 0), float(scale) if scale is not None else 1.0 / math.sqrt(D)


_checked: dict[tuple, tuple[int, float]] = {}
_hooks = triton.knobs.runtime if hasattr(triton, "knobs") else None


def _quiet(hook) -> bool:
    """No Triton launch hook (a profiler's) that a C++ launch would skip: none, or an empty chain."""
    return hook is None or getattr(hook, "calls", None) == []


def attention(q, k, v, *, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              window: int | None = None, sinks: torch.Tensor | None = None, sink_tokens: int = 0,
              layout: str = "bhnd") -> torch.Tensor:
    """Scaled dot-product attention with the workbook's kernels, differentiable, compilable.

    SDPA's argument names, with the workbook's masks and an explicit layout.  Differentiable in
    q, k, v and sinks; under ``torch.compile(fullgraph=True)`` it is the op
    ``workbook::attention_forward`` (no graph break).

    Args:
        q: queries, (B, Hq, Nq, D) with ``layout="bhnd"``, (B, Nq, Hq, D) with ``"bnhd"``; any
            strides.  float16 or bfloat16 (or float32) on a GPU, float16 or float32 on the CPU
            (Triton's interpreter); 16 <= D <= 256.
        k, v: keys and values, (B, Hkv, Nk, D) or (B, Nk, Hkv, D) in the same layout; q's batch,
            head dim, dtype and device; Nk >= 1.
        is_causal: query i sees key j iff j <= i + (Nk - Nq): the diagonal aligned bottom-right.
        scale: the scores' scale, a positive number; None means ``1 / sqrt(D)``.
        enable_gqa: allow Hkv < Hq (grouped-query attention; Hq % Hkv == 0, query head h reads
            key/value head h // (Hq // Hkv)).  Without it Hq must equal Hkv.
        window: W >= 1 (needs ``is_causal``): a query sees the W most recent keys, its own
            included; None: no window.
        sinks: float32 (Hq,) learned sink logits (gpt-oss), one per query head, on q's device,
            with a gradient; None: no learned sinks.
        sink_tokens: S >= 0: keys j < S stay visible whatever the window.
        layout: ``"bhnd"`` (the workbook's and SDPA's) or ``"bnhd"`` (FlashAttention's); it is
            read through strides, never copied, and cannot be guessed from shapes.

    Returns:
        o, q's shape, layout, dtype and strides.  (The log-sum-exp is not returned; the op
        ``workbook::attention_forward`` returns it, (B, Hq, Nq) float32 in natural log.)

    Raises:
        ValueError, TypeError: an argument that breaks the above, named with the layout.
    """
    raw = None
    if not torch.compiler.is_compiling() and type(q) is torch.Tensor and _current_mode() is None:
        module = native.module()
        if module is None:
            if q.is_cuda:
                native.build()                          # once, in the background; the Python path meanwhile
        elif (type(is_causal) is bool and type(enable_gqa) is bool and type(layout) is str
              and (window is None or type(window) is int) and type(sink_tokens) is int
              and (scale is None or type(scale) is float) and _quiet(_hooks.launch_enter_hook)
              and _quiet(_hooks.launch_exit_hook) and launch.DIRECT_LAUNCH):
            try:
                o = module.attention(q, k, v, sinks, is_causal, scale, enable_gqa, window, sink_tokens, layout,
                                     plans.KERNELS)
            except TypeError:                           # an argument of the wrong type: checked below
                o = None
            if o is not None and o is not False:
                return o
            if o is None and q.is_cuda:                 # no plan for this key yet: record this call's
                raw = (is_causal, scale, enable_gqa, window, sink_tokens, layout, plans.KERNELS)
    if torch.compiler.is_compiling():                 # traced once; the sizes become guards
        window_arg, scale_arg = _validate(q, k, v, is_causal, scale, enable_gqa, window, sink_tokens, sinks, layout)
    else:
        try:                                            # an unhashable or non-tensor argument: check it below
            key = (layout, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                   None if sinks is None else (sinks.shape, sinks.dtype, sinks.device),
                   is_causal, scale, enable_gqa, window, sink_tokens)
            checked = _checked.get(key)
        except (AttributeError, TypeError):
            key, checked = None, None
        if checked is None:
            checked = _validate(q, k, v, is_causal, scale, enable_gqa, window, sink_tokens, sinks, layout)
            if key is not None:
                _checked[key] = checked
        window_arg, scale_arg = checked
    bnhd = layout == "bnhd"
    if not torch.compiler.is_compiling() and type(q) is torch.Tensor and _current_mode() is None:
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                        or (sinks is not None and sinks.requires_grad)):
            return _EagerAttention.apply(q, k, v, sinks, is_causal, window_arg, sink_tokens, scale_arg, bnhd, raw)
        options = (is_causal, window_arg, sink_tokens, scale_arg)     # nothing to differentiate: no autograd node
        key = (_call_key(q, k, v, sinks), options, bnhd)
        raw = raw if raw is not None and _recordable(q, k, v, sinks) else None
        record = [] if raw is not None else None
        o, lse = _forward(q, k, v, sinks, *options, launch=_launcher(key, record), bnhd=bnhd, key=key)
        if raw is not None:
            _record(q, k, v, sinks, raw, False, native.describe_part(record, [q, k, v, sinks, o, lse], 4, [4, 5]))
        return o
    if bnhd:                                            # compiling, fake tensors, a dispatch mode: the op
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)      # (B, H, N, D) views
    o, _ = attention_forward(q, k, v, sinks, is_causal, window_arg, sink_tokens, scale_arg)
    return o.transpose(1, 2) if bnhd else o
