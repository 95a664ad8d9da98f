"""Stage 9's backward in one pass on Hopper, with wgmma and the TMA: the fast path beside stage 9.

Which is which
--------------
``solutions/stage9_backward.py`` is the model answer: a preprocess for delta, then a dK/dV
kernel and a dQ kernel that each recompute the scores, seven matrix products a tile.
``solutions/fast_backward_tma.py`` keeps that shape and feeds it through the TMA.  This file runs
``fast_backward_wgmma.cu``, one CUDA kernel that does five products a tile, on an H100 or H200
only (sm_90a):

* **One pass.**  A thread block keeps 128 keys of one K/V head and walks every query block (of
  every query head of its GQA group) that sees them, computing S, P, dP and dS once and adding
  dV, dK (in registers) and dQ (into a float32 buffer that every key block shares).
* **dQ's additions off the critical path.**  The consumer warpgroups store their dQ fragments
  to shared memory as the registers hold them, and a writer warp has the bulk copy engine add
  each buffer into global memory.  The buffer then holds dQ in fragment order; a second small
  kernel (``rows``; ``rows_of_fragments`` is its plain PyTorch form) puts it back in rows, scaled
  and cast, into dq's own layout.
* **Masks as selects.**  Blocks that the causal rule, a window or sink tokens cut are masked
  by bitwise tests and a select, in a loop chosen once per query block.
* **Longest first.**  A causal grid with few blocks a head launches its longest key blocks first
  (``order``), so that they do not finish last.

What stays stage 9's: the preprocess (delta, and the learned sinks' gradient), the visibility
rule and the query-block ranges (the kernel computes ``query_blocks_of``'s ranges itself).
Limits: head dims 64 and 128, Nq and Nk multiples of 128, float16 or bfloat16, strides a TMA
descriptor can read (``fast_forward_tma.tma_compatible``), batch x K/V heads at most 65535.
dQ's additions have no fixed order, so results vary in the last bits between runs: the op keeps
the TMA backward when deterministic algorithms are asked for.
docs/hopper-notes.md (sections 12-15) says how it was built and what each step gained.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
from pathlib import Path

from kernels import cuda_build, validate
from kernels.loader import load_file

import torch

_HERE = Path(__file__).resolve().parent
_stage9 = load_file(_HERE / "stage9_backward.py")
_tma_forward = load_file(_HERE / "fast_forward_tma.py")
CU_FILE = _HERE / "fast_backward_wgmma.cu"
ARCH = "sm_90a"
HEAD_DIMS = (64, 128)
BLOCK_N = 128                 # keys a thread block; Nq and Nk must be multiples of it
# A causal grid of at most this many blocks an SM launches longest first: at B1 N4096 Hq64/Hkv8
# (256 blocks) that ran 1.47x faster, at B4 H16 N4096 (2048 blocks) it ran 0.94-1.0x
# (docs/hopper-notes.md, section 15).
LONGEST_FIRST_WAVES = 4
# bwdw_backward(q, k, v, do, lse, delta, dq32, dk, dv, strides, batch, heads, kv_heads, n_q, n_k, head_dim,
#               sm_scale, dtype, causal, window, sink_tokens, order, stream)
ARGTYPES = [ctypes.c_void_p] * 9 + [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_int] * 6 + \
    [ctypes.c_float] + [ctypes.c_int] * 5 + [ctypes.c_void_p]

# bwdw_rows(dq32, dq, strides, batch, heads, n, sm_scale, dtype, stream)
ROWS_ARGTYPES = [ctypes.c_void_p] * 2 + [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_int] * 3 + \
    [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
_ROWS_ERRORS = {-7: "the library was built with dQ left in rows (BWD_DQ_TMA 0 or 1)",
                -8: "dq's strides must be multiples of 8 elements and its start 16-byte aligned, N a multiple of 64",
                -9: "more than 2^31 - 1 tiles of 64 rows"}

_built: dict[int, ctypes.CDLL] = {}


FORWARD_INCLUDE = '#include "fast_variable_block_wgmma.cu"'


def source() -> str:
    """The .cu with the forward's helpers inlined where it includes them: a build compiles a copy
    of its source elsewhere, and keys the build by the text it compiles, so that a change to either
    file rebuilds it."""
    text = CU_FILE.read_text()
    if text.count(FORWARD_INCLUDE) != 1:
        raise RuntimeError(f"{CU_FILE.name} must include the forward once, as {FORWARD_INCLUDE}")
    return text.replace(FORWARD_INCLUDE, (_HERE / "fast_variable_block_wgmma.cu").read_text())


def library(head_dim: int) -> ctypes.CDLL:
    """The kernel built for ``head_dim`` (64 or 128), compiled on first use and kept."""
    lib = _built.get(head_dim)
    if lib is None:
        lib = prepare(cuda_build.load(_inlined_file(), label="one-pass wgmma backward", arch=ARCH,
                                      defines={"HEAD_DIM": head_dim}))
        _built[head_dim] = lib
    return lib


def _inlined_file() -> Path:
    """``source()`` in the build cache, in a file named by its text's hash and written whole (a
    temporary file renamed into place), so that processes building other versions at once, or
    the same one, never read a file another is writing."""
    text = source()
    folder = cuda_build.cache_dir() / "sources"
    path = folder / f"{CU_FILE.stem}_{hashlib.sha256(text.encode()).hexdigest()[:16]}.cu"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{path.name}.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, path)
    return path


def prepare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare ``bwdw_backward``'s and ``bwdw_rows``' arguments on a built library (the probe builds
    its own variants)."""
    lib.bwdw_backward.argtypes = ARGTYPES
    lib.bwdw_backward.restype = ctypes.c_int
    lib.bwdw_rows.argtypes = ROWS_ARGTYPES
    lib.bwdw_rows.restype = ctypes.c_int
    lib.stage4w_error_string.restype = ctypes.c_char_p
    config = (ctypes.c_int * 7)()   # HEAD_DIM, keys a block, threads, shared memory, registers x 2, dQ mode
    lib.bwdw_config(config)
    lib.config = tuple(config)
    return lib


