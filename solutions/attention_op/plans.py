"""Launch plans: which kernels, and the tiles of each, one plan per (shape, dtype, options), made
once, outside any tracing.

Two sets of kernels can serve a call: stage 9's, which take any head dim, dtype and strides, and
the TMA kernels (solutions/fast_forward_tma.py, fast_backward_tma.py), faster on Hopper GPUs
(compute capability 9: H100, H200, the GPUs their tile tables were compiled and timed for; later
GPUs keep stage 9's) and limited to what a TMA descriptor can read: head dims that are powers of
two, float16 or bfloat16, tensors whose last stride is 1 and whose start and other strides fall
on 16 bytes (``tma_strides``).  The plan says which set a
shape may use; the strides are checked per call.

The forward has a third candidate on those GPUs: stage 4's CUDA kernel with wgmma
(solutions/fast_variable_block_wgmma.cu), which takes every head dim that is a multiple of 8 and
every mask of stages 5-8, under the same stride rule.  Where a plan is tuned (long sequences on
an sm_90 GPU with nvcc), it is built for the shape's head dim and tile (once; kept on disk like
every CUDA kernel of the workbook), both forwards are timed on the GPU, and the plan keeps the
faster (``"wgmma"``: its tile, or None; ``"forward_ms"``: what each took).  A build that fails
leaves the Triton forward.  The backward has a third candidate there too: the one-pass CUDA
backward (solutions/fast_backward_wgmma.cu: head dims 64 and 128, Nq and Nk multiples of 128),
built and timed against the TMA backward the same way, at a key's first backward, so that a
forward-only caller never builds it (``backward_plan``: whether it serves, and what each took);
it is kept where a call with it, GPU or host, whichever is longer, is faster (``ONE_PASS_HOST_MS``).
Either backward needs only o and lse, whichever forward wrote them.

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
wgmma = load_file(ROOT / "solutions" / "fast_variable_block_wgmma.py")
wgmma_backward = load_file(ROOT / "solutions" / "fast_backward_wgmma.py")

#: Which kernels a call may use: "auto" (the TMA kernels where the GPU, the head dim, the dtype and
#: the strides allow, else stage 9's; the wgmma forward where it was timed faster), "stage9"
#: (stage 9's always), "tma" (the TMA kernels wherever the head dim and strides allow, Triton's
#: CPU interpreter included, and never the wgmma kernels: for tests), or "wgmma" ("auto" with the
#: wgmma forward and backward wherever they can run, untimed: for tests).
KERNELS = "auto"

#: Launch plans by (shape, dtype, device, mask, KERNELS, tma).  Made once and kept for the process:
#: a plan made before ``WORKBOOK_AUTOTUNE`` or ``tuning.TUNE_FROM`` changes keeps the rule it was
#: made under (tests that change them start from an empty cache).
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


def _random_inputs(key: tuple) -> tuple:
    """``(q, k, v, options)``: random inputs of a plan's key, with the options its kernels take
    (call with every dispatch mode off)."""
    (b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks = key
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, hq, nq, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, nk, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    sinks = torch.zeros(hq, device=device) if has_sinks else None
    return q, k, v, dict(causal=causal, window=window or None, sink_tokens=sink_tokens, sinks=sinks)


def _tuned(key: tuple, tma: bool) -> dict:
    """Run the autotuned forward and backward (stage 9's, or the TMA kernels') once on random
    inputs of this shape and read off the tiles their autotuners chose.  Every dispatch mode
    (fake tensors, the tracer) is switched off, so this runs real kernels even when called while
    ``torch.compile`` traces."""
    device, (_, _, _, nq, nk, _) = key[2], key[0]
    forward, backward = (tma_forward, tma_backward) if tma else (s9, s9)
    with _disable_current_modes(), torch.no_grad(), tuning.tuned_from(nq * nk):
        q, k, v, opts = _random_inputs(key)
        o, lse = forward.flash_attention(q, k, v, **opts)
        backward.flash_attention_backward(q, k, v, o, lse, torch.randn_like(o), **opts)
        torch.cuda.synchronize(device)
    if tma:
        return {"tma": True, "forward": _tile(tma_forward._tma_forward_kernel.best_config),
                "dkdv": _tile(tma_backward._tma_dkdv_kernel.best_config),
                "dq": _tile(tma_backward._tma_dq_kernel.best_config)}
    return {"tma": False, "forward": _tile(s9.flash_forward_kernel.best_config),
            "dkdv": _tile(s9.bwd_dkdv_kernel.best_config), "dq": _tile(s9.bwd_dq_kernel.best_config)}


def _wgmma_shape(b: int, hq: int, d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the wgmma forward may serve this shape, dtype and device (see ``KERNELS``)."""
    return (KERNELS in ("auto", "wgmma") and runtime.ON_GPU and device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and 16 <= d <= 256 and b * hq <= 65535
            and torch.cuda.get_device_capability(device) == (9, 0))


