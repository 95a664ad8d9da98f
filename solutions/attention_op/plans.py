"""Launch plans: which kernels, and the tiles of each, one plan per (shape, dtype, options), made
once, outside any tracing.

Two sets of kernels can serve a call: stage 9's, which take any head dim, dtype and strides, and
the TMA kernels (solutions/fast_forward_tma.py, fast_backward_tma.py), faster on Hopper GPUs
(compute capability 9: H100, H200, the GPUs their tile tables were compiled and timed for; later
GPUs keep stage 9's) and limited to what a TMA descriptor can read: head dims that are powers of
two, float16 or bfloat16, tensors whose last stride is 1 and whose start and other strides fall
on 16 bytes (``tma_strides``).  The plan says which set a
shape may use; the strides are checked per call.

The tile (BLOCK_M, BLOCK_N, warps, stages) of each kernel is chosen once per (shape, dtype,
options, set): the table's first entry for short sequences, else the set's autotuners run once
on random inputs of that shape, with every tracing mode switched off.  The plan is cached, so the
compiler only ever meets a bare kernel with fixed meta-parameters, and eager calls skip the
planning.
"""

from __future__ import annotations

from kernels import runtime, tuning
from kernels.loader import ROOT, load_file

import torch
from torch.utils._python_dispatch import _disable_current_modes

s9 = load_file(ROOT / "solutions" / "stage9_backward.py")     # the kernels, their tables and autotuners
tma_forward = load_file(ROOT / "solutions" / "fast_forward_tma.py")
tma_backward = load_file(ROOT / "solutions" / "fast_backward_tma.py")

#: Which kernels a call may use: "auto" (the TMA kernels where the GPU, the head dim, the dtype and
#: the strides allow, else stage 9's), "stage9" (stage 9's always), or "tma" (the TMA kernels
#: wherever the head dim and strides allow, Triton's CPU interpreter included: for tests).
KERNELS = "auto"

#: Whether the TMA backward adds dQ in its dK/dV kernel (``one_pass`` of solutions/fast_backward_tma.py)
#: instead of running a dQ kernel: "auto" times both ways once per shape, where the autotuners run,
#: at head dims 64 and 128, and keeps the faster (two kernels on short sequences); "on" or "off"
#: fixes it (tests).  Never under ``torch.use_deterministic_algorithms(True)``.
ONE_PASS = "auto"

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


