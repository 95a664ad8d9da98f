"""Launch plans: the tiles of each kernel, one plan per (shape, dtype, options), made once, outside any tracing.

The tile (BLOCK_M, BLOCK_N, warps, stages) of each kernel is chosen once per (shape, dtype,
options): the table's first entry for short sequences, else stage 9's autotuner run once on random
inputs of that shape, with every tracing mode switched off.  The plan is cached, so the compiler
only ever meets a bare kernel with fixed meta-parameters, and eager calls skip the planning.
"""

from __future__ import annotations

from kernels import runtime, tuning
from kernels.loader import ROOT, load_file

import torch
from torch.utils._python_dispatch import _disable_current_modes

s9 = load_file(ROOT / "solutions" / "stage9_backward.py")     # the kernels, their tables and autotuners

_plans: dict[tuple, dict] = {}


def _cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain integers: Triton's own goes through its constexpr machinery, host
    time on every call, and a call of the op launches up to four kernels."""
    return -(-a // b)


def _pow2(d: int) -> int:
    """``triton.next_power_of_2`` of a head dim (16 ... 256), in plain integers."""
    return 1 << (d - 1).bit_length()


def _tile(config) -> dict:
    """A ``triton.Config`` (or a table row) as the meta-parameters a bare kernel takes."""
    if isinstance(config, tuple):
        bm, bn, warps, stages = config
        return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _tuned(key: tuple) -> dict:
    """Run stage 9's autotuned forward and backward once on random inputs of this shape and
    read off the tiles its autotuners chose.  Every dispatch mode (fake tensors, the tracer) is
    switched off, so this runs real kernels even when called while ``torch.compile`` traces."""
    (b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks = key
    with _disable_current_modes(), torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, hq, nq, d, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        sinks = torch.zeros(hq, device=device) if has_sinks else None
        opts = dict(causal=causal, window=window or None, sink_tokens=sink_tokens, sinks=sinks)
        o, lse = s9.flash_attention(q, k, v, **opts)
        s9.flash_attention_backward(q, k, v, o, lse, torch.randn_like(o), **opts)
        torch.cuda.synchronize(device)
        return {"forward": _tile(s9.flash_forward_kernel.best_config),
                "dkdv": _tile(s9.bwd_dkdv_kernel.best_config),
                "dq": _tile(s9.bwd_dq_kernel.best_config)}


def launch_plan(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype, device: torch.device,
                causal: bool, window: int, sink_tokens: int, has_sinks: bool) -> dict:
    """The tiles of the forward, dK/dV and dQ kernels for one shape, cached.

    Short sequences take each table's first entry (the interpreter's tile on the CPU), as
    stage 9 does; from ``tuning.TUNE_FROM`` (query, key) pairs on a GPU, what stage 9's
    autotuner picks for this shape, timed once.
    """
    key = ((b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks)
    plan = _plans.get(key)
    if plan is None:
        pad = _pow2(d)
        if runtime.ON_GPU and nq * nk >= tuning.TUNE_FROM:
            plan = _tuned(key)
        else:
            plan = {"forward": _tile(tuning.first_entry(tuning.FORWARD_TILES, pad, tuning.FORWARD_INTERPRETER_TILE)),
                    "dkdv": _tile(tuning.first_entry(s9.DKDV_TILES, pad, s9.DKDV_INTERPRETER_TILE)),
                    "dq": _tile(tuning.first_entry(s9.DQ_TILES, pad, s9.DQ_INTERPRETER_TILE))}
        _plans[key] = plan
    return plan


def _bhnd(t: torch.Tensor, bnhd: bool) -> tuple:
    """``(shape, strides)`` of ``t`` read as (B, H, N, D): a (B, N, H, D) tensor's middle two swapped.
    The eager path hands the kernels (B, N, H, D) tensors as they are, with their strides in the
    kernels' order, rather than transposed views: each transpose costs host time, and the
    backward's gradients come out in the caller's layout with no view around them."""
    shape, strides = t.shape, t.stride()
    if bnhd:
        return (shape[0], shape[2], shape[1], shape[3]), (strides[0], strides[2], strides[1], strides[3])
    return tuple(shape), strides


def _plan_for(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int, sink_tokens: int,
              has_sinks: bool, bnhd: bool = False) -> dict:
    b, hq, nq, d = (int(x) for x in _bhnd(q, bnhd)[0])        # int(): a symbolic size specializes here
    hkv, nk = (int(x) for x in _bhnd(k, bnhd)[0][1:3])
    return launch_plan(b, hq, hkv, nq, nk, d, q.dtype, q.device, causal, window, sink_tokens, has_sinks)
