"""The kernels' launches: the forward and backward bodies that both the ops and the eager path run,
and the compiled kernels the eager path keeps.

Tensors arrive as (B, H, N, D), or as (B, N, H, D) with ``bnhd``, with any strides; window 0 means
no window.  Each body launches the TMA kernels where the plan and the strides allow, else stage
9's; the forward may be the wgmma kernel instead, and the backward the one-pass wgmma kernel
(``plans``).  ``launch(kernel)`` is
:func:`op_launch` inside the ops (``wrap_triton``, so that torch.compile sees the kernel, with
the TMA kernels' host-made descriptors passed into the graph), and in eager mode the kernel
itself or :class:`_Launch`.  The wgmma kernels are CUDA, not Triton: eager calls run them
through ctypes, and the ops through ops of their own (library.py), opaque to the compiler.
"""

from __future__ import annotations

import os

from kernels import runtime, tuning

import torch
import triton  # after kernels.runtime: it decides TRITON_INTERPRET
from torch.library import wrap_triton

from . import plans
from .native import NOT_REPLAYED, Descriptor, HostCall, Pointer
from .plans import _bhnd, _cdiv, _plan_for, _pow2, s9, tma_backward, tma_forward, tma_strides, wgmma, wgmma_backward

# =============================================================================================
# The outputs, allocated the same way by the ops and by their fake implementations, so that
# shapes, dtypes and strides agree between the two (opcheck compares them).
# =============================================================================================

def _forward_outputs(q, bnhd: bool = False):
    o = torch.empty_like(q)                  # q's shape and strides: a (B, N, H, D) view stays one
    b, hq, nq, _ = _bhnd(q, bnhd)[0]
    lse = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32)          # (B, Hq, Nq)
    return o, lse


def _backward_outputs(q, k, v):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# =============================================================================================
# Launching a kernel.
# =============================================================================================

def _direct(kernel):
    """Launch a kernel as it is (the ops pass ``wrap_triton`` instead)."""
    return kernel


# Triton binds and specializes every argument of a JIT kernel on every launch, in Python, and at
# small sizes that host time exceeds the kernel's GPU time.  An eager call whose tensors agree in
# everything Triton specializes on (shapes, strides, dtypes, 16-byte alignment, the options)
# launches the very same compiled kernels, so the eager path keeps them per such call key and
# launches them through their own launcher, launch hooks (a profiler's) included.  Off the GPU
# (Triton's interpreter) every launch goes through Triton as usual.
DIRECT_LAUNCH = True
_compiled: dict[tuple, tuple] = {}


def _call_key(*tensors) -> tuple:
    """What Triton specializes a call's tensor arguments on: shape, strides, dtype, device and
    16-byte alignment (a tensor's absence too).  Fresh outputs follow from their inputs."""
    return tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)
                 for t in tensors)


class _Launch:
    """``launch(kernel)[grid](*args, **meta)`` as Triton spells it, through the kept compiled
    kernel when ``key`` has been seen, else through Triton, keeping what it compiled.  With a
    ``record`` list, each launch also appends ``(compiled kernel, grid, every parameter's value)``
    to it, for native.py, a tensor as its address (``native.Pointer``)."""
    __slots__ = ("key", "kernel", "record")

    def __init__(self, key: tuple, record: list | None = None):
        self.key = key
        self.record = record

    def __call__(self, kernel):
        self.kernel = kernel
        return self

    def __getitem__(self, grid):
        kernel, key = self.kernel, self.key

        def run(*args, **meta):
            hit = _compiled.get((id(kernel), key))
            if hit is not None:                         # what Triton's own launch does, once bound
                compiled, device, tail = hit
                stream = torch._C._cuda_getCurrentRawStream(device)
                hooks = triton.knobs.runtime
                compiled.run(*grid, *(1,) * (3 - len(grid)), stream, compiled.function, compiled.packed_metadata,
                             compiled.launch_metadata(grid, stream, *args, *tail),
                             hooks.launch_enter_hook, hooks.launch_exit_hook, *args, *tail)
            else:
                compiled = kernel[grid](*args, **meta)
                params = list(kernel.signature.parameters.values())[len(args):]
                tail = tuple(meta[p.name] if p.name in meta else p.default for p in params)
                _compiled[(id(kernel), key)] = (compiled, torch.cuda.current_device(), tail)
            if self.record is not None:                 # addresses, not tensors: no reference cycle through o
                self.record.append((compiled, grid, tuple(_recorded(a) for a in (*args, *tail))))
        return run


