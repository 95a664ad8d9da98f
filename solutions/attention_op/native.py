"""Eager calls repeated in C++ (native.cpp): the host time of an eager call close to SDPA's.

The Python path (api.py, launch.py) spends its host time on rebuilding each launch's arguments,
on Triton's Python launcher, and on a Python ``autograd.Function``.  None of that changes between
two calls with the same call key (every tensor's sizes, strides, dtype, device and 16-byte
alignment, and the options), so a key's call is recorded once (``_Launch.record``) and native.cpp
is given what it did: the buffers it allocated and every launch, each argument a buffer or a
constant.  A call without a gradient is recorded as it runs; one with a gradient at its first
backward.  Later calls of that key are one call into C++, which allocates, launches the same
compiled kernels on the current stream and, when a gradient is wanted, makes one C++ autograd node
whose backward replays the recorded backward (a dO, or a tensor a saved-tensor hook gives back,
in another layout than recorded is copied into the recorded one first).  The kernels and their
arguments are the Python path's, so are the results (tests/test_attention_native.py compares
the bits).

The Python path runs as before:

* until the extension is built.  It is built on the first eager call on a CUDA GPU, in a
  background thread (torch.utils.cpp_extension, kept in the user's cache), and used once loaded;
  ``build(wait=True)`` waits for it.  ``WORKBOOK_NATIVE=0`` turns it off.
* on a Triton whose launch convention native.cpp was not written for (``TRITONS``);
* while a Triton launch hook is set (a profiler's): C++ launches would not call it;
* for a key whose launches cannot be described: a pointer argument that is none of the call's
  buffers (the TMA backward's padded copy of lse when Nq is not a multiple of 4), or a backward
  through the one-pass wgmma kernel (``NOT_REPLAYED``: its dQ goes through a buffer and a PyTorch
  kernel that native.cpp does not repeat).  Such a key is recorded as the Python path's and not
  tried again;
* for a call two of whose tensors start at one address (k passed as v): which is which could not
  be told from the launches, so it is not recorded (a later call of its key may be);
* under ``torch.compile``, fake tensors or a dispatch mode (api.py sends those to the ops), and
  for arguments of a type only the Python path judges (a bool as the window, say).

``counts()`` says how many keys have plans and how many calls ran in C++ (the tests use it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
from pathlib import Path

import torch

#: Triton releases whose launcher native.cpp repeats: every non-constexpr argument in order, then
#: the global and the profile scratch pointers (triton/backends/nvidia/driver.py).
TRITONS = ("3.6",)
SOURCE = Path(__file__).with_name("native.cpp")

_module = None                  # the built extension, once loaded
_started = False                # build() has decided, once per process
_thread: threading.Thread | None = None
_failure: str | None = None     # why the build failed, if it did


def enabled() -> bool:
    """Whether the C++ path may be used at all: a CUDA GPU, a known Triton, not switched off."""
    from kernels import runtime
    if os.environ.get("WORKBOOK_NATIVE", "1") == "0" or not runtime.ON_GPU:
        return False
    import triton
    return ".".join(triton.__version__.split(".")[:2]) in TRITONS


_off = 0                        # inside off(): the Python path only


def module():
    """The loaded extension, or None (not built yet, switched off, inside ``off()``, or failed:
    see ``failure()``)."""
    return None if _off else _module


@contextlib.contextmanager
def off():
    """Calls inside take the Python path and record nothing (the tests and the host bench compare
    the two paths with it)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def failure() -> str | None:
    """The build's error, when it failed."""
    return _failure


def _build() -> None:
    global _module, _failure
    try:
        from kernels import cuda_build

        from torch.utils.cpp_extension import load
        text = SOURCE.read_text()
        digest = hashlib.sha256("\n".join([text, torch.__version__]).encode()).hexdigest()[:16]
        name = f"attention_op_native_{digest}"
        build_dir = cuda_build.cache_dir() / name
        copy = cuda_build.stable_source(build_dir, "native.cpp", text)
        _module = load(name=name, sources=[str(copy)], build_directory=str(build_dir), with_cuda=True,
                       extra_cflags=["-O2"], verbose=False)
    except Exception as error:                     # noqa: BLE001 - any failure leaves the Python path
        _failure = f"{type(error).__name__}: {error}"