def supports(b: int, hkv: int, nq: int, nk: int, d: int) -> bool:
    """Whether the kernel takes this shape (the dtype, device and strides are checked elsewhere)."""
    return d in HEAD_DIMS and nq % BLOCK_N == 0 and nk % BLOCK_N == 0 and nq > 0 and 1 <= b * hkv <= 65535


def order_for(b: int, hkv: int, nk: int, causal: bool, device: torch.device) -> int:
    """1 (longest key blocks first) for a causal grid of at most ``LONGEST_FIRST_WAVES`` blocks an SM."""
    if not causal:
        return 0
    blocks = -(-nk // BLOCK_N) * b * hkv
    return int(blocks <= LONGEST_FIRST_WAVES * torch.cuda.get_device_properties(device).multi_processor_count)


def backward_args(q, k, v, do, lse, delta, dq32, dk, dv, strides, shape: tuple, scale: float, causal: bool,
                  window: int, sink_tokens: int, order: int) -> tuple:
    """``bwdw_backward``'s arguments but the stream: tensors as addresses, ``strides`` the
    (batch, head, row) strides of q, k, v, do, dk, dv, ``shape`` (batch, heads, kv_heads, n_q,
    n_k, head_dim); a window or sink tokens beyond Nk keys mean Nk of them."""
    n_k = shape[4]
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse.data_ptr(), delta.data_ptr(),
            dq32.data_ptr(), dk.data_ptr(), dv.data_ptr(), tuple(strides), *shape, float(scale),
            0 if q.dtype == torch.float16 else 1, int(causal), min(window or 0, n_k), min(sink_tokens, n_k),
            int(order))


def call(lib: ctypes.CDLL, args: tuple, stream: int) -> None:
    """``lib``'s ``bwdw_backward`` with ``backward_args``' arguments, on ``stream``."""
    err = lib.bwdw_backward(*args[:9], (ctypes.c_int64 * 18)(*args[9]), *args[10:], stream)
    if err:
        raise RuntimeError(f"the one-pass wgmma backward failed: {lib.stage4w_error_string(err).decode()}")