def _recorded(arg):
    """A launch argument as native.py is given it: a tensor as its address, a host-made descriptor
    as what it describes (a ``native.Descriptor``), anything else as it is."""
    if isinstance(arg, torch.Tensor):
        return Pointer(arg.data_ptr())
    if hasattr(arg, "block_shape") and hasattr(arg, "base"):          # triton.tools' TensorDescriptor
        return Descriptor(arg)
    return arg


def _host_descriptors(launch) -> bool:
    """Whether a launch may take TMA descriptors made on the host: an eager one (the kernel itself
    or :class:`_Launch`), or the ops' :func:`op_launch` where this torch can put descriptors in a
    traced graph.  A host descriptor handed to plain ``wrap_triton`` gave wrong results under
    ``torch.compile``; without that support the kernels make their own."""
    return launch is _direct or isinstance(launch, _Launch) or (launch is op_launch and _graph_descriptors())


# Inside the ops a kernel is launched through ``wrap_triton``.  Traced (torch.compile), that
# records the launch in the graph as the higher-order op ``triton_kernel_wrapper_mutation``, but a
# host-made descriptor among its arguments is kept as a constant, with the traced call's addresses:
# torch's tracing outside Dynamo does not capture descriptors.  The same higher-order op takes
# ``tma_descriptor_metadata`` ({argument: ("stable", (tile,))}), which Dynamo fills for
# descriptors it sees made; with it, the argument in the graph is the tensor the descriptor
# describes, and the graph makes the descriptor when it runs, over the buffer it has then
# (Inductor's wrapper code calls ``TensorDescriptor.from_tensor``).  ``op_launch`` fills it for
# the descriptors launch.py makes.  It leans on torch's private tracing classes, so it is used only
# where they are found as expected, and the kernels make their own descriptors elsewhere, or where
# ``WORKBOOK_GRAPH_DESCRIPTORS=0`` asks for that (read at the first traced launch).

def _graph_descriptors() -> bool:
    """Whether this torch's tracing of ``wrap_triton`` can carry descriptors as described above."""
    global _GRAPH_DESCRIPTORS
    if _GRAPH_DESCRIPTORS is None and os.environ.get("WORKBOOK_GRAPH_DESCRIPTORS", "1") == "0":
        _GRAPH_DESCRIPTORS = False
    if _GRAPH_DESCRIPTORS is None:
        try:
            from torch._higher_order_ops import triton_kernel_wrap as wrap
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
            found = all(hasattr(wrap, name) for name in (
                "TracingTritonHOPifier", "TraceableTritonKernelWrapper", "triton_kernel_wrapper_mutation"))
            found = found and hasattr(wrap.TracingTritonHOPifier, "store_non_graphable_args")
            found = found and wrap.maybe_unpack_tma_stable_metadata(("stable", ([1],))) == ([1],)
            # Where torch takes the device for one without host descriptors, its analysis of what a
            # kernel writes counts a descriptor as one argument, not the 1 + 2 x rank the compiled
            # kernel takes, misreads every later argument and finds no writes (the graph would
            # then drop the forward): only where it counts them right.
            from torch.utils._triton import has_triton_tensor_descriptor_host_tma
            _GRAPH_DESCRIPTORS = found and has_triton_tensor_descriptor_host_tma()
        except (ImportError, AttributeError, TypeError):
            _GRAPH_DESCRIPTORS = False
    return _GRAPH_DESCRIPTORS