def build(*, wait: bool = False, timeout: float = 1200):
    """Start building the extension (once per process) if ``enabled()``; with ``wait``, return it
    when built (None if the build failed, took longer than ``timeout`` seconds, or the path is off)."""
    global _thread, _started
    if not _started and not _off:
        _started = True
        if enabled():
            _thread = threading.Thread(target=_build, name="attention_op native build", daemon=True)
            _thread.start()
    if wait and _thread is not None:
        _thread.join(timeout)
    return module()


def counts() -> dict:
    """Keys with plans and calls run in C++ so far (``keys``, ``native_keys``, ``forward_runs``,
    ``backward_runs``, ``do_copies``): ``{}`` without the extension."""
    return dict(_module.counts()) if _module is not None else {}


def clear() -> None:
    """Forget every plan (a test, or after ``plans.KERNELS`` changes meaning)."""
    if _module is not None:
        _module.clear()


# =============================================================================================
# Describing what the Python path launched, in native.cpp's terms.
# =============================================================================================

BUFFER, INT32, INT64, FLOAT32, INT8, NULL, TENSOR_MAP = range(7)    # native.cpp's Kind
_alive: dict[int, object] = {}                      # every compiled kernel a plan launches
_INTS = {"i32": INT32, "u32": INT32, "i64": INT64, "u64": INT64, "i1": INT8, "u1": INT8, "i8": INT8, "u8": INT8}


def _float_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


#: What launch.py records for a part of a call that native.cpp cannot repeat: the key stays on the Python path.
NOT_REPLAYED = object()


class Pointer(int):
    """A tensor argument of a recorded launch, as the address Triton passes (launch.py keeps no tensor)."""


class Descriptor:
    """A TMA descriptor argument made on the host (Triton's ``TensorDescriptor``), as launch.py
    records it: its tensor's address and what it says of it.  native.cpp makes it again over the
    buffer at that address on every call."""
    __slots__ = ("base", "shape", "strides", "block_shape", "padding")

    def __init__(self, descriptor):
        self.base = Pointer(descriptor.base.data_ptr())
        self.shape, self.strides = tuple(descriptor.shape), tuple(descriptor.strides)
        self.block_shape, self.padding = tuple(descriptor.block_shape), descriptor.padding


def _tensor_map(value, meta) -> list | None:
    """native.cpp's MapSpec of a recorded :class:`Descriptor` (without its buffer), with the tile,
    swizzle and element type the kernel was compiled for (``meta``, one entry of the compiled
    kernel's ``tensordesc_meta``), as Triton's launcher passes them; None where the kernel takes
    the descriptor in another form (no ``meta``: lowered without a TMA descriptor) or as fp4."""
    if not isinstance(value, Descriptor) or not isinstance(meta, dict) or meta.get("fp4_padded"):
        return None
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    rank, tile = len(value.shape), list(meta["block_size"])
    if len(tile) != rank or len(value.strides) != rank or value.padding not in ("zero", "nan"):
        return None
    return [int(meta["swizzle"]), int(meta["elem_size"]), TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
            int(value.padding == "nan"), rank, *tile, *value.shape, *value.strides]


class HostCall:
    """A recorded call of the wgmma kernel's host function, ``stage4w_forward`` of ``lib``, with its
    arguments as launch.py passed them (``forward_args`` of solutions/fast_variable_block_wgmma.py:
    tensors as addresses, the strides as a tuple, sinks as an address or None).  native.cpp calls
    the same function with the same arguments, the buffers' addresses of the call that repeats it
    in their place: its tensor maps hold addresses, so they are made on every call, by that
    function."""
    __slots__ = ("lib", "args")

    def __init__(self, lib, args: tuple):
        self.lib, self.args = lib, args


