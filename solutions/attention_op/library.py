"""The two ``torch.library.triton_op`` ops, ``workbook::attention_forward`` and ``workbook::attention_backward``,
and the custom ops ``workbook::wgmma_forward`` and ``workbook::wgmma_backward`` that they call where
their plan takes a wgmma kernel.

Each triton_op launches the bare kernels through ``wrap_triton``, so ``torch.compile`` sees the
kernels themselves (no graph break).  Each has a fake implementation that allocates the outputs exactly
as the op does and launches nothing, so shapes, dtypes and strides are known without a GPU.
``register_autograd`` ties the two together; the backward has no backward of its own.

PyTorch registers an op's name once per process: this module is imported once, with its package.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .launch import _backward, _backward_outputs, _choose, _forward, _forward_outputs, _wgmma_forward, op_launch


@torch.library.custom_op("workbook::wgmma_forward", mutates_args=())
def wgmma_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                  causal: bool, window: int, sink_tokens: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of (B, H, N, D) views through stage 4's wgmma kernel, where the launch plan
    chose it.  A CUDA kernel behind ctypes is nothing the compiler can trace into, so it is an op
    of its own, which ``attention_forward`` calls and compiled graphs keep as one opaque call.
    Tensors whose strides or start no descriptor can read (a compiled graph may hand over others
    than it traced with) get the Triton forward, launched directly: the same results to within
    rounding, never a copy."""
    _, _, tile = _choose(q, k, v, sinks, causal, window, sink_tokens, False, None)
    if tile is None:
        return _forward(q, k, v, sinks, causal, window, sink_tokens, scale, use_wgmma=False)
    o, lse = _forward_outputs(q)
    _wgmma_forward(q, k, v, o, lse, sinks, causal, window, sink_tokens, scale, tile)
    return o, lse


@wgmma_forward.register_fake
def _wgmma_forward_fake(q, k, v, sinks, causal, window, sink_tokens, scale):
    return _forward_outputs(q)


@torch.library.custom_op("workbook::wgmma_backward", mutates_args=())
def wgmma_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                   do: torch.Tensor, sinks: Optional[torch.Tensor], causal: bool, window: int, sink_tokens: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)`` of (B, H, N, D) views through the one-pass wgmma backward, where
    the launch plan chose it; an op of its own for the reason ``wgmma_forward`` is.  Strides no
    descriptor can read, or deterministic algorithms, get the Triton backward, launched directly."""
    dq, dk, dv, dsinks = _backward(q, k, v, o, lse, do, sinks, causal, window, sink_tokens, scale)
    return dq, dk, dv, dsinks if dsinks is not None else torch.zeros(q.shape[1], device=q.device)


@wgmma_backward.register_fake
def _wgmma_backward_fake(q, k, v, o, lse, do, sinks, causal, window, sink_tokens, scale):
    return (*_backward_outputs(q, k, v), q.new_empty(q.shape[1], dtype=torch.float32))


@triton_op("workbook::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: Optional[torch.Tensor],
                      causal: bool, window: int, sink_tokens: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of (B, H, N, D) views with any strides; window 0 means no window."""
    return _forward(q, k, v, sinks, causal, window, sink_tokens, scale, launch=op_launch,
                    wgmma_op=torch.ops.workbook.wgmma_forward)


@triton_op("workbook::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor, sinks: Optional[torch.Tensor], causal: bool, window: int, sink_tokens: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dsinks)``; an op returns tensors only, so dsinks is zeros (Hq,) without sinks."""
    dq, dk, dv, dsinks = _backward(q, k, v, o, lse, do, sinks, causal, window, sink_tokens, scale,
                                   launch=op_launch, wgmma_op=torch.ops.workbook.wgmma_backward)
    return dq, dk, dv, dsinks if dsinks is not None else torch.zeros(q.shape[1], device=q.device)


# A triton_op's body serves as its fake implementation when its kernels can be traced; these
# say the same without touching a kernel, which also holds on the CPU, where Triton's
# interpreter would try to run the kernels on fake tensors.
@attention_forward.register_fake
def _attention_forward_fake(q, k, v, sinks, causal, window, sink_tokens, scale):
    return _forward_outputs(q)


@attention_backward.register_fake
def _attention_backward_fake(q, k, v, o, lse, do, sinks, causal, window, sink_tokens, scale):
    return (*_backward_outputs(q, k, v), q.new_empty(q.shape[1], dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, causal, window, sink_tokens, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, sinks)
    ctx.options = (causal, window, sink_tokens, scale)
    ctx.mark_non_differentiable(lse)


def _op_backward(ctx, do, _dlse):
    q, k, v, o, lse, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(q, k, v, o, lse, do, sinks, *ctx.options)
    return dq, dk, dv, (dsinks if sinks is not None else None), None, None, None, None


attention_forward.register_autograd(_op_backward, setup_context=_setup_context)