_GRAPH_DESCRIPTORS: bool | None = None


def _described(desc) -> torch.Tensor:
    """The tensor a host-made descriptor describes, of which ``TensorDescriptor.from_tensor`` gives
    the descriptor back.  Inside the ops every descriptor spans its tensor with the tensor's own
    shape and strides ((B, H, N, D) views, lse and delta as rows), so the tensor itself goes into
    the graph: no view is added (an ``as_strided`` would leave its storage offset to Inductor)."""
    base = desc.base
    if list(base.shape) != list(desc.shape) or list(base.stride()) != list(desc.strides):
        raise RuntimeError(f"a descriptor of shape {list(desc.shape)} and strides {list(desc.strides)} over a tensor "
                           f"of shape {list(base.shape)} and strides {list(base.stride())}: inside the ops a "
                           "descriptor must span its tensor as it is")
    return base


def op_launch(kernel):
    """``launch`` inside the ops: ``wrap_triton(kernel)``, which passes host-made descriptors
    into a traced graph as their tensors and tiles (see above).  Run eagerly, outside any
    tracing, the kernel is launched as it is, descriptors and all."""
    from torch._library.triton import is_wrap_triton_enabled
    if not is_wrap_triton_enabled():
        return kernel
    return _OpLaunch(kernel)


class _OpLaunch:
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def run(*args, **meta):
            from triton.tools.tensor_descriptor import TensorDescriptor
            names = self.kernel.arg_names
            found = {names[i]: a for i, a in enumerate(args) if isinstance(a, TensorDescriptor)}
            found.update((name, a) for name, a in meta.items() if isinstance(a, TensorDescriptor))
            if not found:
                return wrap_triton(self.kernel)[grid](*args, **meta)
            args = tuple(_described(a) if isinstance(a, TensorDescriptor) else a for a in args)
            meta = {name: _described(a) if isinstance(a, TensorDescriptor) else a for name, a in meta.items()}
            tiles = {name: ("stable", (list(desc.block_shape),)) for name, desc in found.items()}
            from torch._higher_order_ops import triton_kernel_wrap as wrap
            variable = wrap.TraceableTritonKernelWrapper(self.kernel, None, grid)
            return _hopifier(tiles).call_triton_kernel(variable, args, meta, None)
        return run


