"""Checks for stage 4: the tiling plan, the CPU emulation of the kernel's schedule, the CUDA kernel.

The plan and the emulation are checked on any machine; the .cu file is compiled with nvcc for
sm_80 and sm_90 wherever nvcc is installed (no GPU needed); the kernel itself runs only on a GPU.
"""

from __future__ import annotations

import concurrent.futures

from kernels import cuda_build, loader

import torch

from grader import holes
from grader.check import check
from grader.checks.attention import attend, label
from grader.checks.masked_attention import needed_tiles
from grader.isolation.outcomes import LearnerError

HEAD_DIMS = range(8, 257, 8)
KERNEL_HEAD_DIMS = (40, 48, 72, 96, 104, 160, 200, 256)
LIMITS = {"48 KB (any GPU without opting in)": 48 * 1024, "99 KB (RTX 30xx/40xx)": 99 * 1024,
          "163 KB (A100)": 163 * 1024, "227 KB (H100)": 227 * 1024}
H100 = 227 * 1024
WASTE_HEAD_DIMS = (40, 48, 72, 80, 96, 104, 160, 200)
TILING_FIELDS = ("block_m", "block_n", "head_dim_padded", "num_warps", "smem_bytes")


def _plan(ctx, head_dim, **kwargs) -> dict:
    """The learner's plan_tiling as a dict of its fields (dataclasses come back from the worker as dicts)."""
    plan = ctx.learner.plan_tiling(head_dim, **kwargs)
    what = f"plan_tiling({head_dim}{''.join(f', {k}={v}' for k, v in kwargs.items())})"
    ctx.expect(isinstance(plan, dict) and all(f in plan for f in TILING_FIELDS),
               f"{what} must return a Tiling with fields {', '.join(TILING_FIELDS)}; got {plan!r}")
    return plan


