"""Stage 4: variable-block tiling for head dims that are not a power of two, in CUDA.

What you will learn
-------------------
* Why a head dim of 72 costs a Triton kernel the work of 128: ``tl.arange`` and block shapes
  must be powers of two, so 56 of every 128 columns are zeros (stage 3's ``padding_waste``).
  FlashAttention-2 rounds up to the head dims it was compiled for (72 -> 96, 160 -> 192).
  In CUDA the tile follows the head dim in steps of the tensor-core instruction instead:
  72 is computed as 80 in Q K^T (steps of 16) and as exactly 72 in P V (steps of 8).
* How to plan a tile: what each piece of shared memory costs (the Q tile, the K and V tiles
  times their pipeline stages), what the GPU allows, and why a taller query block means more
  arithmetic per byte read from global memory.
* The kernel's block schedule, step by step, in PyTorch on the CPU (``emulate_attention``),
  before the same loop in CUDA with ``mma.sync`` (``stage4_variable_block.cu``, beside this
  file), built for the exact configuration the plan picks on its first use.

Conventions (kernels/reference.py): q (B, H, Nq, D), k and v (B, H, Nk, D), 8 <= D <= 256 and
D % 8 == 0; returns o in q's dtype and lse (B, H, Nq) float32, natural log.  Causal attention
is aligned bottom-right.  The CUDA kernel takes float16 and bfloat16 on an NVIDIA GPU (sm_80
or newer); the plan and the emulation run anywhere.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kernels import cuda_build, runtime, validate

CU_FILE = Path(__file__).with_suffix(".cu")   # the kernel, beside this file
LOG2E = 1.4426950408889634                    # log2(e): exp(x) == exp2(x * LOG2E)
LN2 = 0.6931471805599453                      # ln(2):   log(x) == log2(x) * LN2

MMA_K = 16            # k step of mma.m16n8k16: Q K^T runs over the head dim in steps of 16
MMA_N = 8             # n step: P V runs over the head dim in steps of 8, so D % 8 == 0
MMA_M = 16            # m of the mma: each warp owns block_m / num_warps rows, in m-tiles of 16
STAGES = 2            # K/V pipeline depth: compute on one stage while the next one loads
ROW_PAD = 8           # elements added to each shared-memory row to avoid bank conflicts
DEFAULT_SMEM = 227 * 1024   # an H100's shared memory per block (A100: 163 KB, RTX 30xx/40xx: 99 KB)
# Candidate tiles (block_m, block_n, num_warps), most arithmetic per byte first, then smaller
# ones for GPUs with less shared memory.  Registers bound them: a thread holds
# (block_m / num_warps / 16) x (D / 2 + block_n / 2) floats of output and scores.  A warp that
# owns two 16-row m-tiles (128 rows on 4 warps) reads each K and V fragment from shared memory
# once for 32 rows instead of 16, which pays from D = 72 on (shared memory is this kernel's
# bottleneck); at D above 96 its scores must shrink to 32 keys to fit the registers.  Up to
# D = 64, one m-tile per warp on 8 warps stays the faster.
TILES_UP_TO_64 = ((128, 64, 8), (64, 64, 4), (64, 32, 4), (32, 32, 2), (16, 16, 1))
TILES_UP_TO_96 = ((128, 64, 4), (64, 64, 4), (64, 32, 4), (32, 32, 2), (16, 16, 1))
TILES_UP_TO_160 = ((128, 32, 4), (64, 32, 4), (32, 32, 2), (16, 16, 1))
TILES_ABOVE_160 = ((64, 64, 4), (64, 32, 4), (32, 32, 2), (16, 16, 1))


def candidate_tiles(head_dim: int) -> tuple[tuple[int, int, int], ...]:
    """The (block_m, block_n, num_warps) candidates for this head dim, in the order to try them."""
    for limit, tiles in ((64, TILES_UP_TO_64), (96, TILES_UP_TO_96), (160, TILES_UP_TO_160)):
        if head_dim <= limit:
            return tiles
    return TILES_ABOVE_160
WASTE_HEAD_DIMS = (40, 48, 72, 80, 96, 104, 160, 200)


@dataclass(frozen=True)
class Tiling:
    """One kernel configuration, as ``plan_tiling`` picks it.

    block_m          query rows per thread block
    block_n          keys per step of the inner loop
    head_dim_padded  head dim rounded up to the mma's k step (16): never more than D + 8
    num_warps        warps per block; each owns block_m / num_warps rows (16 or 32)
    smem_bytes       dynamic shared memory the kernel needs with these tiles
    stages           K/V pipeline depth (the kernel double-buffers)
    """
    block_m: int
    block_n: int
    head_dim_padded: int
    num_warps: int
    smem_bytes: int
    stages: int = STAGES


def smem_limit() -> int:
    """Shared memory one thread block may use on this GPU (an H100's on a CPU-only machine)."""
    if runtime.ON_GPU:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin
    return DEFAULT_SMEM


def tile_smem_bytes(block_m: int, block_n: int, head_dim_padded: int, itemsize: int = 2) -> int:
    """Bytes of shared memory the kernel needs for these tiles (the .cu's layout, see its header)."""
    # TODO(4s): one Q tile (block_m rows), plus one K and one V tile (block_n rows each) for each
    # of the STAGES pipeline stages; every row holds head_dim_padded + ROW_PAD elements of
    # itemsize bytes.
    raise NotImplementedError("stage4_variable_block.py: TODO(4s) is not written yet")


def _check_head_dim(head_dim) -> None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim % 8 or not 8 <= head_dim <= 256:
        raise ValueError(f"head_dim must be a multiple of 8 from 8 to 256 (the tensor-core step along the "
                         f"output is 8 columns), got {head_dim!r}")


def plan_tiling(head_dim: int, *, dtype: torch.dtype = torch.float16, causal: bool = False,
                smem_bytes: int | None = None) -> Tiling:
    """Choose the kernel's tiles for ``head_dim``.

    ``smem_bytes`` is the shared memory a block may use (default: this GPU's, or an H100's).
    Raises ``ValueError`` for a head dim that is not a multiple of 8 from 8 to 256, and when
    even the smallest tiles do not fit in ``smem_bytes``.
    """
    _check_head_dim(head_dim)
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"dtype is {dtype}; expected torch.float16, torch.bfloat16 or torch.float32")
    limit = smem_limit() if smem_bytes is None else smem_bytes
    itemsize = torch.finfo(dtype).bits // 8
    # TODO(4p): pick the tiles.
    # 1. head_dim_padded: the smallest multiple of MMA_K (16) that holds head_dim.
    # 2. Walk candidate_tiles(head_dim) in order: each K/V tile read from global memory serves
    #    block_m queries, so the tall blocks come first.
    # 3. Return the first candidate whose tile_smem_bytes(...) fits in `limit`, as a Tiling; if
    #    none fits, raise ValueError naming the shared memory needed and the limit.
    raise NotImplementedError("stage4_variable_block.py: TODO(4p) is not written yet")