def fragments_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, H, N, D) as (B, H, tile, warp, i, g, w, j, t, e): row 64 tile + 16 warp + 8 i + g,
    column w D / 2 + 8 j + 2 t + e, through t's own strides, so that a (B, N, H, D) tensor seen as
    (B, H, N, D) is written where it lies."""
    B, H, N, D = t.shape
    sb, sh, sn, sd = t.stride()
    return t.as_strided((B, H, N // 64, 4, 2, 8, 2, D // 16, 4, 2),
                        (sb, sh, 64 * sn, 16 * sn, 8 * sn, sn, D // 2 * sd, 8 * sd, 2 * sd, sd))


def rows_of_fragments(dq32: torch.Tensor, dq: torch.Tensor, scale: float) -> torch.Tensor:
    """Write ``dq`` (B, H, N, D, any strides) from the kernel's float32 buffer in fragment order,
    scaled and cast.  In each 64-row tile, the half of the columns that consumer warpgroup w owns
    is stored as [j][warp][g][t][i][e]: thread 4 g + t of a warp, its register 4 j + 2 i + e,
    which holds row 16 warp + 8 i + g and column 8 j + 2 t + e of the half (one elementwise kernel)."""
    B, H, N, D = dq.shape
    stored = dq32.view(B, H, N // 64, 2, D // 16, 4, 8, 4, 2, 2)           # b h tile w j warp g t i e
    torch.mul(stored.permute(0, 1, 2, 5, 8, 6, 3, 4, 7, 9), scale, out=fragments_view(dq))
    return dq


def rows_fit(dq: torch.Tensor) -> bool:
    """Whether ``rows`` can write ``dq`` (B, H, N, D) where it lies: float16 or bfloat16 on a GPU,
    the head dim contiguous, the other strides multiples of 8 elements, the start on 16 bytes, N a
    multiple of 64."""
    return (dq.is_cuda and dq.dtype in (torch.float16, torch.bfloat16) and dq.stride(3) == 1
            and all(s % 8 == 0 for s in dq.stride()[:3]) and dq.data_ptr() % 16 == 0 and dq.shape[2] % 64 == 0)


def rows(lib: ctypes.CDLL, dq32: torch.Tensor, dq: torch.Tensor, scale: float, stream: int) -> torch.Tensor:
    """``rows_of_fragments`` on the GPU by ``lib``'s own kernel (one read of dq32, one write of dq,
    the transposition through shared memory) where ``rows_fit(dq)``, else by ``rows_of_fragments``.
    docs/hopper-notes.md, section 21, times the two."""
    if not rows_fit(dq):
        return rows_of_fragments(dq32, dq, scale)
    B, H, N, _ = dq.shape
    err = lib.bwdw_rows(dq32.data_ptr(), dq.data_ptr(), (ctypes.c_int64 * 3)(*dq.stride()[:3]), B, H, N,
                        float(scale), 0 if dq.dtype == torch.float16 else 1, stream)
    if err:
        why = _ROWS_ERRORS.get(err) or lib.stage4w_error_string(err).decode()
        raise RuntimeError(f"the one-pass backward's dQ conversion failed: {why}")
    return dq


def flash_attention_backward(q, k, v, o, lse, do, *, causal: bool = False, window: int | None = None,
                             sink_tokens: int = 0, sinks: torch.Tensor | None = None, sm_scale: float | None = None,
                             order: int | None = None, lib: ctypes.CDLL | None = None):
    """Gradients ``(dq, dk, dv, dsinks)``, as stage 9's ``flash_attention_backward``, in one pass.

    q, o, do: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D); lse: (B, Hq, Nq) float32 from the forward;
    D 64 or 128; Nq and Nk multiples of 128; float16 or bfloat16 on an sm_90 GPU.  Tensors are
    read through their strides where a TMA descriptor can (else copied); dq, dk, dv come back
    like q, k, v.  ``order`` (0 or 1) overrides ``order_for``; ``lib`` a build of the kernel (the
    probe's variants).  Extra memory: delta, and dQ in float32 (B, Hq, Nq, D).
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(
        q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, sm_scale=sm_scale,
        dtypes=(torch.float16, torch.bfloat16))
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim is {D}: the one-pass kernel takes head dims 64 and 128; "
                         "fast_backward_tma.py and stage 9 take the others")
    if Nq % BLOCK_N or Nk % BLOCK_N:
        raise ValueError(f"q and k: the one-pass kernel takes Nq and Nk multiples of {BLOCK_N}, got Nq={Nq}, "
                         f"Nk={Nk}; fast_backward_tma.py takes any")
    if B * Hkv > 65535:
        raise ValueError(f"k: batch x K/V heads is {B * Hkv}; the kernel's grid allows at most 65535")
    validate.backward_inputs(q, o, lse, do)
    if order not in (None, 0, 1):
        raise ValueError(f"order must be 0, 1 or None, got {order!r}")
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        where = q.device if not q.is_cuda else torch.cuda.get_device_name(q.device)
        raise RuntimeError(f"the one-pass wgmma backward needs an sm_90 GPU (H100, H200), but q is on {where}; "
                           "solutions/stage9_backward.py runs anywhere")
    lib = lib or library(D)
    q, k, v, do = (x if _tma_forward.tma_compatible(x) else x.clone(memory_format=torch.contiguous_format)
                   for x in (q, k, v, do))
    lse = contiguous_rows(lse)
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    delta, dsinks = _stage9.backward_preprocess(o, do, lse, sinks)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)   # their inputs' strides
    dq32 = torch.empty(B, Hq, Nq, D, device=q.device, dtype=torch.float32)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dk.stride()[:3],
               *dv.stride()[:3])
    if order is None:
        order = order_for(B, Hkv, Nk, causal, q.device)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    call(lib, backward_args(q, k, v, do, lse, delta, dq32, dk, dv, strides, (B, Hq, Hkv, Nq, Nk, D), scale, causal,
                            window, sink_tokens, order), stream)
    if lib.config[6] != 2:                                  # the probe's other modes leave dQ in rows
        dq.copy_(dq32 * scale)
    else:
        rows(lib, dq32, dq, scale, stream)
    return dq, dk, dv, dsinks


def contiguous_rows(lse: torch.Tensor) -> torch.Tensor:
    """lse as the kernel reads it: contiguous and starting on 16 bytes (a bulk copy's rule); a
    copy into a fresh allocation (which starts on 512 bytes) otherwise."""
    if lse.is_contiguous() and lse.data_ptr() % 16 == 0:
        return lse
    return torch.empty(lse.shape, device=lse.device, dtype=lse.dtype).copy_(lse)
