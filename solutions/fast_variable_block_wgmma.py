"""Stage 4 on Hopper with wgmma and TMA: the fast variant, beside the readable CUDA kernel.

Which is which
--------------
``solutions/stage4_variable_block.cu`` is the model answer: each warp multiplies 16x16 by 16x8
tiles with ``mma.sync``, reads its fragments with ``ldmatrix``, all threads copy tiles with
``cp.async`` and meet at ``__syncthreads`` once per key block.  That is the kernel a learner
writes, and it runs on any GPU from Ampere on.

``solutions/fast_variable_block_wgmma.cu`` computes the same forward (o and lse, causal aligned
bottom-right, any Nq and Nk, float16 and bfloat16), and the masks of stages 5-8 too (GQA,
sliding windows with sink tokens, learned sinks), on an H100 or H200 only (sm_90a), built the
way Hopper wants it:

* **Warpgroup multiplies.**  ``wgmma.m64nNk16`` multiplies 64 rows for four warps together, and
  its N runs from 8 to 256 in steps of 8: P V is one instruction per 16 keys with N equal to the
  head dim, 72 or 96 or 160.  The tile still follows the head dim, now in the instruction's
  own shape.  Q and K are read by the tensor cores straight from shared memory; P stays in
  registers.
* **A producer and consumers.**  One warpgroup only loads: one of its threads asks the TMA for
  whole tiles, into a ring of stages guarded by mbarriers (``full``: the tile has landed;
  ``empty``: every consumer warp is done with it).  The other warpgroups only compute; nobody
  waits at a block-wide barrier.  ``setmaxnreg`` hands the producer's registers to the
  consumers (24 a thread against 240 with two consumer warpgroups, 160 with three).
* **Overlap inside a warpgroup.**  S = Q K^T of block j is issued together with O += P V of
  block j - 1, so the softmax of block j runs while the tensor cores finish the product.  The
  loop body has no branch between issuing a product and waiting for it; with one, the compiler
  runs every product of the kernel one after the other (the .cu's header says why).
* **Turns between warpgroups.**  The consumer warpgroups issue their products in turn, passing
  the turn on through a named barrier, so that while one computes its softmax the tensor cores
  work through the next one's products.
* **Swizzled tiles.**  The TMA writes each 64-column panel of a tile with 128-byte rows whose
  16-byte chunks are permuted by the row (chunk c of row r at c xor r % 8), the layout the wgmma
  descriptors read without bank conflicts.  The output goes back through the same layout and
  a TMA store.

``python -m grader bench stage4`` (and stages 5-8) times it as ``solution-wgmma`` beside the
stage's solution and SDPA's backends (docs/performance.md); docs/stage4-notes.md says how its
design and tiles were chosen, docs/hopper-notes.md (section 10) how it was made to overlap.
solutions/attention_op runs it as the op's forward where the op's plan times it faster than the
Triton forward (section 11), through ``library`` and the ``stage4w_forward`` host function.
"""

from __future__ import annotations

import ctypes
import math
from pathlib import Path

from kernels import cuda_build, validate

import torch

CU_FILE = Path(__file__).with_name("fast_variable_block_wgmma.cu")
ARCH = "sm_90a"               # wgmma exists on sm_90a only

# (block_n, warpgroups, stages, pingpong) by head dim, up to the listed one: BLOCK_N keys per
# tile, 64 query rows per consumer warpgroup, K/V stages in the ring, and whether the consumer
# warpgroups take turns issuing their products.  Each entry is the fastest of a sweep on an H200
# without a mask at D48, 64, 72, 96, 128, 160 and 256 (docs/hopper-notes.md, section 10): turns
# win or tie at every head dim; three consumer warpgroups win where their 160 registers a thread
# hold the tile, two above D96.  D80's entry is the largest tile ptxas keeps in flight there (at
# 128 keys it runs out of registers and serializes the products), not timed.
TILES = {64: (128, 3, 2, True), 72: (128, 3, 2, True), 80: (112, 3, 2, True), 96: (112, 3, 2, True),
         128: (176, 2, 2, True), 160: (96, 2, 2, True), 256: (80, 2, 2, True)}