def _hopifier(tiles: dict):
    """torch's tracing of ``wrap_triton`` with ``tiles`` as the launch's descriptor metadata."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    class DescriptorHOPifier(wrap.TracingTritonHOPifier):
        def call_HOP(self, variable, grids, combined_args, tx):
            graphable, constant_args_idx = self.store_non_graphable_args(combined_args)
            return wrap.triton_kernel_wrapper_mutation(kernel_idx=variable.kernel_idx,
                                                       constant_args_idx=constant_args_idx, grid=grids,
                                                       tma_descriptor_metadata=tiles, kwargs=graphable)
    return DescriptorHOPifier()


def _launcher(key: tuple, record: list | None = None):
    """``launch`` for :func:`_forward` and :func:`_backward` in eager mode (``record``: see _Launch)."""
    if not DIRECT_LAUNCH or not runtime.ON_GPU or not hasattr(triton, "knobs"):
        return _direct
    return _Launch(key, record)


# =============================================================================================
# The forward and the backward.
# =============================================================================================

_chosen: dict[tuple, tuple[dict, bool, tuple | None]] = {}


def _choose(q, k, v, sinks, causal: bool, window: int, sink_tokens: int, bnhd: bool,
            key: tuple | None) -> tuple[dict, bool, tuple | None]:
    """``(plan, tma, wgmma)``: the call's launch plan, whether its TMA kernels can read q, k and v
    where they lie (the forward's o is allocated like q; the backward copies a dO they cannot
    read), and the wgmma forward's tile when the plan takes it and it can read them (else None); a
    call whose strides no descriptor can read gets stage 9's plan.  An eager call passes its call
    key, which holds everything this depends on but ``plans.KERNELS`` (shapes, strides,
    alignment, options), and the answer is kept under both."""
    key = (key, plans.KERNELS) if key is not None else None
    chosen = _chosen.get(key) if key is not None else None
    if chosen is None:
        plan = _plan_for(q, k, causal, window, sink_tokens, sinks is not None, bnhd)
        readable = (plan["tma"] or plan["wgmma"] is not None) and tma_strides(q, k, v)
        if (plan["tma"] or plan["wgmma"] is not None) and not readable:
            plan = _plan_for(q, k, causal, window, sink_tokens, sinks is not None, bnhd, tma=False)
        chosen = (plan, plan["tma"] and readable, plan["wgmma"] if readable else None)
        if key is not None:
            _chosen[key] = chosen
    return chosen


def _wgmma_forward(q, k, v, o, lse, sinks, causal: bool, window: int, sink_tokens: int, scale: float,
                   tile: tuple, bnhd: bool = False, record: list | None = None) -> None:
    """Stage 4's wgmma kernel (solutions/fast_variable_block_wgmma.cu) writing o and lse, every
    tensor read where it lies through its strides; ``record`` (native.py) receives the call as a
    :class:`native.HostCall`."""
    (b, hq, nq, d), q_strides = _bhnd(q, bnhd)
    (_, hkv, nk, _), k_strides = _bhnd(k, bnhd)
    strides = (*q_strides[:3], *k_strides[:3], *_bhnd(v, bnhd)[1][:3], *_bhnd(o, bnhd)[1][:3])
    lib = wgmma.library(d, *tile)
    args = wgmma.forward_args(q, k, v, o, lse, strides, (b, hq, hkv, nq, nk, d), scale, causal, window, sink_tokens,
                              sinks)
    if nq and b * hq:
        wgmma.call(lib, args, torch._C._cuda_getCurrentRawStream(q.device.index))
    if record is not None:
        record.append(HostCall(lib, args))


def _forward(q, k, v, sinks, causal: bool, window: int, sink_tokens: int, scale: float, launch=_direct,
             bnhd: bool = False, key: tuple | None = None, wgmma_op=None, use_wgmma: bool = True):
    """``(o, lse)``: o like q (same strides, so a (B, N, H, D) q gives a (B, N, H, D) o), lse
    (B, Hq, Nq) float32.  ``launch(kernel)`` is ``wrap_triton`` inside the op, so that
    torch.compile sees the kernel, and the kernel itself in eager mode.  Tensors are (B, H, N, D),
    or (B, N, H, D) with ``bnhd``.  The wgmma forward where the plan and the strides allow it
    (inside the op, through ``wgmma_op``, the op that runs it), else the TMA forward where they
    allow it, else stage 9's; ``key``, an eager call's, keeps that choice (``_choose``);
    ``use_wgmma=False`` leaves the wgmma forward out."""
    (b, hq, nq, d), q_strides = _bhnd(q, bnhd)
    (_, hkv, nk, _), k_strides = _bhnd(k, bnhd)
    plan, tma, wgmma_tile = _choose(q, k, v, sinks, causal, window, sink_tokens, bnhd, key)
    if wgmma_tile is not None and use_wgmma:
        if wgmma_op is not None:
            return wgmma_op(q, k, v, sinks, causal, window, sink_tokens, scale)
        o, lse = _forward_outputs(q, bnhd)
        _wgmma_forward(q, k, v, o, lse, sinks, causal, window, sink_tokens, scale, wgmma_tile, bnhd,
                       getattr(launch, "record", None))
        return o, lse
    tile = plan["forward"]
    o, lse = _forward_outputs(q, bnhd)
    if tma:
        runtime.tma_scratch()                               # the descriptors a kernel makes live there
        pack = tuning.gqa_pack(hq // hkv)
        sink_tokens = sink_tokens if window > 0 else 0      # without a window every earlier key is seen
        v_strides = _bhnd(v, bnhd)[1]
        made = _host_descriptors(launch) and tma_forward.kv_descriptors(k, v, (b, hkv, nk, d), k_strides, v_strides,
                                                                        tile["BLOCK_N"])
        launch(tma_forward._tma_forward_kernel.fn)[(_cdiv(nq, tile["BLOCK_M"] // pack), b * hq // pack)](
            q, *(made or (k, v)), o, lse, sinks if sinks is not None else lse,
            *q_strides[:3], *k_strides[:3], *v_strides[:3], *_bhnd(o, bnhd)[1][:3],
            b, hq, hq // hkv, nq, nk, window, sink_tokens, scale * s9.LOG2E,
            CAUSAL=causal, HAS_WINDOW=window > 0, HAS_SINK_TOKENS=sink_tokens > 0, HAS_SINKS=sinks is not None,
            PACK=pack, HEAD_DIM_PAD=d, ONE_LOOP=tma_forward.one_loop(window), HOST_DESC=bool(made), **tile)
        return o, lse
    launch(s9.flash_forward_kernel.fn)[(_cdiv(nq, tile["BLOCK_M"]), b * hq)](
        q, k, v, o, lse, sinks if sinks is not None else lse, lse,          # lse stands in for unused pointers
        *q_strides, *k_strides, *_bhnd(v, bnhd)[1], *_bhnd(o, bnhd)[1],
        hq, hq // hkv, nq, nk, d, window, sink_tokens, scale * s9.LOG2E,
        CAUSAL=causal, HAS_WINDOW=window > 0, HAS_SINKS=sinks is not None, COUNT_VISITS=False,
        HEAD_DIM_PAD=_pow2(d), **tile)
    return o, lse


def _backward(q, k, v, o, lse, do, sinks, causal: bool, window: int, sink_tokens: int, scale: float,
              launch=_direct, bnhd: bool = False, dsinks_wanted: bool = True, key: tuple | None = None,
              keep: dict | None = None, wgmma_op=None):
    """``(dq, dk, dv, dsinks)``, each like its input; dsinks float32 (Hq,), None without sinks or
    when not ``dsinks_wanted`` (its reduction is a launch of its own, skipped when nobody asks).
    The one-pass wgmma backward where the plan and the strides allow it and no deterministic
    algorithms are asked for (inside the op, through ``wgmma_op``, the op that runs it), else the
    TMA dK/dV and dQ kernels where they allow them, else stage 9's; the first kernel (delta and
    dsinks) is stage 9's either way.  Only q, k and v's strides choose: a dO no descriptor can
    read is copied.  ``keep``, a dict, receives the buffers allocated on the way
    (``delta``, ``dsinks_part``), for native.py."""
    (b, hq, nq, d), q_strides = _bhnd(q, bnhd)
    (_, hkv, nk, _), k_strides = _bhnd(k, bnhd)
    v_strides, o_strides, do_strides = (_bhnd(t, bnhd)[1] for t in (v, o, do))
    # A dO that no descriptor can read (a .sum()'s has stride 0) is copied where the TMA kernels
    # serve q, k and v: they are faster than stage 9's, and the call then gives the bits that a
    # compiled graph (whose dO is contiguous) and native.py (which copies it as o) give.
    plan, tma, _ = _choose(q, k, v, sinks, causal, window, sink_tokens, bnhd, key)
    if tma and not tma_strides(do):
        do = tma_forward.tma_ready(do)
        do_strides = _bhnd(do, bnhd)[1]
    # dQ's additions in the one pass have no fixed order: its results vary in the last bits.
    one_pass = tma and not torch.are_deterministic_algorithms_enabled() and plans.backward_plan(
        *(int(x) for x in (b, hq, hkv, nq, nk, d)), q.dtype, q.device, causal, window, sink_tokens,
        sinks is not None)["wgmma_backward"]
    if one_pass and wgmma_op is not None:
        return wgmma_op(q, k, v, o, lse, do, sinks, causal, window, sink_tokens, scale)
    pad = _pow2(d)
    flags = dict(CAUSAL=causal, HAS_WINDOW=window > 0, HEAD_DIM_PAD=pad, COUNT_VISITS=False)

    # 1. delta = rowsum(dO * O) per query row, and each query block's share of dsinks.
    pre_m = s9.PREPROCESS_BLOCK_M
    delta = torch.empty(b, hq, nq, device=q.device, dtype=torch.float32)       # (B, Hq, Nq)
    dsinks_part = torch.empty(b, hq, _cdiv(nq, pre_m), device=q.device, dtype=torch.float32)
    launch(s9.bwd_preprocess_kernel)[(_cdiv(nq, pre_m), b * hq)](
        o, do, lse, delta, sinks if sinks is not None else delta, dsinks_part,
        *o_strides, *do_strides, hq, nq, d,
        BLOCK_M=pre_m, HEAD_DIM_PAD=pad, HAS_SINKS=sinks is not None)
    dsinks = dsinks_part.sum(dim=(0, 2)) if sinks is not None and dsinks_wanted else None
    if keep is not None:
        keep.update(delta=delta, dsinks_part=dsinks_part)

    dq, dk, dv = _backward_outputs(q, k, v)
    if one_pass:
        _wgmma_backward(q, k, v, lse, do, delta, dq, dk, dv, causal, window, sink_tokens, scale, bnhd)
        if getattr(launch, "record", None) is not None:
            launch.record.append(NOT_REPLAYED)
        return dq, dk, dv, dsinks
    if tma:
        _tma_backward(q, k, v, do, lse, delta, dq, dk, dv, plan, causal, window, sink_tokens, scale, launch, bnhd)
        return dq, dk, dv, dsinks

    # 2. dK and dV: one program per (key block, batch x KV head).
    tile = plan["dkdv"]
    launch(s9.bwd_dkdv_kernel.fn)[(_cdiv(nk, tile["BLOCK_N"]), b * hkv)](
        q, k, v, do, dk, dv, lse, delta, delta,
        *q_strides, *k_strides, *v_strides, *do_strides, *_bhnd(dk, bnhd)[1], *_bhnd(dv, bnhd)[1],
        hq, hkv, hq // hkv, nq, nk, d, window, sink_tokens, scale, scale * s9.LOG2E, **flags, **tile)

    # 3. dQ: one program per (query block, batch x query head).
    tile = plan["dq"]
    launch(s9.bwd_dq_kernel.fn)[(_cdiv(nq, tile["BLOCK_M"]), b * hq)](
        q, k, v, do, dq, lse, delta, delta,
        *q_strides, *k_strides, *v_strides, *do_strides, *_bhnd(dq, bnhd)[1],
        hq, hq // hkv, nq, nk, d, window, sink_tokens, scale, scale * s9.LOG2E, **flags, **tile)
    return dq, dk, dv, dsinks


def _wgmma_backward(q, k, v, lse, do, delta, dq, dk, dv, causal, window, sink_tokens, scale, bnhd) -> None:
    """The one-pass wgmma backward (solutions/fast_backward_wgmma.cu) writing dq, dk and dv where
    they lie, from delta of stage 9's preprocess: dQ goes through a float32 buffer in the kernel's
    fragment order and the library's second kernel puts it back in dq's rows."""
    (b, hq, nq, d), q_strides = _bhnd(q, bnhd)
    (_, hkv, nk, _), k_strides = _bhnd(k, bnhd)
    strides = (*q_strides[:3], *k_strides[:3], *_bhnd(v, bnhd)[1][:3], *_bhnd(do, bnhd)[1][:3],
               *_bhnd(dk, bnhd)[1][:3], *_bhnd(dv, bnhd)[1][:3])
    dq32 = torch.empty(b, hq, nq, d, device=q.device, dtype=torch.float32)
    lib = wgmma_backward.library(d)
    order = wgmma_backward.order_for(b, hkv, nk, causal, q.device)
    lse = wgmma_backward.contiguous_rows(lse)          # held until the kernel is queued
    args = wgmma_backward.backward_args(q, k, v, do, lse, delta, dq32, dk, dv, strides, (b, hq, hkv, nq, nk, d),
                                        scale, causal, window, sink_tokens, order)
    stream = torch._C._cuda_getCurrentRawStream(q.device.index)
    wgmma_backward.call(lib, args, stream)
    wgmma_backward.rows(lib, dq32, dq.transpose(1, 2) if bnhd else dq, scale, stream)


def _tma_backward(q, k, v, do, lse, delta, dq, dk, dv, plan, causal, window, sink_tokens, scale, launch, bnhd):
    """The TMA dK/dV and dQ kernels (solutions/fast_backward_tma.py), writing dq, dk and dv."""
    runtime.tma_scratch()
    (b, hq, nq, d), q_strides = _bhnd(q, bnhd)
    (_, hkv, nk, _), k_strides = _bhnd(k, bnhd)
    v_strides, do_strides = _bhnd(v, bnhd)[1][:3], _bhnd(do, bnhd)[1][:3]
    q_strides, k_strides = q_strides[:3], k_strides[:3]
    group, pack = hq // hkv, tuning.gqa_pack(hq // hkv)
    sink_tokens = sink_tokens if window > 0 else 0
    flags = dict(CAUSAL=causal, HAS_WINDOW=window > 0, HEAD_DIM_PAD=d)
    # The dK/dV kernel reads lse and delta through descriptors, whose rows must start on 16 bytes:
    # the TMA backward's _stat_rows copies them into padded rows when Nq is not a multiple of 4 or
    # a caller's lse starts elsewhere.
    lse_rows, delta_rows = (tma_backward._stat_rows(x, b * hq, nq) for x in (lse, delta))
    host = _host_descriptors(launch)
    tile = plan["dkdv"]
    made = host and tma_backward.dkdv_descriptors(q, do, lse_rows, delta_rows, (b, hq, nq, d), q_strides + (1,),
                                                  do_strides + (1,), tile["BLOCK_M"])
    launch(tma_backward._tma_dkdv_kernel.fn)[(_cdiv(nk, tile["BLOCK_N"]), b * hkv)](
        *(made or (q, do, lse_rows, delta_rows)), k, v, dk, dv, *q_strides, *do_strides, lse_rows.stride(-2),
        *k_strides, *v_strides, *_bhnd(dk, bnhd)[1][:3], *_bhnd(dv, bnhd)[1][:3],
        b, hq, hkv, group, nq, nk, window, sink_tokens, scale, scale * s9.LOG2E, HOST_DESC=bool(made), **flags,
        **tile)
    tile = plan["dq"]
    made = host and tma_forward.kv_descriptors(k, v, (b, hkv, nk, d), k_strides + (1,), v_strides + (1,),
                                               tile["BLOCK_N"])
    launch(tma_backward._tma_dq_kernel.fn)[(_cdiv(nq, tile["BLOCK_M"] // pack), b * hq // pack)](
        *(made or (k, v)), q, do, dq, lse, delta, *k_strides, *v_strides, *q_strides, *do_strides,
        *_bhnd(dq, bnhd)[1][:3], b, hq, group, nq, nk, window, sink_tokens, scale, scale * s9.LOG2E, PACK=pack,
        HOST_DESC=bool(made), **flags, **tile)
