"""Autotuning for the Triton stages: a small table of tile shapes per head dim, timed on a GPU.

Each stage lists the tiles worth trying as ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``,
per padded head dim (the smallest listed head dim that holds it)::

    TILES = {
        64:  [(128, 64, 4, 3), (128, 128, 8, 3)],     # first entry: the default
        128: [(128, 64, 8, 2), (128, 128, 8, 3)],
        256: [(64, 32, 4, 2)],
    }

    @tuning.autotune(TILES, key=["N_Q", "N_K", "HEAD_DIM_PAD", "CAUSAL"])
    @triton.jit
    def _kernel(..., BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr): ...

The first call with a new key (and dtype) compiles and times every entry of its head dim with
``triton.testing.do_bench`` and keeps the fastest; later calls with that key reuse it.  Timing
only pays for itself on long sequences, so :func:`plan` says when to: on a GPU, for at least
``TUNE_FROM`` (query, key) pairs, and never when the caller fixed the tile or asked for
per-block counts (whose shape depends on the tile), nor where ``WORKBOOK_AUTOTUNE=0`` (the
grader's workers).  Otherwise it launches ``kernel.fn``, the
kernel without the tuner, with the table's first entry, or on the CPU the interpreter's small
tile, so that CPU-sized tests still cross block edges.
"""

from __future__ import annotations

import contextlib
import os

from kernels import runtime

import triton  # after kernels.runtime: it decides TRITON_INTERPRET

#: (query, key) pairs per (batch, head) from which the autotuner is used (2048 x 2048).
TUNE_FROM = 2048 * 2048
#: Set to 0, no kernel is autotuned: every call takes its table's first entry.  The grader's
#: workers set it (grader/isolation/sandbox.py): a check needs the right answer, not the fastest tile.
AUTOTUNE_ENV = "WORKBOOK_AUTOTUNE"

# The forward kernels of stages 3 and 5-9.  Bigger tiles reuse each K/V load for more queries
# but need more registers and shared memory; more stages hide more load latency, each costing
# a K and a V buffer.  Short windows favour short tiles, which waste less at the window's edges.
# The first entry of each row is the default, used untimed on short sequences: it compiles for
# float32 too (D=128: 128 x 128 tiles with 3 stages of float32 K and V do not fit in shared
# memory; the autotuner skips such entries).  At D=256 a 128 x 64 tile with 2 stages already
# fills most of an H100's shared memory.
#
# One table per amount of shared memory a block may use; a GPU takes the table of the largest
# budget it has (for_smem).  The H100 table was tuned by timing and fits an A100 too.  A smaller
# budget keeps the entries that fit it, and its first entry (the untimed default) fits in float32,
# which needs about twice the shared memory of float16: on an RTX 4090 a long float16 sequence
# still gets the autotuner's pick of the larger tiles.  tests/test_targets.py compiles every
# entry for its GPUs (sm_75 ... sm_120) and checks each against the GPU's shared memory.
FORWARD_TILES_H100 = {
    64: [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3)],
    128: [(128, 64, 8, 2), (128, 128, 8, 3), (128, 128, 8, 2), (64, 128, 4, 3), (64, 64, 4, 3)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 2), (64, 64, 8, 2)],
}
FORWARD_TILES_99KB = {
    64: FORWARD_TILES_H100[64],
    128: [(128, 32, 8, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 2)],
    256: [(32, 32, 4, 1), (64, 32, 4, 1), (64, 32, 4, 2), (32, 32, 4, 2)],
}
# A T4: no cp.async, so deep pipelines buy nothing.  At D=256 only a 16 x 16 tile fits in float32
# (48 KB of the 64; 16 x 32 needs 80 KB), so it is the default; float16 may tune to the larger ones.
FORWARD_TILES_64KB = {
    64: [(64, 32, 4, 2), (64, 64, 4, 2)],
    128: [(32, 32, 4, 1), (64, 32, 4, 1)],
    256: [(16, 16, 4, 1), (16, 32, 4, 1), (32, 32, 4, 1)],
}
FORWARD_TILES_BY_SMEM = {
    227 * 1024: FORWARD_TILES_H100,              # sm_90 (H100, H200), sm_100
    163 * 1024: FORWARD_TILES_H100,              # sm_80 (A100)
    99 * 1024: FORWARD_TILES_99KB,               # sm_86, sm_89, sm_120 (RTX 30/40/50, A10, L4)
    64 * 1024: FORWARD_TILES_64KB,               # sm_75 (T4, RTX 20)
}

#: The interpreter's forward tile: small, so tests with a few dozen rows cross block edges.
FORWARD_INTERPRETER_TILE = (32, 32, 4, 1)


def smem_per_block() -> int:
    """Shared memory one block may use on this GPU, in bytes (the largest table's budget on the CPU,
    where the interpreter has no such limit and the tables only decide the default tiles' shape)."""
    if not runtime.ON_GPU:
        return max(FORWARD_TILES_BY_SMEM)
    import torch
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)


def for_smem(tables: dict, smem: int) -> dict:
    """The table for a GPU with ``smem`` bytes per block: the largest budget that is not above it."""
    fits = [budget for budget in tables if budget <= smem]
    return tables[max(fits) if fits else min(tables)]


#: This GPU's forward table (see FORWARD_TILES_BY_SMEM).
FORWARD_TILES = for_smem(FORWARD_TILES_BY_SMEM, smem_per_block())


#: What no tile fits: (shared memory per block, dtype, padded head dim) -> the kernels concerned.
#: On a T4 (64 KB) stage 9's dK/dV kernel holds K, V, dK and dV tiles of BLOCK_N x 256 in float32
#: beside its Q and dO tiles: 16 x 16 tiles with one stage already need the whole 64 KB
#: (tests/test_targets.py compiles them for sm_75 and proves it).
DOES_NOT_FIT = {(64 * 1024, "float32", 256): "stage 9's dK/dV kernel"}