# Under the causal mask, where they differ: the same sweep's fastest causal entry.
CAUSAL_TILES = {64: (128, 2, 2, True)}
# Under a sliding window (its own build of the kernel, with more to compute per mask) the tiles
# above run out of registers and spill at most head dims; these do not (ptxas).  Timed at D64
# only, where no other tile of eight was more than 2% faster (docs/hopper-notes.md, section 10).
WINDOW_TILES = {64: (128, 2, 2, True), 72: (128, 2, 2, True), 80: (128, 2, 2, True), 96: (128, 2, 2, True),
                128: (144, 2, 2, True), 160: (96, 2, 2, True), 256: (48, 2, 2, True)}
SMEM_LIMIT = 227 * 1024       # an H100's shared memory per thread block
# stage4w_forward(q, k, v, o, lse, strides, batch, heads, kv_heads, n_q, n_k, head_dim, sm_scale, dtype, causal,
#                 window, sink_tokens, sinks, stream)
ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_int] * 6 + \
    [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]


def plan(head_dim: int, causal: bool = False, window: bool = False) -> tuple[int, int, int, bool]:
    """(block_n, warpgroups, stages, pingpong) for ``head_dim``: the entry of the next listed head
    dim up (the window's table under a window, else the causal table's where it has one)."""
    for limit in sorted(TILES):
        if head_dim <= limit:
            if window:
                return WINDOW_TILES[limit]
            return CAUSAL_TILES.get(limit, TILES[limit]) if causal else TILES[limit]
    raise ValueError(f"head_dim must be at most 256, got {head_dim}")


def smem_bytes(head_dim: int, block_n: int, warpgroups: int, stages: int) -> int:
    """Dynamic shared memory of one thread block (the .cu's Config::SMEM_BYTES).

    Tiles are stored in 64-column panels of 128-byte rows, so a head dim is rounded up to a
    multiple of 64 here (the TMA fills the missing columns with zeros): the Q tile, ``stages``
    K tiles and as many V tiles, and 1024 bytes to align them.
    """
    panels = (head_dim + 63) // 64
    return panels * 128 * (64 * warpgroups + 2 * stages * block_n) + 1024


_built: dict[tuple, ctypes.CDLL] = {}


def library(head_dim: int, block_n: int, warpgroups: int, stages: int, pingpong: bool = False) -> ctypes.CDLL:
    """The kernel built for this head dim and tile, compiled on first use and kept for the process
    (``cuda_build.load`` reads and hashes the source on every call)."""
    key = (head_dim, block_n, warpgroups, stages, bool(pingpong))
    lib = _built.get(key)
    if lib is None:
        lib = _built[key] = _kernel(*key)
    return lib


def _kernel(head_dim: int, block_n: int, warpgroups: int, stages: int, pingpong: bool = False):
    lib = cuda_build.load(CU_FILE, label="stage 4 wgmma kernel", arch=ARCH,
                          defines={"HEAD_DIM": head_dim, "BLOCK_N": block_n, "WARPGROUPS": warpgroups,
                                   "STAGES": stages, "PINGPONG": int(pingpong)})
    if lib.stage4w_forward.argtypes is None:
        lib.stage4w_forward.argtypes = ARGTYPES
        lib.stage4w_forward.restype = ctypes.c_int
        lib.stage4w_error_string.restype = ctypes.c_char_p
    config = (ctypes.c_int * 7)()      # HEAD_DIM, BLOCK_M, BLOCK_N, WARPGROUPS, threads, shared memory, PINGPONG
    lib.stage4w_config(config)
    if config[5] != smem_bytes(head_dim, block_n, warpgroups, stages):
        raise RuntimeError(f"the kernel asks for {config[5]} bytes of shared memory, smem_bytes() says "
                           f"{smem_bytes(head_dim, block_n, warpgroups, stages)}: keep the two in step")
    if config[6] != int(pingpong):
        raise RuntimeError(f"the kernel was built with PINGPONG={config[6]}, asked for {int(pingpong)}")
    return lib