def padding_waste(head_dims=WASTE_HEAD_DIMS) -> dict[int, dict[str, tuple[int, float]]]:
    """For each head dim: the head dim each policy computes, and the fraction of the matrix work wasted.

    Three policies, both matrix products (Q K^T and P V) counted:

        power of two       Triton (stage 3): both products at the next power of two
        FlashAttention-2   rounds up to a multiple of 32 (D <= 128) or 64, for both products
        this plan          Q K^T at head_dim_padded, P V at exactly D (its n step is 8)

    >>> padding_waste([72])[72]["power of two"]
    (128, 0.4375)
    """
    table = {}
    for d in head_dims:
        _check_head_dim(d)
        pow2 = 1 << (d - 1).bit_length()
        fa2 = -(-d // (32 if d <= 128 else 64)) * (32 if d <= 128 else 64)
        plan = plan_tiling(d).head_dim_padded
        table[d] = {
            "power of two": (pow2, (pow2 - d) / pow2),
            "FlashAttention-2": (fa2, (fa2 - d) / fa2),
            "this plan": (plan, (plan - d) / (plan + d)),     # wasted columns / (plan + d) computed
        }
    return table


def block_schedule(n_q: int, n_k: int, block_m: int, block_n: int, causal: bool = False):
    """The kernel's loop, as data: for each query block, the key blocks it visits, in order.

    Returns ``[(query_block, [(key_block, needs_mask), ...]), ...]``.  Causal (bottom-right,
    offset = n_k - n_q): query block ``qb`` stops after the last key its last row may see.
    ``needs_mask`` is False when every query of the block sees every key of the tile, and the
    kernel then skips the per-element masking.
    """
    offset = n_k - n_q
    schedule = []
    for qb in range(-(-n_q // block_m)):
        m0 = qb * block_m
        n_end = min(n_k, m0 + block_m + offset) if causal else n_k
        visits = []
        for kb in range(-(-n_end // block_n) if n_end > 0 else 0):
            n0 = kb * block_n
            needs_mask = n0 + block_n > n_k or (causal and n0 + block_n - 1 > m0 + offset)
            visits.append((kb, needs_mask))
        schedule.append((qb, visits))
    return schedule


@dataclass
class TileStep:
    """One step of the emulation, for stepping through it: the tile and (b=0, h=0)'s running state."""
    query_block: int
    key_block: int
    needs_mask: bool
    m: torch.Tensor        # running max of the raw scores of the block's rows, after this tile
    l: torch.Tensor        # running sum of exp2((s - m) * scale_log2)


def emulate_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                      block_m: int | None = None, block_n: int | None = None, trace: list | None = None):
    """The CUDA kernel's algorithm in PyTorch, on any device: same tiles, same loop, same updates.

    Like the kernel: Q and K zero-padded to head_dim_padded for Q K^T, scores and the running
    max/sum in float32, exponentials in base 2 with the scale folded in, P rounded to the input
    dtype before P V, and P V over the exact head dim.  ``trace`` (a list) receives a
    ``TileStep`` per tile.  Returns ``(o, lse)`` like ``flash_attention``.
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(
        q, k, v, causal=causal, sm_scale=sm_scale, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    if Hq != Hkv:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}; stage 4 expects the same number of heads")
    tiling = _tiling(D, q.dtype, causal, block_m, block_n)
    bm, bn, dp = tiling.block_m, tiling.block_n, tiling.head_dim_padded
    scale_log2 = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)) * LOG2E
    qp = torch.nn.functional.pad(q, (0, dp - D))        # (B, H, Nq, dp): zero columns, as in shared memory
    kp = torch.nn.functional.pad(k, (0, dp - D))        # (B, H, Nk, dp)
    o = torch.empty_like(q)                             # (B, H, Nq, D)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)
    neg_inf = torch.tensor(float("-inf"), device=q.device)

    for qb, visits in block_schedule(Nq, Nk, bm, bn, causal):
        rows = torch.arange(qb * bm, min(qb * bm + bm, Nq), device=q.device)
        qt = qp[:, :, rows].float()                                          # (B, H, bm, dp)
        m = torch.full((B, Hq, rows.numel()), float("-inf"), device=q.device)  # running max (raw scores)
        l = torch.zeros(B, Hq, rows.numel(), device=q.device)                # running sum
        acc = torch.zeros(B, Hq, rows.numel(), D, device=q.device)           # unnormalised output
        for kb, needs_mask in visits:
            cols = torch.arange(kb * bn, min(kb * bn + bn, Nk), device=q.device)
            s = qt @ kp[:, :, cols].float().transpose(-1, -2)                # (B, H, bm, bn): the mma's float32
            if needs_mask and causal:
                s = s.masked_fill(cols[None, :] > rows[:, None] + (Nk - Nq), float("-inf"))
            # TODO(4e): the online-softmax update, exactly as the kernel does it: m_new, the
            # scaled max m_scaled = m_new * scale_log2 (0 where m_new is -inf, so no -inf - -inf),
            # alpha = exp2(m * scale_log2 - m_scaled), p = exp2(s * scale_log2 - m_scaled),
            # l = l * alpha + rowsum(p), acc = acc * alpha + (p rounded to v's dtype) @ v-tile.
            raise NotImplementedError("stage4_variable_block.py: TODO(4e) is not written yet")
            if trace is not None:
                trace.append(TileStep(qb, kb, needs_mask, m[0, 0].clone(), l[0, 0].clone()))
        # Like the kernel's epilogue: o = acc * (1 / l), with 1 / l := 0 for a row that saw no key.
        seen = l > 0
        inv = torch.where(seen, 1.0 / torch.where(seen, l, 1.0), 0.0)
        o[:, :, rows] = (acc * inv[..., None]).to(q.dtype)
        lse[:, :, rows] = torch.where(seen, (m * scale_log2 + torch.log2(torch.where(seen, l, 1.0))) * LN2, neg_inf)
    return o, lse


def _tiling(head_dim, dtype, causal, block_m=None, block_n=None, num_warps=None) -> Tiling:
    """The plan's tiling, or the plan with ``block_m``/``block_n``/``num_warps`` overridden."""
    tiling = plan_tiling(head_dim, dtype=dtype, causal=causal)
    if block_m is None and block_n is None and num_warps is None:
        return tiling
    bm = tiling.block_m if block_m is None else block_m
    bn = tiling.block_n if block_n is None else block_n
    for name, value in (("block_m", bm), ("block_n", bn)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 16 or value % 16 or value > 256:
            raise ValueError(f"{name} must be a multiple of 16 from 16 to 256, got {value!r}")
    warps = num_warps
    if warps is None:   # keep the plan's rows per warp where the block allows it
        warps = tiling.num_warps if bm % (MMA_M * tiling.num_warps) == 0 else min(8, bm // MMA_M)
    if isinstance(warps, bool) or not isinstance(warps, int) or warps not in (1, 2, 4, 8) or bm % (MMA_M * warps):
        raise ValueError(f"num_warps must be 1, 2, 4 or 8 and split block_m = {bm} into 16-row m-tiles, "
                         f"got {warps!r}")
    itemsize = torch.finfo(dtype).bits // 8
    return replace(tiling, block_m=bm, block_n=bn, num_warps=warps,
                   smem_bytes=tile_smem_bytes(bm, bn, tiling.head_dim_padded, itemsize))


# ---- the CUDA kernel ---------------------------------------------------------------------

_ARGTYPES = [ctypes.c_void_p] * 5 + [ctypes.POINTER(ctypes.c_int64)] + [ctypes.c_int] * 5 + \
            [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]


def _kernel(head_dim: int, tiling: Tiling):
    """The compiled kernel for this configuration (compiled on first use, then cached on disk)."""
    lib = cuda_build.load(CU_FILE, label="stage 4 kernel",
                          defines={"HEAD_DIM": head_dim, "BLOCK_M": tiling.block_m, "BLOCK_N": tiling.block_n,
                                   "NUM_WARPS": tiling.num_warps})
    if lib.stage4_forward.argtypes is None:
        lib.stage4_forward.argtypes = _ARGTYPES
        lib.stage4_forward.restype = ctypes.c_int
        lib.stage4_error_string.restype = ctypes.c_char_p
    config = (ctypes.c_int * 6)()      # HEAD_DIM, BLOCK_M, BLOCK_N, NUM_WARPS, threads, shared memory
    lib.stage4_config(config)
    if config[5] > tiling.smem_bytes:
        raise RuntimeError(f"the plan budgets {tiling.smem_bytes} bytes of shared memory for {tiling}, "
                           f"but the kernel needs {config[5]}: count the Q tile, the K and V tiles of "
                           f"every pipeline stage, and the row padding")
    return lib


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """16-byte loads need a unit head-dim stride, strides in multiples of 8 and an aligned start."""
    if x.stride(-1) != 1 or any(s % 8 for s in x.stride()[:3]) or x.data_ptr() % 16:
        return x.clone(memory_format=torch.contiguous_format)
    return x


def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None):
    """FlashAttention forward with the CUDA kernel; returns ``(o, lse)``.

    The kernel is built for the configuration ``plan_tiling`` picks (or the one the overrides
    make) on its first use.  On the CPU, ``emulate_attention`` runs the same block schedule.

    Args:
        q: (B, H, Nq, D) queries, any strides (copied when the kernel's 16-byte loads need it);
            float16 or bfloat16 on a CUDA GPU (sm_80 or newer); D a multiple of 8 from 8 to 256;
            B x H at most 65535.
        k, v: (B, H, Nk, D) keys and values, any strides: q's batch, heads, head dim, dtype and
            device; Nk >= 1.
        causal: query i sees key j iff j <= i + (Nk - Nq), the diagonal aligned bottom-right; a row
            that sees no key (Nq > Nk) gets o = 0 and lse = -inf.
        sm_scale: the scores' scale, a positive number; None means ``1 / sqrt(D)``.
        block_m: query rows per thread block, a multiple of 16 from 16 to 256; None: the plan's.
        block_n: keys per loop step, a multiple of 16 from 16 to 256; None: the plan's.
        num_warps: 1, 2, 4 or 8, splitting block_m into 16-row m-tiles; None: the plan's.

    Returns:
        ``(o, lse)``: o (B, H, Nq, D) contiguous, in q's dtype; lse (B, H, Nq) float32, the
        log-sum-exp of each row's scaled scores in natural log (base e).
    """
    B, Hq, Hkv, Nq, Nk, D = validate.attention_inputs(
        q, k, v, causal=causal, sm_scale=sm_scale, dtypes=(torch.float16, torch.bfloat16))
    if Hq != Hkv:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}; stage 4 expects the same number of heads")
    tiling = _tiling(D, q.dtype, causal, block_m, block_n, num_warps)
    if not q.is_cuda:
        raise RuntimeError(f"flash_attention runs the CUDA kernel and needs a CUDA GPU, but q is on {q.device}; "
                           "on the CPU, step through emulate_attention, which follows the same block schedule")
    if B * Hq > 65535:
        raise ValueError(f"batch x heads is {B * Hq}; the kernel's grid allows at most 65535")
    lib = _kernel(D, tiling)
    q, k, v = (_kernel_layout(x) for x in (q, k, v))
    o = torch.empty(B, Hq, Nq, D, device=q.device, dtype=q.dtype)           # (B, H, Nq, D)
    lse = torch.empty(B, Hq, Nq, device=q.device, dtype=torch.float32)     # (B, H, Nq)
    if Nq == 0 or B * Hq == 0:
        return o, lse
    strides = (ctypes.c_int64 * 12)(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3])
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)
    err = lib.stage4_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), strides,
                             B, Hq, Nq, Nk, D, scale, 0 if q.dtype == torch.float16 else 1, int(causal),
                             torch.cuda.current_stream(q.device).cuda_stream)
    if err:
        raise RuntimeError(f"the stage 4 kernel failed: {lib.stage4_error_string(err).decode()}")
    return o, lse