def _round16(d: int) -> int:
    return -(-d // 16) * 16


def _tiles_bytes(plan: dict, itemsize: int = 2) -> int:
    """The least shared memory a plan can need: one Q tile, and K and V tiles for each pipeline stage."""
    stages = plan.get("stages", 2)
    return (plan["block_m"] + 2 * stages * plan["block_n"]) * plan["head_dim_padded"] * itemsize


def _judge(ctx, fn, q, k, v, *, causal=False, sm_scale=None, block_m=None, block_n=None, num_warps=None,
           what_extra=""):
    """Call the learner's ``fn`` (flash_attention or emulate_attention) and judge (o, lse) against float64."""
    scale = {"sm_scale": sm_scale} if sm_scale is not None else {}
    if num_warps is not None:
        what_extra += f", {num_warps} warps"
    what = label(q, k, causal=causal, block_m=block_m, block_n=block_n)[:-1] + f", D={q.shape[-1]}{what_extra})"
    attend(ctx, q, k, v, fn=fn, what=what, block_m=block_m, block_n=block_n, num_warps=num_warps, causal=causal,
           **scale)


# ---- the plan ------------------------------------------------------------------------------

@check(points=1, hint="head_dim_padded = the smallest multiple of 16 (the mma's k step) that holds head_dim; "
                      "refuse other head dims with ValueError('head_dim must be a multiple of 8 from 8 to 256')")
def plan_head_dims(ctx):
    """Every head dim 8, 16, ..., 256 gets a plan padded to the mma step; anything else is a ValueError."""
    for d in HEAD_DIMS:
        plan = _plan(ctx, d)
        hp = plan["head_dim_padded"]
        ctx.expect(hp == _round16(d),
                   f"plan_tiling({d}).head_dim_padded is {hp}; expected {_round16(d)}, the smallest multiple of "
                   f"16 that holds {d} (Q K^T steps through the head dim 16 at a time, so at most 8 columns "
                   "of padding)")
    for bad in (0, 4, 12, 73, 260, 264, -8):
        ctx.expect_error("plan_tiling", bad, errors=("ValueError",), mentions=["multiple of 8"],
                         why=f"plan_tiling({bad}): a head dim that is not a multiple of 8 from 8 to 256")


@check(points=2, hint="count every buffer: block_m x padded head dim for Q, then block_n x padded head dim "
                      "for K and for V, once per pipeline stage; take the first candidate that fits the limit")
def plan_fits_shared_memory(ctx):
    """Plans for every head dim fit 48, 99, 163 and 227 KB, count all their tiles, and use whole warps."""
    for name, limit in LIMITS.items():
        for d in HEAD_DIMS:
            plan = _plan(ctx, d, smem_bytes=limit)
            what = f"plan_tiling({d}, smem_bytes={limit}) [{name}] = {plan}"
            bm, bn = plan["block_m"], plan["block_n"]
            ctx.expect(bm % 16 == 0 and bn % 16 == 0 and bm > 0 and bn > 0,
                       f"{what}: block_m and block_n must be positive multiples of 16 (one warp per 16 rows; "
                       "P is the A operand of an mma with k = 16)")
            ctx.expect(plan["num_warps"] > 0 and bm % (16 * plan["num_warps"]) == 0,
                       f"{what}: block_m must split into num_warps warps of whole 16-row m-tiles")
            ctx.expect(plan["smem_bytes"] <= limit, f"{what}: needs {plan['smem_bytes']} bytes of shared memory, "
                                                    f"more than the {limit} allowed")
            least = _tiles_bytes(plan)
            ctx.expect(plan["smem_bytes"] >= least,
                       f"{what}: smem_bytes {plan['smem_bytes']} is less than the tiles alone take, {least} bytes "
                       f"(Q {bm} x {plan['head_dim_padded']}, plus K and V {bn} x {plan['head_dim_padded']} for each "
                       f"of {plan.get('stages', 2)} stages, 2 bytes each)")
    ctx.expect_error("plan_tiling", 256, smem_bytes=4 * 1024, errors=("ValueError",), mentions=["shared memory"],
                     why="plan_tiling(256, smem_bytes=4096): no tile fits in 4 KB")


@check(points=1, hint="try the tallest query blocks first: each K/V tile read from global memory is reused "
                      "by block_m queries, so block_m sets the arithmetic intensity")
def plan_uses_the_budget(ctx):
    """With an H100's 227 KB every head dim gets block_m >= 64; less memory never gives bigger tiles."""
    for d in HEAD_DIMS:
        big = _plan(ctx, d, smem_bytes=H100)
        ctx.expect(big["block_m"] >= 64,
                   f"plan_tiling({d}, smem_bytes={H100}) = {big}: block_m {big['block_m']} reuses each K/V tile for "
                   "only that many queries; with 227 KB a block of at least 64 queries fits")
        small = _plan(ctx, d, smem_bytes=48 * 1024)
        ctx.expect(small["smem_bytes"] <= big["smem_bytes"],
                   f"plan_tiling({d}) uses {small['smem_bytes']} bytes with a 48 KB limit but only "
                   f"{big['smem_bytes']} with 227 KB: a larger budget should never give smaller tiles")
        bf16 = _plan(ctx, d, dtype=torch.bfloat16, smem_bytes=H100)
        ctx.expect(bf16 == big, f"plan_tiling({d}) differs between float16 ({big}) and bfloat16 ({bf16}); both "
                                "take 2 bytes per element and the same instructions")


@check(points=1, hint="padding_waste calls plan_tiling for 'this plan'; Q K^T runs over head_dim_padded and "
                      "P V over the exact head dim")
def padding_waste_table(ctx):
    """padding_waste: power of two, FlashAttention-2's round-up and this plan, for 40 ... 200."""
    table = ctx.learner.padding_waste(WASTE_HEAD_DIMS)
    ctx.expect(isinstance(table, dict) and sorted(table) == sorted(WASTE_HEAD_DIMS),
               f"padding_waste must return a dict keyed by the head dims {WASTE_HEAD_DIMS}; got {table!r:.300}")
    for d in WASTE_HEAD_DIMS:
        pow2 = 1 << (d - 1).bit_length()
        step = 32 if d <= 128 else 64
        fa2 = -(-d // step) * step
        hp = _round16(d)
        expected = {"power of two": (pow2, (pow2 - d) / pow2), "FlashAttention-2": (fa2, (fa2 - d) / fa2),
                    "this plan": (hp, (hp - d) / (hp + d))}
        for policy, (pad, waste) in expected.items():
            got = table[d].get(policy) if isinstance(table[d], dict) else None
            ctx.expect(got is not None and got[0] == pad and abs(got[1] - waste) < 1e-9,
                       f"padding_waste()[{d}][{policy!r}] is {got}; expected ({pad}, {waste:.4f})")


# ---- the emulation -------------------------------------------------------------------------

@check(points=1, given=True)
def schedule_visits_exactly_the_needed_tiles(ctx):
    """block_schedule: ascending key blocks, exactly the tiles with a visible key, masks only where needed.

    block_schedule is given code: the check counts once the emulation that walks it is written."""
    ctx.exercises("emulate_attention")
    for nq, nk, bm, bn, causal in ((300, 300, 128, 64, True), (77, 300, 64, 32, True), (300, 77, 128, 64, True),
                                   (129, 200, 64, 64, False), (40, 3, 16, 16, True)):
        schedule = ctx.learner.block_schedule(nq, nk, bm, bn, causal)
        need = needed_tiles(nq, nk, bm, bn, causal=causal)
        what = f"block_schedule(n_q={nq}, n_k={nk}, block_m={bm}, block_n={bn}, causal={causal})"
        ctx.expect([qb for qb, _ in schedule] == list(range(need.shape[0])),
                   f"{what} must list every query block in order, 0 .. {need.shape[0] - 1}")
        rows_all = torch.arange(need.shape[0] * bm)[:, None]
        cols_all = torch.arange(need.shape[1] * bn)[None, :]
        full = (cols_all < nk) & (cols_all <= rows_all + (nk - nq) if causal else rows_all >= 0)
        for qb, visits in schedule:
            kbs = [kb for kb, _ in visits]
            wanted = need[qb].nonzero().flatten().tolist()
            ctx.expect(kbs == wanted, f"{what}: query block {qb} visits key blocks {kbs}; expected {wanted}, the "
                                      "tiles holding a key some row of the block may see, in ascending order")
            for kb, needs_mask in visits:
                tile = full[qb * bm:(qb + 1) * bm, kb * bn:(kb + 1) * bn]
                ctx.expect(bool(needs_mask) == (not bool(tile.all())),
                           f"{what}: tile ({qb}, {kb}) says needs_mask={needs_mask}, but "
                           f"{'every' if tile.all() else 'not every'} (row, key) pair of it is visible")


@check(points=2, hint="the update of TODO(4e): rescale both l and acc by alpha = exp2(m * scale_log2 - m_scaled) "
                      "before adding the new tile, and round p to v's dtype before p @ v")
def emulation_matches_reference(ctx):
    """emulate_attention: head dims 40, 72, 104 (padded to 48, 80, 112), lengths that are not multiples of a block."""
    for d, nq, nk, dtype in ((40, 129, 200, torch.float32), (72, 17, 129, torch.float16),
                             (104, 130, 65, torch.float16), (72, 1, 77, torch.float32)):
        q, k, v = (ctx.randn(2, 2, nq, d, dtype=dtype), ctx.randn(2, 2, nk, d, dtype=dtype),
                   ctx.randn(2, 2, nk, d, dtype=dtype))
        _judge(ctx, "emulate_attention", q, k, v)
    q, k, v = (ctx.randn(1, 2, n, 48, dtype=torch.float16, scale=2.0) for n in (100, 150, 150))
    _judge(ctx, "emulate_attention", q, k, v, block_m=32, block_n=16, sm_scale=0.3)


@check(points=2, hint="a row that has seen only masked keys has m = -inf: use 0 for its scaled max (never "
                      "-inf - -inf), and at the end write o = 0 and lse = -inf where l == 0")
def emulation_causal(ctx):
    """emulate_attention, causal: Nq = Nk, Nq < Nk, Nq > Nk (rows that see no key), asymmetric tiles."""
    for nq, nk, bm, bn in ((150, 150, None, None), (60, 200, 16, 64), (200, 60, 64, 16), (129, 129, 128, 32),
                           (90, 40, 32, 16)):
        q = ctx.randn(1, 2, nq, 72, dtype=torch.float16, scale=2.0)
        k, v = ctx.randn(1, 2, nk, 72, dtype=torch.float16), ctx.randn(1, 2, nk, 72, dtype=torch.float16)
        _judge(ctx, "emulate_attention", q, k, v, causal=True, block_m=bm, block_n=bn)


@check(points=1, validation=True)
def kernel_bad_input(ctx):
    """flash_attention refuses head dims off the mma grid, float32 and mismatched heads, naming the problem."""
    for d in (12, 264):
        q = ctx.randn(1, 1, 8, d, dtype=torch.float16)
        ctx.expect_error("flash_attention", q, q, q, mentions=["multiple of 8"], why=f"head dim {d}")
    q = ctx.randn(1, 1, 8, 64)
    ctx.expect_error("flash_attention", q, q, q, errors=("TypeError",), mentions=["dtype"],
                     why="float32 inputs (the kernel takes float16 and bfloat16)")
    q, k = ctx.randn(1, 4, 8, 64, dtype=torch.float16), ctx.randn(1, 2, 8, 64, dtype=torch.float16)
    ctx.expect_error("flash_attention", q, k, k, mentions=["heads"], why="4 query heads and 2 key/value heads")


# ---- the CUDA source -----------------------------------------------------------------------

COMPILE_CONFIG = {"HEAD_DIM": 72, "BLOCK_M": 64, "BLOCK_N": 32, "NUM_WARPS": 2}   # 72: padded Q K^T, odd P V tail


@check(points=1, timeout=300, given=True, hint="read nvcc's first error; the TODO comments of the .cu say which "
                                               "registers each fragment holds")
def cuda_source_compiles(ctx):
    """nvcc compiles the .cu for sm_80 (A100) and sm_90 (H100), with HEAD_DIM=72 (no GPU needed).

    The .cu as released compiles (its holes are empty): the check counts once they are written."""
    ctx.exercises("flash_attention")
    if cuda_build.nvcc() is None:
        ctx.skip("nvcc not found: install the CUDA toolkit (or set CUDA_HOME) to check that the .cu compiles")
    folder = loader.source_dir(ctx.runner.source)
    cu = next(folder.glob("stage4_*.cu"), None)
    ctx.expect(cu is not None, f"no stage4_*.cu beside the stage file in {folder}")
    left = [label for label, _ in holes.unfilled_in(cu.read_text(errors="replace"), cu.name)]
    if left:                        # as released it compiles, and proves nothing: no need to run nvcc
        raise LearnerError("NotImplementedError", f"{cu.name}: {', '.join(left)} not written yet")
    archs = ("sm_80", "sm_90")
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda arch: cuda_build.compile_only(cu, arch=arch, defines=COMPILE_CONFIG), archs))
    for arch, result in zip(archs, results):
        if not result.ok:
            errors = [ln for ln in result.output.splitlines() if "error" in ln.lower()] or result.output.splitlines()
            ctx.fail(f"{cu.name} does not compile for {arch} with "
                     f"{' '.join(f'{k}={v}' for k, v in COMPILE_CONFIG.items())}: " + "; ".join(errors[:4])[:1200])


