"""Checks for stage 2: a weighted row sum and a one-pass row softmax in Triton.

Each check computes two references before it calls the learner's code (on the CPU the worker
shares the inputs' memory, so a kernel that wrote into its input must not move the target):
float64, the truth, and plain PyTorch in the input's dtype, the baseline of the tolerance rule
(kernels/tolerance.py): weighted sums as ``(x * w).sum(-1)``, softmax as
``reference.softmax(x, compute_dtype=x.dtype)``.  These kernels make no ``tl.dot``, so float32
is judged against float32, not TF32.
"""

from __future__ import annotations

from kernels import reference, runtime

import torch

from grader import diagnose
from grader.check import check

MARGIN = 128    # columns of NaN past the end of each row in the edge checks (more than any block)


# -- inputs ---------------------------------------------------------------------------------------
def _with_nan_margin(ctx, rows, n, *, dtype=torch.float32, scale=1.0):
    """An (rows, n) view of a wider tensor whose extra columns are NaN.

    A kernel that reads past column n - 1 (a missing or wrong mask) picks up the NaN.  On the
    CPU the worker gets the view as it is; on a GPU moving it there makes it contiguous, so the
    check then sees only the ordinary edge.
    """
    wide = ctx.randn(rows, n + MARGIN, dtype=dtype, scale=scale)
    wide[:, n:] = float("nan")
    return wide[:, :n]