def _host_call(call: HostCall, buffers: list) -> tuple | None:
    """native.cpp's description of a :class:`HostCall`: the function and its error-string function
    as addresses, and the arguments in the order native.cpp's ``HostForward`` takes them."""
    import ctypes
    q, k, v, o, lse, strides, *ints, sinks = call.args
    described = []
    for value in (q, k, v, o, lse):
        index = _buffer_index(Pointer(value), buffers)
        if index is None:
            return None
        described.append((BUFFER, index))
    described += [(INT64, int(s)) for s in strides]
    b, hq, hkv, nq, nk, d, scale, dtype, causal, window, sink_tokens = ints
    described += [(INT32, int(x)) for x in (b, hq, hkv, nq, nk, d)]
    described.append((FLOAT32, _float_bits(scale)))
    described += [(INT32, int(x)) for x in (dtype, causal, window, sink_tokens)]
    if sinks is None:
        described.append((NULL, 0))
    else:
        index = _buffer_index(Pointer(sinks), buffers)
        if index is None:
            return None
        described.append((BUFFER, index))
    _alive[id(call.lib)] = call.lib                     # the library stays loaded while C++ holds its functions
    address = ctypes.cast(call.lib.stage4w_forward, ctypes.c_void_p).value
    error = ctypes.cast(call.lib.stage4w_error_string, ctypes.c_void_p).value
    grid = [nq and b * hq and 1, 1, 1]                  # 0: nothing to launch (Nq = 0), as the Python path
    return (address, grid, 0, 0, 0, described, error, [])


def _buffer_index(value, buffers: list) -> int | None:
    """The buffer whose data starts where ``value``'s does (a view of lse is lse), or None."""
    if isinstance(value, torch.Tensor):
        value = Pointer(value.data_ptr())
    if not isinstance(value, Pointer):
        return None
    found = [i for i, b in enumerate(buffers) if b is not None and b.data_ptr() == value]
    return found[0] if found else None                  # one at most: describe_part refuses shared addresses


def describe_part(record: list, buffers: list, inputs: int, outputs: list) -> tuple | None:
    """``(inputs, allocations, launches, outputs)`` for native.cpp's ``record``, or None when a
    launch cannot be repeated from buffers and constants.

    ``record`` holds ``(compiled kernel, grid, arguments)`` per Triton launch, every parameter's
    value in order (constexprs too; a host-made TMA descriptor as a :class:`Descriptor`, which
    Triton's launcher passes as the descriptor, its shape and its strides), and a
    :class:`HostCall` per call of the wgmma kernel;
    ``buffers`` the call's tensors (``inputs`` of them, None for an absent one) and then what the
    body allocated; ``outputs`` the buffers returned.
    """
    present = [b for b in buffers if b is not None]
    if len({b.data_ptr() for b in present}) != len(present):
        return None                                         # two roles at one address: which is which?
    launches = []
    for entry in record:
        if entry is NOT_REPLAYED:
            return None
        if isinstance(entry, HostCall):
            launch = _host_call(entry, buffers)
            if launch is None:
                return None
            launches.append(launch)
            continue
        compiled, grid, args = entry
        meta = compiled.metadata
        if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False)
                or getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "profile_scratch_size", 0)
                or getattr(meta, "global_scratch_align", 1) > 256):     # native.cpp places scratch on 256 bytes
            return None
        signature = list(compiled.src.signature.values())
        if len(signature) != len(args) or compiled.function is None:
            return None
        described, maps = [], []
        metas = list(getattr(meta, "tensordesc_meta", None) or [])
        for kind, value in zip(signature, args):
            if kind == "constexpr":
                continue
            if not isinstance(kind, str):
                return None                                 # a tuple argument: none of ours
            if kind.startswith("tensordesc"):
                spec = _tensor_map(value, metas.pop(0) if metas else None)
                index = _buffer_index(value.base, buffers) if spec is not None else None
                if index is None:
                    return None
                maps.append([index, *spec])
                described.append((TENSOR_MAP, len(maps) - 1))
                described += [(INT32, int(x)) for x in value.shape] + [(INT64, int(x)) for x in value.strides]
            elif kind.startswith("*"):
                index = _buffer_index(value, buffers)
                if index is None:
                    return None
                described.append((BUFFER, index))
            elif kind in _INTS and isinstance(value, (bool, int)) and not isinstance(value, Pointer):
                described.append((_INTS[kind], int(value)))
            elif kind in ("fp32", "f32") and isinstance(value, (int, float)):
                described.append((FLOAT32, _float_bits(float(value))))
            else:
                return None
        _alive[id(compiled)] = compiled                     # its module stays loaded while C++ holds the function
        grid = tuple(grid) + (1,) * (3 - len(grid))
        scratch = getattr(meta, "global_scratch_size", 0) * grid[0] * grid[1] * grid[2]
        launches.append((int(compiled.function), list(grid), 32 * meta.num_warps, meta.shared, scratch, described, 0,
                         maps))
    return inputs, list(buffers[inputs:]), launches, outputs
