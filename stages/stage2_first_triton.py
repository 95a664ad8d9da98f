"""Stage 2: a first Triton kernel: program ids, pointers, strides, masks, block loops.

What you will learn
-------------------
* **Program ids.**  A Triton kernel is written for *one program*; the launch grid says how many
  programs run, and ``tl.program_id(0)`` tells each one which piece of the work is its own.
* **Pointers and strides.**  A tensor is one flat run of memory.  Element ``(r, c)`` of an
  ``(M, N)`` tensor lives at ``base + r * stride(0) + c * stride(1)``, whatever the layout:
  a transposed view or a strided slice only changes the strides.  A kernel that honours the
  strides works on any view without a copy.
* **Blocks and masks.**  A program works on a *block* of elements at once
  (``tl.arange(0, BLOCK_N)``, a power of two).  Rows are rarely a multiple of the block, so the
  last block hangs over the edge: a *mask* says which lanes are real, loads fill the others with
  a harmless value, and stores skip them.
* **Block loops.**  A row longer than one block is read in a ``for`` loop over column blocks,
  carrying an accumulator (a sum, a running max) from one block to the next.
* **The one-pass online softmax** of stage 1 inside a kernel: one read of the row for the
  statistics, one more to write the result.

Two kernels, each next to the Python wrapper that checks the inputs, allocates the output,
builds the grid and launches it:

    weighted_row_sum(x, w)   x (M, N), w (N,)  ->  (M,) float32, x @ w
    softmax(x)               x (M, N)          ->  (M, N) in x's dtype, softmax of each row

On the CPU they run in Triton's interpreter (``kernels.runtime`` sets ``TRITON_INTERPRET=1``),
so small blocks keep it quick; on a GPU they are compiled.
"""

from __future__ import annotations

import torch

from kernels import runtime, validate

import triton  # after kernels.runtime: it decides TRITON_INTERPRET
import triton.language as tl


# ----------------------------------------------------------------------------------------------
# Part 1: a weighted row sum, out[r] = sum over c of x[r, c] * w[c]
#
# The grid is one program per block of BLOCK_M rows.  Program ``pid`` owns rows
# pid * BLOCK_M ... pid * BLOCK_M + BLOCK_M - 1 and walks along them BLOCK_N columns at a
# time.  With M = 5, N = 10, BLOCK_M = 2, BLOCK_N = 4 (digits: which program; ``.`` a lane
# that hangs over the edge and is masked off)::
#
#                 block 0     block 1     block 2
#     columns     0 1 2 3     4 5 6 7     8 9 . .
#     row 0       0 0 0 0     0 0 0 0     0 0 . .      program 0
#     row 1       0 0 0 0     0 0 0 0     0 0 . .
#     row 2       1 1 1 1     1 1 1 1     1 1 . .      program 1
#     row 3       1 1 1 1     1 1 1 1     1 1 . .
#     row 4       2 2 2 2     2 2 2 2     2 2 . .      program 2
#     (row 5)     . . . .     . . . .     . . . .      (masked: row 5 does not exist)
#
# The grid is cdiv(M, BLOCK_M) programs; the loop runs cdiv(N, BLOCK_N) times.  Each
# iteration loads a (BLOCK_M, BLOCK_N) tile of x and a (BLOCK_N,) piece of w, and adds their
# products into a float32 accumulator of the same tile shape.  Only at the end is the
# accumulator summed along its columns: one reduction per program instead of one per block.
#
# The output is float32 whatever x's dtype: a sum of thousands of float16 products loses most
# of its digits if it is rounded to float16 along the way, so the kernel multiplies and adds in
# float32 and returns that.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _weighted_row_sum_kernel(
    X, W, OUT,                      # pointers to the first element of x, w and out
    M, N,                           # x is (M, N)
    stride_xm, stride_xn,           # x[r, c] is at X + r * stride_xm + c * stride_xn
    stride_w,                       # w[c] is at W + c * stride_w
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)                                    # which block of rows
    # int64 row numbers: r * stride_xm overflows int32 once a tensor passes 2**31 elements.
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)   # (BLOCK_M,) rows of this program
    row_ok = rows < M                                         # False past the last row
    offs_n = tl.arange(0, BLOCK_N)                            # (BLOCK_N,) 0, 1, ..., BLOCK_N - 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)      # running products, one per lane

    for start in range(0, N, BLOCK_N):
        cols = start + offs_n                                 # (BLOCK_N,) columns of this block
        # TODO(2a): the addresses and the mask of this block.
        #   col_ok = which of ``cols`` are real columns (< N)
        #   x_ptrs = a (BLOCK_M, BLOCK_N) tile of pointers: X + rows * stride_xm + cols * stride_xn,
        #            rows down the first axis ([:, None]) and cols along the second ([None, :])
        #   w_ptrs = the (BLOCK_N,) pointers W + cols * stride_w
        pass
        # TODO(2b): load the x tile (masked by row_ok and col_ok, 0 where masked) and the w
        # block (masked by col_ok), convert both to float32, and add x * w into acc
        # (w broadcast down the rows with [None, :]).
        pass

    # TODO(2c): sum acc along its columns (axis=1) and store the BLOCK_M results at OUT + rows,
    # only for rows that exist.
    pass