def _gpu_ms(fn, reps: int = 10) -> float:
    """GPU milliseconds per call of ``fn``: the calls are queued behind a spin of the GPU long
    enough for the host to queue them all, so the host's time per call (Python, Triton's launcher)
    is not counted, only the kernels'."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)                   # ~10 ms of the GPU's clock
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def _wgmma_plan(key: tuple, plan: dict, timed: bool) -> dict:
    """``plan`` with ``"wgmma"`` (the wgmma forward's tile, or None) and, when ``timed``,
    ``"forward_ms"``: each forward's GPU time on random inputs of this shape, the faster kept."""
    (_, _, _, _, _, d), _, _, causal, window, _, _ = key
    tile = wgmma.plan(d, causal, window > 0)
    try:
        wgmma.library(d, *tile)                     # built here, outside any call it would stall
    except Exception as error:                      # noqa: BLE001 - no nvcc, a failed build: the Triton forward
        return {**plan, "wgmma": None, "wgmma_error": f"{type(error).__name__}: {error}"}
    if not timed:
        return {**plan, "wgmma": tile}
    forward = tma_forward if plan["tma"] else s9
    with _disable_current_modes(), torch.no_grad(), torch.cuda.device(key[2]):   # its spin and events on q's GPU
        q, k, v, opts = _random_inputs(key)
        ms = {"wgmma": _gpu_ms(lambda: wgmma.flash_attention(q, k, v, **opts)),
              "tma" if plan["tma"] else "stage9": _gpu_ms(lambda: forward.flash_attention(q, k, v, **opts))}
    faster = min(ms, key=ms.get)
    return {**plan, "wgmma": tile if faster == "wgmma" else None, "forward_ms": ms}


def _wgmma_backward_shape(b: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype,
                          device: torch.device) -> bool:
    """Whether the one-pass wgmma backward may serve this shape, dtype and device (see ``KERNELS``)."""
    return (KERNELS in ("auto", "wgmma") and runtime.ON_GPU and device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16) and wgmma_backward.supports(b, hkv, nq, nk, d)
            and torch.cuda.get_device_capability(device) == (9, 0))


#: The most host time an eager forward plus backward took with the wgmma kernels, and with the TMA
#: kernels, in ms (grader/bench/probes/one_pass_host.py on an H200, at bench train's layers: 0.39-0.65
#: and 0.11-0.15).  The one pass's keys stay on the Python path (native.py does not repeat them),
#: and in a compiled graph it is an opaque op that runs Python.  A call takes the longer of its GPU
#: time and its host time, so the plan compares max(GPU ms, host ms) of the two backwards.
ONE_PASS_HOST_MS = 0.65
TMA_HOST_MS = 0.15

_backward_plans: dict[tuple, dict] = {}


def keeps_one_pass(ms: dict) -> bool:
    """Whether a call is faster with the one pass than with the other backward, each taking the
    longer of its GPU time (``ms``, as ``backward_plan`` times them) and its host time."""
    other = next(name for name in ms if name != "wgmma")
    return max(ms["wgmma"], ONE_PASS_HOST_MS) < max(ms[other], TMA_HOST_MS)