# ---- the CUDA kernel (GPU) -----------------------------------------------------------------

@check(points=3, gpu=True, sm=80, timeout=300,
       hint="Q K^T runs over the padded head dim (zero columns in shared memory), P V over the exact one: "
            "an odd number of 8-column output tiles (72 / 8 = 9) needs the ldmatrix_x2_trans tail")
def kernel_head_dims(ctx):
    """Head dims 40, 48, 72, 96, 104, 160, 200, 256 in float16 and bfloat16, Nq = 131, Nk = 257."""
    for d in KERNEL_HEAD_DIMS:
        for dtype in (torch.float16, torch.bfloat16):
            q = ctx.randn(2, 2, 131, d, dtype=dtype)
            k, v = ctx.randn(2, 2, 257, d, dtype=dtype), ctx.randn(2, 2, 257, d, dtype=dtype)
            _judge(ctx, "flash_attention", q, k, v)


@check(points=3, gpu=True, sm=80, timeout=300,
       hint="bottom-right causal: key j is visible to row i iff j <= i + (Nk - Nq); stop the key loop after the "
            "block's last visible key, and keep rows that see nothing NaN-free")
def kernel_causal(ctx):
    """Causal, every head dim, both dtypes: Nq = Nk, Nq < Nk and Nq > Nk (rows that see no key)."""
    shapes = ((200, 200), (77, 300), (300, 77))
    for i, d in enumerate(KERNEL_HEAD_DIMS):
        for j, dtype in enumerate((torch.float16, torch.bfloat16)):
            nq, nk = shapes[(i + j) % 3]
            q = ctx.randn(1, 2, nq, d, dtype=dtype, scale=2.0)
            k, v = ctx.randn(1, 2, nk, d, dtype=dtype), ctx.randn(1, 2, nk, d, dtype=dtype)
            _judge(ctx, "flash_attention", q, k, v, causal=True)