def _check_device(x: torch.Tensor, name: str) -> None:
    if x.device.type != runtime.DEVICE.type:
        raise ValueError(f"{name} is on {x.device}, but the kernels here run on {runtime.DEVICE}: "
                         f"move it with {name}.to({runtime.DEVICE.type!r})")


def _block_n(block_n, n: int, *, cpu: int, gpu_max: int) -> int:
    """The column block: a power of two, small in the interpreter, up to ``gpu_max`` on a GPU."""
    if block_n is not None:
        return validate.block_size(block_n, "block_n")
    return runtime.pick(cpu=cpu, gpu=min(max(triton.next_power_of_2(n), 16), gpu_max))


def weighted_row_sum(x: torch.Tensor, w: torch.Tensor, *, block_n: int | None = None) -> torch.Tensor:
    """``x @ w`` one row at a time: ``out[r] = sum_c x[r, c] * w[c]``.

    x: (M, N), any strides (a transposed view or a strided slice works without a copy).
    w: (N,), same dtype and device as x.  float16 or float32 (and bfloat16 on a GPU).
    Returns (M,) **float32**: products and sums are computed in float32 whatever the dtype.
    ``block_n`` (a power of two >= 16) overrides how many columns one loop iteration reads.
    """
    validate.tensor(x, "x", ndim=2)
    validate.tensor(w, "w", ndim=1)
    M, N = x.shape
    if w.shape[0] != N:
        raise ValueError(f"w has {w.shape[0]} elements but x has {N} columns (x is {tuple(x.shape)}); "
                         f"expected w of shape ({N},), one weight per column")
    if w.dtype != x.dtype:
        raise TypeError(f"x and w must share a dtype, got x {x.dtype} and w {w.dtype}")
    runtime.check_dtype(x.dtype, name="x")
    if w.device != x.device:
        raise ValueError(f"x and w must be on one device, got x on {x.device} and w on {w.device}")
    _check_device(x, "x")

    bn = _block_n(block_n, N, cpu=64, gpu_max=1024)
    bm = runtime.pick(cpu=16, gpu=4)
    out = torch.empty(M, device=x.device, dtype=torch.float32)                  # (M,)
    grid = (triton.cdiv(M, bm),)
    _weighted_row_sum_kernel[grid](
        x, w, out, M, N,
        x.stride(0), x.stride(1), w.stride(0),
        BLOCK_M=bm, BLOCK_N=bn,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Part 2: softmax over rows longer than one block
#
# The textbook softmax makes three passes over each row:
#
#     m = max(x)                    read x once
#     l = sum(exp(x - m))           read x again
#     y = exp(x - m) / l            read x a third time, write y
#
# Softmax is memory-bound: the arithmetic is a few instructions per element, and the time
# goes into moving x between memory and the chip.  Three reads and a write is four trips.
# The online softmax of stage 1 finds m and l in *one* read: it keeps a running max m and a
# running sum l, and whenever a block raises the max from m to m_new, every term already in l
# was computed against the old max and is rescaled by exp(m - m_new).  So this kernel reads
# each row twice and writes it once: three trips instead of four, a quarter less traffic.
# (When a whole row fits in one block, Triton's fused-softmax tutorial keeps it in registers
# and reads it once; this kernel handles rows of any length.  Attention, in stage 3, needs no
# second pass at all: it rescales its output instead.)
#
# One program per row; each row is walked BLOCK_N columns at a time, twice:
#
#     pass 1 (statistics)    for each block:  m_new = max(m, max(block))
#                                             l = l * exp(m - m_new) + sum(exp(block - m_new))
#     pass 2 (write)         for each block:  y = exp(block - m) / l
#
# Edge cases, as the reference defines them (kernels.reference.softmax): -inf entries (masked
# positions) get probability 0; a row that is all -inf gives zeros, not NaN; values of +-1e4
# never overflow, because exp is only ever taken of x - max <= 0.  The lanes past the end of
# the row are loaded as -inf, so they add exp(-inf) = 0 to the sum.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _softmax_kernel(
    X, OUT,
    N,                              # row length
    stride_xm, stride_xn,           # x[r, c] is at X + r * stride_xm + c * stride_xn
    stride_om, stride_on,           # out[r, c] likewise
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)                       # one program per row
    x_row = X + row * stride_xm                               # pointer to x[row, 0]
    o_row = OUT + row * stride_om                             # pointer to out[row, 0]
    offs_n = tl.arange(0, BLOCK_N)
    m_i = float("-inf")                                       # running max (a float32 scalar)
    l_i = 0.0                                                 # running sum of exp(x - m_i)

    for start in range(0, N, BLOCK_N):                        # pass 1: statistics
        cols = start + offs_n
        # TODO(2d): load this block of the row in float32, with -inf in the lanes past N, then
        # the online update of stage 1: m_new = max(m_i, max of the block); rescale l_i by
        # exp(m_i - m_new) and add the block's sum of exp(x - m_new).  NaN trap: while the row
        # has shown only -inf, m_new is -inf and -inf - (-inf) is NaN; subtract 0 instead then.
        pass

    # TODO(2e): the numbers pass 2 divides by: m_safe = m_i, or 0 when the row is all -inf,
    # and l_safe = l_i, or 1 when l_i is 0 (an all -inf row then gives exp(-inf) / 1 = 0).
    pass

    for start in range(0, N, BLOCK_N):                        # pass 2: write
        cols = start + offs_n
        # TODO(2f): load the block again (masked, -inf past N), compute exp(x - m_safe) / l_safe
        # and store it at o_row + cols * stride_on in OUT's dtype (OUT.dtype.element_ty), masked.
        pass


def _softmax_warps(block_n: int) -> int:
    """More warps for wider blocks, so each thread holds a handful of elements (GPU only)."""
    return 16 if block_n >= 4096 else 8 if block_n >= 2048 else 4


def softmax(x: torch.Tensor, *, block_n: int | None = None) -> torch.Tensor:
    """Softmax of each row of ``x``, reading every row in blocks of ``block_n`` columns.

    x: (M, N), any N (rows longer than one block are looped over), any strides; float16 or
    float32 (and bfloat16 on a GPU).  Returns (M, N) contiguous, in x's dtype; computed in
    float32.  -inf entries get 0; an all -inf row gives zeros, never NaN.
    """
    validate.tensor(x, "x", ndim=2)
    runtime.check_dtype(x.dtype, name="x")
    _check_device(x, "x")
    M, N = x.shape
    bn = _block_n(block_n, N, cpu=64, gpu_max=4096)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)                     # (M, N)
    _softmax_kernel[(M,)](
        x, out, N,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK_N=bn, num_warps=_softmax_warps(bn),
    )
    return out