def _blocks(col: int, n: int, block: int) -> str:
    """Where column ``col`` falls in the blocks the kernel's loop reads: '... block 2 of 3, the last, partial'."""
    count = -(-n // block)
    k = col // block
    text = f"column {col} is in column block {k} of {count} ({block} columns each"
    if k == count - 1 and n % block:
        text += f"; the last block, partial: {n % block} of its {block} lanes are real"
    return text + ")"


def _judge(ctx, out, x, ref, baseline, *, name, block, n):
    """ctx.close_softmax for a softmax output (r, c), plus which column block of the loop holds the worst element."""
    def where(out):
        if not (isinstance(out, torch.Tensor) and out.shape == ref.shape and out.numel()):
            return ""
        got, want = out.detach().double(), ref.double()
        err = (got - want).abs()
        err = torch.where(got == want, torch.zeros_like(err), err).nan_to_num(nan=float("inf"))
        worst = torch.unravel_index(torch.argmax(err), err.shape)
        return _blocks(int(worst[1]), n, block)
    ctx.close_softmax(out, x, ref, baseline, name=name, block=block, extra=where)


# -- weighted_row_sum -----------------------------------------------------------------------------
def _wrs_refs(x, w):
    ref = (x.double() * w.double()).sum(-1)                       # (M,) float64, the truth
    base = (x.to(x.dtype) * w.to(x.dtype)).sum(-1)                # plain PyTorch in x's dtype (M,)
    return ref, base


def _wrs_floor(x, w) -> float:
    """The tolerance's floor for a float32 row sum: a few roundings of its largest partial sum.

    A sum rounds its partial sums, not its result: when the terms cancel (a row summing to 2
    through partial sums of 20) float32 errs in proportion to the partial sums.  Any order that
    adds contiguous chunks (a block loop of tree sums, PyTorch's) has partial sums of at most
    twice the largest prefix sum in magnitude.
    """
    prefix = (x.double() * w.double()).cumsum(-1).abs()
    return 4 * torch.finfo(torch.float32).eps * (1.0 + 2 * float(prefix.max()))


def _wrs_close(ctx, x, w, *, label, block_n=None, device=None):
    """Judge the learner's weighted_row_sum(x, w); ``device`` computes the references (the GPU for real sizes)."""
    xs, ws = (x.to(device), w.to(device)) if device is not None else (x, w)
    ref, base = _wrs_refs(xs, ws)
    kwargs = {} if block_n is None else {"block_n": block_n}
    out = ctx.learner.weighted_row_sum(x, w, **kwargs)
    name = f"weighted_row_sum, x {tuple(x.shape)} {label}"
    ctx.expect_dtype(out, torch.float32, name=f"{name} (the sum is returned in float32)")
    ctx.close(out, ref, base, name=name, dims=("r",), floor=_wrs_floor(xs, ws),
              explain=lambda allowed: diagnose.row_sum(out, x, w, allowed=allowed, block=block_n))
    return out


@check(points=2, hint="loop over every column block, `for start in range(0, N, BLOCK_N)`, mask columns "
                      "with cols < N and rows with rows < M, and load masked lanes as 0 (other=0.0)")
def weighted_row_sum_awkward_sizes(ctx):
    """N = 1, 17, 127, 128, 129, 1000 and M not a multiple of the row block, several column blocks."""
    for m, n, bn in ((3, 1, 16), (5, 17, 16), (1, 127, 64), (17, 128, 64), (7, 129, 64), (33, 129, 16),
                     (4, 1000, 64)):
        x, w = ctx.randn(m, n, scale=2.0), ctx.randn(n)
        _wrs_close(ctx, x, w, block_n=bn, label=f"with block_n={bn}")


@check(points=1, hint="the last column block hangs past the end of the row: load with "
                      "mask=row_ok[:, None] & col_ok[None, :] and other=0.0, and w with mask=col_ok")
def weighted_row_sum_masks_the_edge(ctx):
    """Lanes past the last column must not be read: the memory just past each row holds NaN."""
    for m, n in ((5, 17), (3, 100)):
        x = _with_nan_margin(ctx, m, n, scale=2.0)
        w = _with_nan_margin(ctx, 1, n)[0]
        ref, base = _wrs_refs(x, w)
        out = ctx.learner.weighted_row_sum(x, w, block_n=64)
        if isinstance(out, torch.Tensor) and out.shape == ref.shape and bool(out.isnan().any()):
            rows = out.isnan().nonzero().flatten().tolist()
            ctx.fail(f"weighted_row_sum, x {tuple(x.shape)} (a view whose memory past column {n - 1} holds NaN), "
                     f"block_n=64: out is NaN at rows {rows[:8]}: the kernel read past the end of a row "
                     f"(columns {n}..63 of the only column block) and multiplied what it found there")
        ctx.close(out, ref, base, name=f"weighted_row_sum, x {tuple(x.shape)} with NaN past each row", dims=("r",),
                  floor=_wrs_floor(x, w))


@check(points=1, hint="address x[r, c] as X + r * stride_xm + c * stride_xn with the strides the wrapper "
                      "passes; never assume stride_xn == 1 or stride_xm == N")
def weighted_row_sum_non_contiguous(ctx):
    """x as a transposed view (column stride M) and as a strided slice (row stride 6, column stride 3)."""
    xt = ctx.randn(130, 9).t()                               # (9, 130), strides (1, 9)
    _wrs_close(ctx, xt, ctx.randn(130), block_n=64, label="transposed view, strides (1, 9)")
    xs = ctx.randn(40, 200)[::2, 1::3]                       # (20, 67), strides (400, 3)
    ws = ctx.randn(3 * 67)[::3]                              # (67,), stride 3
    _wrs_close(ctx, xs, ws, block_n=16, label="strided slice, strides (400, 3), w stride 3")


@check(points=1, hint="convert the loaded blocks with .to(tl.float32) before multiplying, keep acc in "
                      "float32, and return float32 (the wrapper allocates out as float32)")
def weighted_row_sum_float16(ctx):
    """float16 x and w: the products and their sum are float32, as accurate as PyTorch or better."""
    x, w = ctx.randn(6, 300, dtype=torch.float16, scale=2.0), ctx.randn(300, dtype=torch.float16)
    _wrs_close(ctx, x, w, block_n=64, label="float16")


@check(points=1, validation=True)
def weighted_row_sum_bad_input(ctx):
    """Wrong rank, mismatched lengths, mixed dtypes (and bfloat16 on the CPU) raise errors that name them."""
    x, w = ctx.randn(4, 10), ctx.randn(10)
    ctx.expect_error("weighted_row_sum", x[None], w, mentions=["x"], why="x of rank 3")
    ctx.expect_error("weighted_row_sum", x, x, mentions=["w"], why="w of rank 2")
    ctx.expect_error("weighted_row_sum", x, ctx.randn(11), mentions=["w"], why="w of 11 elements for 10 columns")
    ctx.expect_error("weighted_row_sum", x, w.half(), mentions=["dtype"], why="x float32 with w float16")
    ctx.expect_error("weighted_row_sum", x.long(), w.long(), errors=("TypeError",), mentions=["x"],
                     why="x of dtype int64")
    if not runtime.ON_GPU:
        ctx.expect_error("weighted_row_sum", x.bfloat16(), w.bfloat16(), errors=("TypeError",),
                         mentions=["bfloat16"], why="bfloat16 on the CPU (refuse it with runtime.check_dtype)")


@check(points=1, gpu=True, hint="convert bfloat16 blocks to float32 before multiplying")
def weighted_row_sum_bfloat16(ctx):
    """bfloat16 x and w on a GPU, several column blocks."""
    x, w = ctx.randn(300, 3000, dtype=torch.bfloat16, scale=2.0), ctx.randn(3000, dtype=torch.bfloat16)
    _wrs_close(ctx, x, w, label="bfloat16 (default blocks)")
    _wrs_close(ctx, x, w, block_n=256, label="bfloat16 with block_n=256")


@check(points=1, gpu=True, hint="row offsets past 2**31 elements need int64; check the grid covers every row")
def weighted_row_sum_large(ctx):
    """A real size: x (4096, 8192) in float32 and float16, the wrapper's own block sizes."""
    for dtype in (torch.float32, torch.float16):
        x, w = ctx.randn(4096, 8192, dtype=dtype), ctx.randn(8192, dtype=dtype)
        _wrs_close(ctx, x, w, label=f"{dtype} (default blocks)", device=runtime.DEVICE)


# -- softmax --------------------------------------------------------------------------------------
def _softmax_close(ctx, x, *, label, block_n=None, device=None):
    """Judge the learner's softmax(x); ``device`` computes the references (the GPU for real sizes)."""
    on = x.to(device) if device is not None else x
    ref = reference.softmax(on)                                    # float64, the truth
    base = reference.softmax(on, compute_dtype=x.dtype)            # plain PyTorch in x's dtype
    kwargs = {} if block_n is None else {"block_n": block_n}
    out = ctx.learner.softmax(x, **kwargs)
    name = f"softmax, x {tuple(x.shape)} {label}"
    ctx.expect_dtype(out, x.dtype, name=f"{name} (the output keeps x's dtype)")
    if block_n is None:
        ctx.close_softmax(out, x, ref, base, name=name)
    else:
        _judge(ctx, out, x, ref, base, name=name, block=block_n, n=x.shape[1])
    return out


@check(points=2, hint="pass 1 must visit every column block and rescale l by exp(m - m_new) whenever the "
                      "running max grows; lanes past N must load as -inf so they add exp(-inf) = 0 to l")
def softmax_awkward_lengths(ctx):
    """Rows of length 1, 17, 127, 128, 129 and 1000: one block, exact blocks, a partial last block."""
    for m, n, bn in ((3, 1, 16), (4, 17, 16), (2, 127, 64), (3, 128, 64), (5, 129, 64), (3, 129, 16),
                     (2, 1000, 64)):
        _softmax_close(ctx, ctx.randn(m, n, scale=3.0), block_n=bn, label=f"with block_n={bn}")


def _clean_without_nan(ctx, x, n) -> bool:
    """Whether the NaN came from past the row: the same rows, with 0 in place of the NaN beyond them,
    come out free of NaN (an output never written, or NaN made inside the row, stays NaN)."""
    zeros = x._base.clone().nan_to_num_(0.0)[:, :n] if x._base is not None else x.clone()
    probe = ctx.learner.softmax(zeros, block_n=64)
    return isinstance(probe, torch.Tensor) and probe.shape == x.shape and not bool(probe.isnan().any())


@check(points=1, hint="mask every load and store with cols < N: a load without a mask reads the next "
                      "row (or past the tensor), a store without one overwrites it")
def softmax_masks_the_edge(ctx):
    """Lanes past the last column must not be read: the memory just past each row holds NaN."""
    n = 100
    x = _with_nan_margin(ctx, 4, n, scale=3.0)
    ref, base = reference.softmax(x), reference.softmax(x, compute_dtype=x.dtype)
    out = ctx.learner.softmax(x, block_n=64)
    if isinstance(out, torch.Tensor) and out.shape == ref.shape and bool(out.isnan().any()) and _clean_without_nan(
            ctx, x, n):
        rows = out.isnan().any(dim=1).nonzero().flatten().tolist()
        ctx.fail(f"softmax, x {tuple(x.shape)} (a view whose memory past column {n - 1} holds NaN), block_n=64: "
                 f"rows {rows} came out with NaN: the kernel read columns {n}..127 of the last block, "
                 "past the end of the row, and let them into the max or the sum")
    _judge(ctx, out, x, ref, base, name=f"softmax, x {tuple(x.shape)} with NaN past each row", block=64, n=n)


@check(points=1, hint="subtract the running max before exp: exp(1e4) is inf in float32")
def softmax_large_values(ctx):
    """Values of +-1e4 must not overflow, with the row max in the first block or in the last one."""
    x = ctx.uniform(4, 300, low=-1e4, high=1e4)
    x[0, 290] = 1e4                        # the max arrives in the last (partial) block
    x[1, 0] = 1e4                          # ... or in the first
    x[2] = ctx.uniform(300, low=-1e4, high=-9e3)   # every value far below zero
    _softmax_close(ctx, x, block_n=64, label="values in [-1e4, 1e4]")


@check(points=1, hint="while a row has shown only -inf, m_new is -inf and exp(-inf - (-inf)) is NaN: "
                      "subtract 0 instead (m_safe), and divide by 1 where l is 0")
def softmax_minus_inf(ctx):
    """-inf entries (masked positions), including whole blocks and whole rows of them."""
    x = ctx.randn(6, 200, scale=2.0)
    x[0, :150] = float("-inf")             # the first blocks of a row are all -inf
    x[1, ::3] = float("-inf")              # scattered -inf entries
    x[2, :] = float("-inf")                # a row that is all -inf: zeros, not NaN
    x[3, 1:] = float("-inf")               # only the first entry survives
    x[4, :-1] = float("-inf")              # only the last entry survives, in a partial block
    _softmax_close(ctx, x, block_n=64, label="with -inf entries and an all -inf row (row 2)")
    _softmax_close(ctx, x[2:3, :17].clone(), block_n=16, label="one row, all -inf")


@check(points=1, hint="address x[r, c] as X + r * stride_xm + c * stride_xn, and out with its own strides")
def softmax_non_contiguous(ctx):
    """x as a transposed view (column stride M) and as a strided slice of a larger tensor."""
    _softmax_close(ctx, ctx.randn(150, 5, scale=3.0).t(), block_n=64, label="transposed view, strides (1, 5)")
    _softmax_close(ctx, ctx.randn(12, 400, scale=3.0)[::3, 7::2], block_n=64,
                   label="strided slice, strides (1200, 2)")


@check(points=1, hint="compute in float32 (.to(tl.float32) after the load) and store in OUT.dtype.element_ty")
def softmax_float16(ctx):
    """float16 in, float16 out, as accurate as PyTorch's float16 softmax."""
    _softmax_close(ctx, ctx.randn(4, 333, dtype=torch.float16, scale=4.0), block_n=64, label="float16")


@check(points=1, validation=True)
def softmax_bad_input(ctx):
    """Wrong rank and unsupported dtypes (bfloat16 on the CPU, int, float64) raise errors that name x."""
    x = ctx.randn(3, 20)
    ctx.expect_error("softmax", x[0], mentions=["x"], why="x of rank 1")
    ctx.expect_error("softmax", x[None], mentions=["x"], why="x of rank 3")
    ctx.expect_error("softmax", x.long(), errors=("TypeError",), mentions=["x"], why="x of dtype int64")
    if not runtime.ON_GPU:
        ctx.expect_error("softmax", x.bfloat16(), errors=("TypeError",), mentions=["bfloat16"],
                         why="bfloat16 on the CPU (refuse it with runtime.check_dtype)")


@check(points=1, gpu=True, hint="load bfloat16, compute in float32, store in OUT.dtype.element_ty")
def softmax_bfloat16(ctx):
    """bfloat16 on a GPU, with -inf entries and an all -inf row."""
    x = ctx.randn(64, 3000, dtype=torch.bfloat16, scale=4.0)
    x[0] = float("-inf")
    x[1, 100:] = float("-inf")
    _softmax_close(ctx, x, label="bfloat16 (default blocks)")
    _softmax_close(ctx, x, block_n=256, label="bfloat16 with block_n=256")


@check(points=1, gpu=True, hint="with the wrapper's own (large) blocks the loops and masks must still cover "
                                "every column: a row of 8192 takes two blocks of 4096")
def softmax_large(ctx):
    """A real size: x (4096, 8192) in float32 and float16, the wrapper's own block sizes."""
    for dtype in (torch.float32, torch.float16):
        x = ctx.randn(4096, 8192, dtype=dtype, scale=3.0)
        x[7] = float("-inf")
        _softmax_close(ctx, x, label=f"{dtype} (default blocks)", device=runtime.DEVICE)