def backward_plan(b: int, hq: int, hkv: int, nq: int, nk: int, d: int, dtype: torch.dtype, device: torch.device,
                  causal: bool, window: int, sink_tokens: int, has_sinks: bool) -> dict:
    """``{"wgmma_backward": whether the one-pass backward serves this shape}``, cached, made at the
    shape's first backward (see ``KERNELS``).  Where a plan is tuned it is built and timed against
    the plan's Triton backward on random inputs of this shape (``"backward_ms"``) and kept where
    ``keeps_one_pass``; a failed build leaves the Triton backward (``"wgmma_backward_error"``)."""
    key = ((b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks)
    plan = _backward_plans.get((key, KERNELS))
    if plan is not None:
        return plan
    plan = {"wgmma_backward": False}
    if _wgmma_backward_shape(b, hkv, nq, nk, d, dtype, device) and (KERNELS == "wgmma" or long_heads(nq, nk)):
        try:
            wgmma_backward.library(d)               # built here, outside any call it would stall
        except Exception as error:                  # noqa: BLE001 - no nvcc, a failed build: the Triton backward
            plan = {"wgmma_backward": False, "wgmma_backward_error": f"{type(error).__name__}: {error}"}
        else:
            plan = {"wgmma_backward": True} if KERNELS == "wgmma" else _timed_backward(key)
    _backward_plans[(key, KERNELS)] = plan
    return plan


def _timed_backward(key: tuple) -> dict:
    """The one pass and the launch plan's Triton backward timed on random inputs of ``key``'s shape."""
    (b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks = key
    tma = launch_plan(b, hq, hkv, nq, nk, d, dtype, device, causal, window, sink_tokens, has_sinks)["tma"]
    forward, backward = (tma_forward, tma_backward) if tma else (s9, s9)
    with _disable_current_modes(), torch.no_grad(), torch.cuda.device(device):
        q, k, v, opts = _random_inputs(key)
        o, lse = forward.flash_attention(q, k, v, **opts)
        do = torch.randn_like(o)
        ms = {"wgmma": _gpu_ms(lambda: wgmma_backward.flash_attention_backward(q, k, v, o, lse, do, **opts)),
              "tma" if tma else "stage9": _gpu_ms(lambda: backward.flash_attention_backward(q, k, v, o, lse, do,
                                                                                           **opts))}
    return {"wgmma_backward": keeps_one_pass(ms), "backward_ms": ms}


#: (query, key) pairs of a whole call, over its batch and query heads, from which its Triton tiles
#: are timed even where each head is shorter than ``tuning.TUNE_FROM``: 8 sequences x 8 heads x
#: 1024 x 1024, bench train's b8n1024 layers.  There the attention kernels took 0.50 ms a step
#: with every plan timed against 0.57 with the first tiles (one run), and 0.50 with these timed
#: tiles alone (another).  Timing costs seconds once, and an op is called again and
#: again with one shape.  The wgmma kernels still wait for ``TUNE_FROM`` pairs a head: timed at
#: those layers too, they bought the kernels nothing more (0.51 ms a step against 0.50, separate
#: runs), and the wgmma forward is an opaque op whose Python runs in every compiled step.
#: docs/hopper-notes.md, sections 16 and 17.
TUNE_WORK = 8 * 8 * 1024 * 1024


def timed(b: int, hq: int, nq: int, nk: int) -> bool:
    """Whether a call's Triton tiles are timed: where ``long_heads``, or from ``TUNE_WORK`` pairs
    over the whole call where ``tuning.timing()`` (on a GPU, autotuning on)."""
    return long_heads(nq, nk) or (b * hq * nq * nk >= TUNE_WORK and tuning.timing())


def long_heads(nq: int, nk: int) -> bool:
    """Whether each head is long enough for the plan to time its tiles and the wgmma kernels
    against the Triton ones (``tuning.long_enough``: ``tuning.TUNE_FROM`` pairs, on a GPU)."""
    return tuning.long_enough(nq, nk)


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
    allow) and the tiles of their forward, dK/dV and dQ kernels, cached; ``"wgmma"``: the wgmma
    forward's tile when it serves the forward instead (again when the strides allow), else None.
    Whether the one-pass backward serves is ``backward_plan``'s, made at the first backward.
    ``tma=False`` asks for stage 9's plan, for a call whose strides no descriptor can read.

    Short sequences take each table's first entry (the interpreter's tile on the CPU), as
    stage 9 does; where ``timed`` (long heads, or much work in all, on a GPU), what the
    autotuners pick for this shape, timed once.
    """
    key = ((b, hq, hkv, nq, nk, d), dtype, device, causal, window, sink_tokens, has_sinks)
    plan = _plans.get((key, KERNELS, tma))
    if plan is None:
        use_tma = tma and _tma_shape(d, dtype, device)
        pad = _pow2(d)
        if timed(b, hq, nq, nk):
            plan = _tuned(key, use_tma)
        elif use_tma:
            plan = {"tma": True,
                    "forward": _tile(tuning.first_entry(tma_forward.TMA_TILES, pad, tma_forward.INTERPRETER_TILE)),
                    "dkdv": _tile(tuning.first_entry(tma_backward.DKDV_TILES, pad,
                                                     tma_backward.DKDV_INTERPRETER_TILE)),
                    "dq": _tile(tuning.first_entry(tma_backward.DQ_TILES, pad, tma_backward.DQ_INTERPRETER_TILE))}
        else:
            plan = {"tma": False,
                    "forward": _tile(tuning.first_entry(tuning.FORWARD_TILES, pad, tuning.FORWARD_INTERPRETER_TILE)),
                    "dkdv": _tile(tuning.first_entry(s9.DKDV_TILES, pad, s9.DKDV_INTERPRETER_TILE)),
                    "dq": _tile(tuning.first_entry(s9.DQ_TILES, pad, s9.DQ_INTERPRETER_TILE))}
        plan["wgmma"] = None
        if tma and _wgmma_shape(b, hq, d, dtype, device) and (KERNELS == "wgmma" or long_heads(nq, nk)):
            plan = _wgmma_plan(key, plan, timed=KERNELS != "wgmma")
        _plans[(key, KERNELS, tma)] = plan
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