def flash_attention(q, k, v, *, causal: bool = False, window: int | None = None, sink_tokens: int = 0,
                    sinks: torch.Tensor | None = None, sm_scale: float | None = None,
                    block_n: int | None = None, warpgroups: int | None = None, stages: int | None = None,
                    pingpong: bool | None = None):
    """FlashAttention forward with the wgmma kernel; returns ``(o, lse)``.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D) with Hq a multiple of Hkv (GQA); D a multiple of 8
    from 16 to 256; any Nq, Nk >= 1; float16 or bfloat16 on an sm_90 GPU (H100, H200).
    ``causal``, ``window``, ``sink_tokens`` and ``sinks`` (learned, one logit a query head) as in
    stages 5-8.  Inputs that are not contiguous, or do not start on 16 bytes, are copied first
    (the TMA wants 16-byte aligned tensors).
    ``block_n`` (a multiple of 16 up to 256), ``warpgroups`` (1, 2 or 3; 64 query rows each),
    ``stages`` (2, 3 or 4) and ``pingpong`` (whether the consumer warpgroups take turns) override
    the plan.
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(
        q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, sm_scale=sm_scale,
        dtypes=(torch.float16, torch.bfloat16))
    if D % 8 or D < 16:
        raise ValueError(f"head_dim must be a multiple of 8 from 16 to 256, got {D}")
    planned = dict(zip(("block_n", "warpgroups", "stages", "pingpong"), plan(D, causal, window is not None)))
    chosen = {name: planned[name] if given is None else given
              for name, given in (("block_n", block_n), ("warpgroups", warpgroups), ("stages", stages),
                                  ("pingpong", pingpong))}
    if not isinstance(chosen["pingpong"], bool):
        raise ValueError(f"pingpong must be True or False, got {chosen['pingpong']!r}")
    for name, ok, rule in (("block_n", lambda x: 16 <= x <= 256 and x % 16 == 0, "a multiple of 16 up to 256"),
                           ("warpgroups", lambda x: x in (1, 2, 3), "1, 2 or 3"),
                           ("stages", lambda x: x in (2, 3, 4), "2, 3 or 4")):
        value = chosen[name]
        if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
            raise ValueError(f"{name} must be {rule}, got {value!r}")
    bn, wgs, ns = chosen["block_n"], chosen["warpgroups"], chosen["stages"]
    need = smem_bytes(D, bn, wgs, ns)
    if need > SMEM_LIMIT - 256:       # 256 bytes stay for the kernel's mbarriers
        raise ValueError(f"block_n = {bn} with {wgs} warpgroups and {ns} stages needs {need} bytes of shared "
                         f"memory at head_dim {D}; at most {SMEM_LIMIT - 256} fit")
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        where = q.device if not q.is_cuda else torch.cuda.get_device_name(q.device)
        raise RuntimeError(f"the wgmma kernel needs an sm_90 GPU (H100, H200), but q is on {where}; "
                           "solutions/stage4_variable_block.py runs on any GPU from Ampere on")
    if B * Hq > 65535:
        raise ValueError(f"batch x heads is {B * Hq}; the kernel's grid allows at most 65535")
    lib = library(D, bn, wgs, ns, chosen["pingpong"])
    q, k, v = (x if x.is_contiguous() and x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)
               for x in (q, k, v))
    o = torch.empty(B, Hq, Nq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)
    if Nq == 0 or B * Hq == 0:
        return o, lse
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    sinks = sinks.to(torch.float32).contiguous() if sinks is not None else None
    call(lib, forward_args(q, k, v, o, lse, strides, (B, Hq, Hkv, Nq, Nk, D), scale, causal, window, sink_tokens,
                           sinks), torch.cuda.current_stream(q.device).cuda_stream)
    return o, lse


def forward_args(q, k, v, o, lse, strides, shape: tuple, scale: float, causal: bool, window: int | None,
                 sink_tokens: int, sinks) -> tuple:
    """``stage4w_forward``'s arguments but the stream, in ``ARGTYPES``' order: the tensors as their
    addresses (sinks None when absent), ``strides`` the (batch, head, row) strides of q, k, v and
    o, ``shape`` (batch, heads, kv_heads, n_q, n_k, head_dim).  A window or sink tokens beyond Nk
    keys mean the same as Nk of them, and stay in a C int."""
    n_k = shape[4]
    return (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), tuple(strides), *shape,
            float(scale), 0 if q.dtype == torch.float16 else 1, int(causal), min(window or 0, n_k),
            min(sink_tokens, n_k), None if sinks is None else sinks.data_ptr())


def call(lib: ctypes.CDLL, args: tuple, stream: int) -> None:
    """``lib``'s ``stage4w_forward`` with ``forward_args``' arguments, on ``stream``."""
    err = lib.stage4w_forward(*args[:5], (ctypes.c_int64 * 12)(*args[5]), *args[6:], stream)
    if err:
        raise RuntimeError(f"the wgmma kernel failed: {lib.stage4w_error_string(err).decode()}")