def check_fits(dtype, head_dim_pad: int, *, kernels: str) -> None:
    """Refuse, with the reason and a way out, a configuration that no tile fits on this GPU.

    ``kernels`` names what is about to launch, as in DOES_NOT_FIT ("stage 9's dK/dV kernel").
    """
    if not runtime.ON_GPU:
        return
    smem = smem_per_block()
    name = str(dtype).replace("torch.", "")
    for (budget, dt, d), what in DOES_NOT_FIT.items():
        if smem <= budget and dt == name and d == head_dim_pad and what == kernels:
            raise ValueError(
                f"{name} at head dim {head_dim_pad} (padded) does not fit {what} on this GPU: it has "
                f"{smem // 1024} KB of shared memory per block, and even the smallest tile needs more. "
                f"Use float16 here (same tiles, half the bytes), or a GPU with more shared memory "
                f"(an A100, L4 or newer).")


def gqa_pack(group: int) -> int:
    """Query heads that one program takes together: the whole GQA group when it is 2, 4 or 8 heads, else 1.

    The heads of a group read the same keys and a mask depends on the query's position alone, so
    one 128-row tile can hold 4 heads x 32 positions instead of 128 positions of one head.  The
    tile then spans 32 positions: its diagonal band and window edge are a quarter as wide, and
    fewer of its key blocks need a mask.  (Stage 9's dQ kernel and the TMA forward do this.)
    """
    return group if group in (2, 4, 8) else 1


def _entries(tiles: dict, head_dim_pad: int) -> list[tuple[int, int, int, int]]:
    """The table's row for a padded head dim: the smallest listed head dim that holds it."""
    fits = [d for d in sorted(tiles) if d >= head_dim_pad]
    return tiles[fits[0] if fits else max(tiles)]


def autotune(tiles: dict, key: list[str], pre_hook=None):
    """``triton.autotune`` over every tile of ``tiles``, pruned to the call's HEAD_DIM_PAD.

    ``pre_hook(nargs)`` runs before each configuration is launched, with its meta-parameters in
    ``nargs`` (TMA descriptors take their tile shape from it)."""
    by_dim = {d: [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=pre_hook)
                  for bm, bn, w, s in rows] for d, rows in tiles.items()}

    def prune(configs, named_args, **kwargs):
        head_dim_pad = kwargs.get("HEAD_DIM_PAD", named_args.get("HEAD_DIM_PAD"))
        return _entries(by_dim, head_dim_pad)

    return triton.autotune(configs=[c for row in by_dim.values() for c in row], key=key,
                           prune_configs_by={"early_config_prune": prune})


@contextlib.contextmanager
def untuned():
    """Within it, every launch takes its table's first tile untimed, as where ``WORKBOOK_AUTOTUNE=0``.

    Autotuning compiles every tile of a table before the first long call, several seconds each:
    worth it for a benchmark, not for a measurement that needs only one tile (peak memory, a
    notebook's first timing of a learner's kernel).
    """
    before = os.environ.get(AUTOTUNE_ENV)
    os.environ[AUTOTUNE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(AUTOTUNE_ENV, None)
        else:
            os.environ[AUTOTUNE_ENV] = before


def timing() -> bool:
    """Whether launches may be timed at all: on a GPU, and not where ``WORKBOOK_AUTOTUNE=0``."""
    return runtime.ON_GPU and os.environ.get(AUTOTUNE_ENV, "1") != "0"


def long_enough(n_q: int, n_k: int) -> bool:
    """Whether a launch of ``n_q`` x ``n_k`` pairs a head is timed: from ``TUNE_FROM`` pairs, where
    ``timing()``."""
    return n_q * n_k >= TUNE_FROM and timing()


@contextlib.contextmanager
def tuned_from(pairs: int):
    """Within it, launches of at least ``pairs`` (query, key) pairs a head are timed as from
    ``TUNE_FROM``: for a caller that knows a shorter shape will be called often enough to pay
    for the timing (the attention op's plans)."""
    global TUNE_FROM
    before = TUNE_FROM
    TUNE_FROM = min(before, pairs)
    try:
        yield
    finally:
        TUNE_FROM = before


def first_entry(tiles: dict, head_dim_pad: int, interpreter_tile: tuple) -> tuple[int, int, int, int]:
    """The tile used without timing: the table's first entry on a GPU, the interpreter's on the CPU."""
    return _entries(tiles, head_dim_pad)[0] if runtime.ON_GPU else interpreter_tile


def plan(kernel, tiles: dict, head_dim_pad: int, n_q: int, n_k: int, *, interpreter_tile: tuple,
         block_m: int | None = None, block_n: int | None = None, counting: bool = False):
    """``(kernel to launch, meta-parameters to pass it)`` for one call.

    The autotuner (``kernel`` itself, no meta-parameters: it adds them) on a GPU for at least
    ``TUNE_FROM`` pairs when the caller fixed no tile and counts no blocks.  Otherwise the bare
    kernel ``kernel.fn`` with the table's first entry, the interpreter's tile on the CPU, or
    the ``block_m``/``block_n`` asked for.
    """
    fixed = block_m is not None or block_n is not None or counting
    if not fixed and long_enough(n_q, n_k):
        return kernel, {}
    bm, bn, warps, stages = first_entry(tiles, head_dim_pad, interpreter_tile)
    return kernel.fn, {"BLOCK_M": block_m if block_m is not None else bm,
                       "BLOCK_N": block_n if block_n is not None else bn,
                       "num_warps": warps, "num_stages": stages}