@check(points=2, gpu=True, sm=80, timeout=300,
       hint="rows past Nq and keys past Nk are zero-filled by cp.async (src-size 0); keys past Nk must also be "
            "masked to -inf in the last block")
def kernel_odd_lengths(ctx):
    """Lengths 1, 17, 127, 129, 1000 (D=72 and 160, bfloat16), causal and not."""
    for nq, nk in ((1, 1), (1, 129), (17, 17), (127, 128), (129, 1000), (1000, 129)):
        for d, causal in ((72, False), (160, True)):
            q = ctx.randn(1, 2, nq, d, dtype=torch.bfloat16)
            k, v = ctx.randn(1, 2, nk, d, dtype=torch.bfloat16), ctx.randn(1, 2, nk, d, dtype=torch.bfloat16)
            _judge(ctx, "flash_attention", q, k, v, causal=causal)


@check(points=2, gpu=True, sm=80, timeout=300,
       hint="with block_m != block_n a row can be fully masked inside a tile: keep its scaled max at 0 while its "
            "running max is -inf; with 32 rows per warp, every K/V fragment goes into both m-tiles")
def kernel_asymmetric_tiles(ctx):
    """Tiles of 64x128, 128x32, 16x64, 32x16, and 32 rows per warp (overrides), causal, rows that see no key."""
    for d, bm, bn, warps, nq, nk in ((72, 64, 128, None, 300, 300), (96, 128, 32, None, 129, 200),
                                     (48, 16, 64, None, 200, 90), (160, 32, 16, None, 150, 150),
                                     (48, 128, 64, 4, 200, 200), (72, 128, 32, 4, 300, 77)):
        q = ctx.randn(1, 2, nq, d, dtype=torch.float16, scale=2.0)
        k, v = ctx.randn(1, 2, nk, d, dtype=torch.float16), ctx.randn(1, 2, nk, d, dtype=torch.float16)
        _judge(ctx, "flash_attention", q, k, v, causal=True, block_m=bm, block_n=bn, num_warps=warps)


@check(points=1, gpu=True, sm=80, timeout=300, hint="pass the batch, head and row strides to the kernel; never assume "
                                             "a contiguous (B, H, N, D) layout")
def kernel_non_contiguous(ctx):
    """Inputs in (B, N, H, D) memory viewed as (B, H, N, D), and a custom sm_scale."""
    q, k, v = (ctx.randn(2, n, 3, 72, dtype=torch.bfloat16).transpose(1, 2) for n in (100, 140, 140))
    _judge(ctx, "flash_attention", q, k, v, sm_scale=0.2, what_extra=", (B, N, H, D) memory")
    _judge(ctx, "flash_attention", q, k, v, causal=True, what_extra=", (B, N, H, D) memory")