def _tuned(key: tuple, tma: bool) -> dict:
    """Run the autotuned forward and backward (stage 9's, or the TMA kernels') once on random
    inputs of this shape and read off the tiles their autotuners chose.  Every dispatch mode
    (fake tensors, the tracer) is switched off, so this runs real kernels even when called while
    ``torch.compile`` traces."""
    (b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks = key
    forward, backward = (tma_forward, tma_backward) if tma else (s9, s9)
    with _disable_current_modes(), torch.no_grad():
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(b, hq, nq, d, device=device, dtype=dtype, generator=gen)
        k, v = (torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
        sinks = torch.zeros(hq, device=device) if has_sinks else None
        opts = dict(causal=causal, window=window or None, sink_tokens=sink_tokens, sinks=sinks)
        o, lse = forward.flash_attention(q, k, v, **opts)
        do = torch.randn_like(o)
        backward.flash_attention_backward(q, k, v, o, lse, do, **opts)
        one_pass = False
        if tma and ONE_PASS != "off" and (ONE_PASS == "on" or d in (64, 128)):   # "auto": the head dims timed
            backward.flash_attention_backward(q, k, v, o, lse, do, one_pass=True, **opts)
            one_pass = ONE_PASS == "on" or _faster(
                lambda: backward.flash_attention_backward(q, k, v, o, lse, do, one_pass=True, **opts),
                lambda: backward.flash_attention_backward(q, k, v, o, lse, do, **opts))
        torch.cuda.synchronize(device)
    if tma:
        return {"tma": True, "forward": _tile(tma_forward._tma_forward_kernel.best_config),
                "dkdv": _tile(tma_backward._tma_dkdv_kernel.best_config),
                "dq": _tile(tma_backward._tma_dq_kernel.best_config), "one_pass": one_pass,
                "one_pass_dkdv": _tile(tma_backward._tma_one_pass_kernel.best_config) if one_pass
                else _tile(tuning.first_entry(tma_backward.ONE_PASS_TILES, d, tma_backward.DKDV_INTERPRETER_TILE))}
    return {"tma": False, "forward": _tile(s9.flash_forward_kernel.best_config),
            "dkdv": _tile(s9.bwd_dkdv_kernel.best_config), "dq": _tile(s9.bwd_dq_kernel.best_config),
            "one_pass": False}


def _faster(first, second) -> bool:
    """Whether ``first`` takes less GPU time than ``second`` (medians of a few runs, each warmed up)."""
    from triton.testing import do_bench
    return do_bench(first, warmup=5, rep=25, return_mode="median") < do_bench(second, warmup=5, rep=25,
                                                                               return_mode="median")


def _tma_shape(d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the TMA kernels may serve this head dim, dtype and device (see ``KERNELS``)."""
    if KERNELS == "stage9" or d & (d - 1) or d < 16:
        return False
    if KERNELS == "tma":
        return True
    return (runtime.ON_GPU and dtype in (torch.float16, torch.bfloat16) and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


def launch_plan(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype, device: torch.device,
                causal: bool, window: int, sink_tokens: int, has_sinks: bool, tma: bool = True) -> dict:
    """Which kernels serve this shape (``"tma"``: True for the TMA kernels, when the strides
    allow) and the tiles of their forward, dK/dV and dQ kernels, cached.  ``tma=False`` asks for
    stage 9's plan, for a call whose strides the TMA kernels cannot read.  ``"one_pass"``: the
    TMA backward adds dQ in its dK/dV kernel, with the tile ``"one_pass_dkdv"`` (``ONE_PASS``).

    Short sequences take each table's first entry (the interpreter's tile on the CPU), as
    stage 9 does; from ``tuning.TUNE_FROM`` (query, key) pairs on a GPU, what the autotuners
    pick for this shape, timed once.
    """
    key = ((b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks)
    plan = _plans.get((key, KERNELS, ONE_PASS, tma))
    if plan is None:
        use_tma = tma and _tma_shape(d, dtype, device)
        pad = _pow2(d)
        if runtime.ON_GPU and nq * nk >= tuning.TUNE_FROM:
            plan = _tuned(key, use_tma)
        elif use_tma:
            plan = {"tma": True,
                    "forward": _tile(tuning.first_entry(tma_forward.TMA_TILES, pad, tma_forward.INTERPRETER_TILE)),
                    "dkdv": _tile(tuning.first_entry(tma_backward.DKDV_TILES, pad,
                                                     tma_backward.DKDV_INTERPRETER_TILE)),
                    "dq": _tile(tuning.first_entry(tma_backward.DQ_TILES, pad, tma_backward.DQ_INTERPRETER_TILE)),
                    "one_pass": ONE_PASS == "on",
                    "one_pass_dkdv": _tile(tuning.first_entry(tma_backward.ONE_PASS_TILES, pad,
                                                              tma_backward.DKDV_INTERPRETER_TILE))}
        else:
            plan = {"tma": False,
                    "forward": _tile(tuning.first_entry(tuning.FORWARD_TILES, pad, tuning.FORWARD_INTERPRETER_TILE)),
                    "dkdv": _tile(tuning.first_entry(s9.DKDV_TILES, pad, s9.DKDV_INTERPRETER_TILE)),
                    "dq": _tile(tuning.first_entry(s9.DQ_TILES, pad, s9.DQ_INTERPRETER_TILE)), "one_pass": False}
        _plans[(key, KERNELS, ONE_PASS, tma)] = plan
    return plan


def tma_strides(*tensors) -> bool:
    """Whether a TMA descriptor can read each tensor where it lies (``tma_compatible`` of the TMA
    forward's file, which takes a traced tensor as aligned)."""
    return all(tma_forward.tma_compatible(t) for t in tensors)


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
              has_sinks: bool, bnhd: bool = False, tma: bool = True) -> dict:
    """The launch plan of a call (its ``"tma"`` says whether the shape allows the TMA kernels)."""
    b, hq, nq, d = (int(x) for x in _bhnd(q, bnhd)[0])        # int(): a symbolic size specializes here
    hkv, nk = (int(x) for x in _bhnd(k, bnhd)[0][1:3])
    return launch_plan(b, hq, hkv, nq, nk, d, q.dtype, q.device, causal, window, sink_tokens, has_sinks, tma)
