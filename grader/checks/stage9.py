"""Checks for stage 9: the backward pass (dQ, dK, dV and d(sinks)), in PyTorch and in Triton.

Part 1's ``tiled_attention_backward`` is a plain function: the checks hand it the reference's
``o`` and ``lse`` and judge the gradients it returns.  Part 2's kernels are judged through
``attention``: your code runs in a worker process and autograd graphs cannot cross processes,
so the grader's helper ``gradients`` (grader/isolation/harness.py) runs ``attention(...)``
forward and ``o.backward(do)`` there and returns ``(o, dq, dk, dv, dsinks)``.  Here, in the
grader's process, the same gradients come from ``kernels.reference.attention_grads``: in float64 (the
answer) and in the input's dtype (how much error PyTorch itself makes, for the tolerance rule:
gradients may err 3x as much).  Part 3's operator is judged the same way through ``attention_op``,
eager and under ``torch.compile(fullgraph=True)``, and by ``torch.library.opcheck``.

On a GPU, a float32 ``tl.dot`` runs in TF32, an error autograd cannot reproduce; so there the
checks that run everywhere use float16, and GPU-only checks add bfloat16 at real sizes.
"""

from __future__ import annotations

from kernels import masks, reference, runtime, tolerance

import torch

from grader.check import check

Q_DIMS = ("b", "h", "i", "d")
KV_DIMS = ("b", "h_kv", "j", "d")
DTYPE = runtime.pick(cpu=torch.float32, gpu=torch.float16)
DQ_BLOCK = runtime.pick(cpu=64, gpu=128)        # the solution's dQ query block, for naming tiles


def _inputs(ctx, b, hq, hkv, nq, nk, d, *, dtype=DTYPE):
    q = ctx.randn(b, hq, nq, d, dtype=dtype)
    k, v = ctx.randn(b, hkv, nk, d, dtype=dtype), ctx.randn(b, hkv, nk, d, dtype=dtype)
    return q, k, v, ctx.randn(b, hq, nq, d, dtype=dtype)


def _grads_close(ctx, q, k, v, do, *, label, sinks=None, tiled=None, attend="attention", harness="gradients",
                 device=None, **opts):
    """Run the learner's backward and judge every gradient (and o, when it ran the forward too).

    ``tiled=(block_m, block_n)`` calls part 1's ``tiled_attention_backward`` on the float64
    reference's o and lse (rounded to the inputs' dtype and float32); otherwise ``attend``
    (``attention``, ``tiled_attention`` or ``attention_op``) runs forward and backward, through the
    helper ``harness`` (grader/isolation/harness.py: ``gradients``, or ``compiled_gradients``).  The
    references are computed on ``device`` (the GPU for real sizes), else on the inputs' own.
    Returns ``(o or None, dq, dk, dv, dsinks)``.
    """
    if tiled is not None:
        o, lse = reference.attention(q, k, v, sinks=sinks, **opts)
        grads = ctx.learner.tiled_attention_backward(q, k, v, o.to(q.dtype), lse.float(), do, sinks=sinks,
                                                     block_m=tiled[0], block_n=tiled[1], **opts)
        ctx.expect(isinstance(grads, (tuple, list)) and len(grads) == 4,
                   f"tiled_attention_backward must return (dq, dk, dv, dsinks); got {type(grads).__name__}")
        got = (None, *grads)
    else:
        got = getattr(ctx.learner, attend)(q, k, v, do, sinks=sinks, _harness=harness, **opts)
    rq, rk, rv, rdo, rsinks = (q, k, v, do, sinks) if device is None else \
        (None if t is None else t.to(device) for t in (q, k, v, do, sinks))
    ref = reference.attention_grads(rq, rk, rv, rdo, sinks=rsinks, **opts)
    base = reference.attention_grads(rq, rk, rv, rdo, sinks=rsinks, compute_dtype=tolerance.baseline_dtype(q.dtype),
                                     **opts)
    o, dq, dk, dv, dsinks = got
    if o is not None:
        ctx.close(o, ref[0], base[0], name=f"o {label}", dims=Q_DIMS, row_dim=2, block_m=DQ_BLOCK)
    block_m = tiled[0] if tiled is not None else DQ_BLOCK
    for name, x, dtype in (("dq", dq, q.dtype), ("dk", dk, k.dtype), ("dv", dv, v.dtype)):
        ctx.expect_dtype(x, dtype, name=f"{name} {label}")
    floors, factor = reference.gradient_floors(rq, rk, rv, rdo, ref, sinks=rsinks, **opts), tolerance.GRADIENT_FACTOR
    if sinks is None:
        ctx.expect(dsinks is None, f"dsinks {label}: without learned sinks there is no sink gradient; "
                                   f"expected None, got {type(dsinks).__name__}")
    else:
        ctx.expect_dtype(dsinks, sinks.dtype, name=f"dsinks {label}")
    judged = {"dq": (dq, 1, floors["dq"]), "dk": (dk, 2, floors["dk"]), "dv": (dv, 3, floors["dv"])}
    if sinks is not None:
        judged["dsinks"] = (dsinks, 4, floors["dsinks"])

    def explain(_allowed):
        """The likely mistake, from all the gradients at once (grader.diagnose.gradients)."""
        from grader import diagnose
        allowed = {n: tolerance.compare(x, ref[i], base[i], name=n, factor=factor, floor=fl).allowed
                   for n, (x, i, fl) in judged.items()}
        return diagnose.gradients({n: x for n, (x, _, _) in judged.items()}, q, k, v, do,
                                  dict(opts, sinks=sinks), allowed=allowed)

    ctx.close(dv, ref[3], base[3], name=f"dv {label}", factor=factor, floor=floors["dv"], dims=KV_DIMS, explain=explain)
    ctx.close(dk, ref[2], base[2], name=f"dk {label}", factor=factor, floor=floors["dk"], dims=KV_DIMS, explain=explain)
    ctx.close(dq, ref[1], base[1], name=f"dq {label}", factor=factor, floor=floors["dq"], dims=Q_DIMS, row_dim=2,
              block_m=block_m, explain=explain)
    if sinks is not None:
        ctx.close(dsinks, ref[4], base[4], name=f"dsinks {label}", factor=factor, floor=floors["dsinks"], dims=("h",),
                  explain=explain)
    return got


KERNEL_NAN = "a row with lse = -inf gives exp2(s - lse) = exp2(-inf + inf) = NaN: treat its lse as +inf"
TILED_NAN = "a row with lse = -inf has exp(s - lse) = inf, and multiplying by a 0/1 mask gives NaN: use torch.where"


def _expect_zero_rows(ctx, dq, q, nk, *, label, nan_cause=KERNEL_NAN):
    """Rows that see no key (causal, Nq > Nk: the first Nq - Nk) must have dq exactly 0, not NaN."""
    empty = q.shape[2] - nk
    if empty <= 0:
        return
    rows = dq[:, :, :empty]
    ctx.expect(not bool(torch.isnan(rows).any()),
               f"dq {label}: rows 0..{empty - 1} see no key and must get zero gradients; found NaN ({nan_cause})")
    ctx.expect(bool((rows == 0).all()), f"dq {label}: rows 0..{empty - 1} see no key; expected dq = 0 there, "
                                        f"got max |dq| = {float(rows.abs().max()):.3g}")


def _learned_sinks(ctx, hq):
    """Per-head sink logits, with one that takes nothing (-30) and one that takes almost all (+30)."""
    sinks = ctx.randn(hq, scale=2.0)
    sinks[0], sinks[1] = -30.0, 30.0
    return sinks


# -- Part 1: the backward in PyTorch, tile by tile (TODO 9a) ----------------------------------

@check(points=2, hint="ds = p * (dp - delta) with delta = rowsum(dO * O) of the block's rows; dq += scale * ds @ kj "
                      "and dk += scale * ds^T @ qi; dk and dv add up the query heads of the GQA group")
def tiled_backward_gradients(ctx):
    """Part 1 (PyTorch): MHA, GQA and MQA, Nq != Nk, one query, a custom sm_scale, blocks that do not divide N."""
    for (b, hq, hkv, nq, nk, d, scale, blocks) in ((2, 2, 2, 40, 40, 32, None, (16, 16)),
                                                   (1, 4, 2, 37, 50, 16, 0.3, (16, 32)),
                                                   (1, 4, 1, 1, 33, 16, None, (16, 16))):
        q, k, v, do = _inputs(ctx, b, hq, hkv, nq, nk, d)
        _grads_close(ctx, q, k, v, do, sm_scale=scale, tiled=blocks,
                     label=f"(tiled {blocks}, B={b}, Hq={hq}, Hkv={hkv}, Nq={nq}, Nk={nk}, D={d}, sm_scale={scale})")
    q, k, v, do = (ctx.randn(1, n, 2, 16, dtype=DTYPE).transpose(1, 2) for n in (30, 21, 21, 30))
    _grads_close(ctx, q, k, v, do, tiled=(16, 16), label="(tiled, non-contiguous q, k, v and dO)")


@check(points=2, hint="p is exp(s - lse) where the key is visible and exactly 0 elsewhere (torch.where: in a row "
                      "with lse = -inf, exp(s - lse) is inf, and inf * 0 is NaN); "
                      "dsinks[h] = -sum over b, i of exp(sinks[h] - lse[b, h, i]) * delta[b, h, i]")
def tiled_backward_masks(ctx):
    """Part 1 (PyTorch): causal with rows that see nothing, a window with sink tokens, learned sinks."""
    for (b, hq, hkv, nq, nk, opts, learned) in ((1, 2, 2, 64, 20, dict(causal=True), False),
                                                (1, 4, 2, 70, 70, dict(causal=True, window=9, sink_tokens=3), False),
                                                (2, 4, 2, 40, 50, {}, True),
                                                (1, 4, 1, 60, 45, dict(causal=True, window=9, sink_tokens=2), True)):
        q, k, v, do = _inputs(ctx, b, hq, hkv, nq, nk, 16)
        sinks = _learned_sinks(ctx, hq) if learned else None
        label = f"(tiled (16, 32), Hq={hq}, Hkv={hkv}, Nq={nq}, Nk={nk}, {opts}{', learned sinks' if learned else ''})"
        got = _grads_close(ctx, q, k, v, do, sinks=sinks, tiled=(16, 32), label=label, **opts)
        _expect_zero_rows(ctx, got[1], q, nk, label=label, nan_cause=TILED_NAN)


@check(points=1, hint="tiled_attention is _Attention.apply(..., tiled_attention_backward): its backward returns one "
                      "gradient per input of forward (None for the options), dsinks in the sinks' place")
def tiled_attention_autograd(ctx):
    """Part 1 (PyTorch) under autograd: ``tiled_attention(...).backward(do)`` fills every gradient."""
    q, k, v, do = _inputs(ctx, 1, 4, 2, 50, 40, 16)
    label = "(tiled_attention, Hq=4, Hkv=2, Nq=50, Nk=40, causal, window=9, learned sinks)"
    _grads_close(ctx, q, k, v, do, sinks=_learned_sinks(ctx, 4), attend="tiled_attention", label=label,
                 causal=True, window=9)


# -- Part 2: the backward in Triton, through attention (TODO 9b, 9c, 9d) -------------------------

@check(points=2, hint="dS is the gradient of the scaled scores: dq = sm_scale * dS @ K and dk = sm_scale * dS^T @ Q; "
                      "delta = rowsum(dO * O) per query row")
def mha_gradients(ctx):
    """No mask, one KV head per query head: Nq = Nk, Nq != Nk, one query, a custom sm_scale, strided inputs."""
    for (b, h, nq, nk, d, scale) in ((2, 2, 40, 40, 32, None), (1, 2, 1, 33, 16, None), (1, 2, 70, 45, 32, 0.3)):
        q, k, v, do = _inputs(ctx, b, h, h, nq, nk, d)
        _grads_close(ctx, q, k, v, do, sm_scale=scale,
                     label=f"(B={b}, H={h}, Nq={nq}, Nk={nk}, D={d}, sm_scale={scale})")
    # (B, N, H, D) memory viewed as (B, H, N, D): the kernels must follow the strides.
    q, k, v, do = (ctx.randn(1, n, 2, 32, dtype=DTYPE).transpose(1, 2) for n in (50, 37, 37, 50))
    _grads_close(ctx, q, k, v, do, label="(non-contiguous q, k, v and dO)")


@check(points=2, hint="a KV head is read by Hq // Hkv query heads: the dK/dV program must add the contributions "
                      "of every query head of its group (the loop over g), and the dQ program must read "
                      "KV head h // (Hq // Hkv)")
def gqa_and_mqa_gradients(ctx):
    """Grouped-query (Hq = 4, Hkv = 2) and multi-query (Hkv = 1) attention, causal or not."""
    for (hq, hkv, nq, nk, causal) in ((4, 2, 50, 50, False), (4, 1, 45, 70, True), (6, 2, 40, 40, True)):
        q, k, v, do = _inputs(ctx, 1, hq, hkv, nq, nk, 32)
        _grads_close(ctx, q, k, v, do, causal=causal, label=f"(Hq={hq}, Hkv={hkv}, Nq={nq}, Nk={nk}, causal={causal})")


@check(points=2, hint="the dK/dV kernel starts at the query block holding the diagonal (rounded DOWN to a block) "
                      "and the dQ kernel stops after the key block holding the block's last visible key")
def causal_gradients(ctx):
    """Causal masks aligned bottom-right with Nq = Nk, Nq > Nk (rows that see nothing) and Nq < Nk."""
    for (nq, nk) in ((70, 70), (70, 45), (17, 70)):
        q, k, v, do = _inputs(ctx, 1, 2, 2, nq, nk, 32)
        label = f"(causal, Nq={nq}, Nk={nk})"
        got = _grads_close(ctx, q, k, v, do, causal=True, label=label)
        _expect_zero_rows(ctx, got[1], q, nk, label=label)


@check(points=2, hint="a key j leaves the window after query j - (Nk - Nq) + W - 1: the dK/dV kernel must "
                      "visit query blocks up to there; the dQ kernel starts at the key block of the first "
                      "query's first key, start_m + (Nk - Nq) - W + 1")
def window_gradients(ctx):
    """Sliding windows of 1, 9, 16, 250 and one longer than the sequence, with Nq = Nk and Nq != Nk.

    Window 250 spans whole query blocks of a GPU's 128-key dK/dV tile: some query blocks see
    all of a key block, and the ones past them are cut by the window's far edge."""
    for (nq, nk, w) in ((40, 40, 1), (70, 70, 16), (50, 70, 9), (45, 60, 100), (400, 400, 250)):
        q, k, v, do = _inputs(ctx, 1, 2, 1, nq, nk, 32)
        _grads_close(ctx, q, k, v, do, causal=True, window=w, label=f"(window={w}, Nq={nq}, Nk={nk})")


@check(points=2, hint="key blocks that hold sink tokens are seen by every later query, whatever the window: "
                      "the dK/dV kernel walks all query blocks below the diagonal for them, and the dQ "
                      "kernel visits them before its window")
def sink_token_gradients(ctx):
    """StreamingLLM sink tokens with a window: 3 of them, and 20 (more than one key block)."""
    for (nq, nk, w, s) in ((70, 70, 5, 3), (60, 70, 8, 20)):
        q, k, v, do = _inputs(ctx, 1, 2, 2, nq, nk, 32)
        _grads_close(ctx, q, k, v, do, causal=True, window=w, sink_tokens=s,
                     label=f"(window={w}, sink_tokens={s}, Nq={nq}, Nk={nk})")


@check(points=3, hint="dsinks[h] = -sum over b, i of exp(sinks[h] - lse[b, h, i]) * delta[b, h, i], with the lse "
                      "that includes the sink; the backward rebuilds P from that same lse")
def learned_sink_gradients(ctx):
    """Learned per-head sinks (gpt-oss), including logits of -30 and +30, with GQA, causal and windows."""
    for (b, hq, hkv, nq, nk, opts) in ((2, 4, 2, 40, 50, {}),
                                       (1, 4, 1, 60, 45, dict(causal=True, window=9, sink_tokens=2))):
        q, k, v, do = _inputs(ctx, b, hq, hkv, nq, nk, 32)
        sinks = _learned_sinks(ctx, hq)
        label = f"(sinks={[round(float(x), 2) for x in sinks]}, Hq={hq}, Hkv={hkv}, Nq={nq}, Nk={nk}, {opts})"
        got = _grads_close(ctx, q, k, v, do, sinks=sinks, label=label, **opts)
        _expect_zero_rows(ctx, got[1], q, nk, label=label)


@check(points=2, hint="a row that sees no key has lse = -inf: replace it by +inf before exp2(s - lse), so its "
                      "p is 0 and not exp2(-inf + inf) = NaN")
def empty_rows_zero_gradients(ctx):
    """Nq > Nk with causal alignment: the first Nq - Nk rows see nothing and get zero gradients, never NaN."""
    for opts in (dict(causal=True), dict(causal=True, window=4, sink_tokens=1)):
        q, k, v, do = _inputs(ctx, 1, 2, 2, 64, 20, 16)
        label = f"(Nq=64, Nk=20, {opts})"
        got = _grads_close(ctx, q, k, v, do, label=label, **opts)
        _expect_zero_rows(ctx, got[1], q, 20, label=label)


def _gradients_first(ctx, q, k, v, *, label, sinks=None, **opts):
    """Judge the gradients of ``attention`` on these inputs before a check of how the backward works.

    The forward, the kernels' loops and their visit counting are given code: without this, a check
    of what they do would pass while TODO 9b-9d are still empty, a point for code nobody wrote."""
    _grads_close(ctx, q, k, v, ctx.randn(*q.shape, dtype=q.dtype), sinks=sinks,
                 label=f"{label}, judged first: this check counts once the gradients are right", **opts)


def _tiles_with_visible_pairs(nq, nk, block_m, block_n, **opts) -> torch.Tensor:
    """(query blocks, key blocks): True where the tile holds at least one visible (query, key) pair."""
    visible = masks.materialize(masks.attention_mask(nq, nk, **opts), nq, nk)
    rows, cols = -(-nq // block_m), -(-nk // block_n)
    padded = torch.zeros(rows * block_m, cols * block_n, dtype=torch.bool)
    padded[:nq, :nk] = visible
    return padded.view(rows, block_m, cols, block_n).any(dim=3).any(dim=1)


@check(points=1, hint="the dK/dV kernel walks query blocks from the diagonal's down to where the window leaves "
                      "(all of them for key blocks with sink tokens); the dQ kernel walks key blocks as the "
                      "forward does: sink-token blocks, then the window, up to the diagonal")
def backward_skips_blocks(ctx):
    """Each kernel processes exactly the tiles that hold a visible pair, each once: the forward's skipping.

    The loops are given code, so the gradients of the first case are judged first."""
    for i, (hq, hkv, nq, nk, opts) in enumerate(((2, 1, 70, 45, dict(causal=True)),
                                                 (2, 2, 130, 130, dict(causal=True, window=16)),
                                                 (2, 1, 60, 100, dict(causal=True, window=9, sink_tokens=20)),
                                                 (2, 2, 33, 50, {}))):
        q, k, v, _ = _inputs(ctx, 1, hq, hkv, nq, nk, 16)
        if i == 0:
            _gradients_first(ctx, q, k, v, label=f"(Hq={hq}, Hkv={hkv}, Nq={nq}, Nk={nk}, {opts})", **opts)
        got = ctx.learner.flash_attention_backward(q, k, v, _harness="backward_visits", **opts)
        for kernel in ("dkdv", "dq"):
            bm, bn = got[f"{kernel}_blocks"]
            expected = _tiles_with_visible_pairs(nq, nk, bm, bn, **opts).int()
            visits = got[kernel]
            shape = (1, hq, expected.shape[0], expected.shape[1])
            ctx.expect(tuple(visits.shape) == shape,
                       f"{kernel} visits for Nq={nq}, Nk={nk}: expected shape {shape} ({bm}x{bn} tiles), "
                       f"got {tuple(visits.shape)}")
            for h in range(hq):
                diff = (visits[0, h] != expected).nonzero()
                if len(diff):
                    r, c = (int(x) for x in diff[0])
                    n, what = int(visits[0, h, r, c]), ("holds visible pairs" if expected[r, c] else
                                                         "holds no visible pair")
                    ctx.fail(f"the {kernel} kernel processed tile (query block {r}, key block {c}) of head {h} "
                             f"{n} time(s); that {bm}x{bn} tile {what}, so expected {int(expected[r, c])} "
                             f"(Nq={nq}, Nk={nk}, {opts}; {len(diff)} tiles differ)")


@check(points=1, hint="save q, k, v, o and lse (and sinks) for the backward: never P or S, which are Nq x Nk "
                      "per head; the backward rebuilds them tile by tile from lse")
def saves_nothing_quadratic(ctx):
    """The autograd.Function keeps nothing of size Nq x Nk for the backward, and keeps lse.

    The forward and its autograd.Function are given code, so the gradients are judged first."""
    b, hq, hkv, nq, nk, d = 1, 2, 1, 48, 80, 16
    q, k, v, _ = _inputs(ctx, b, hq, hkv, nq, nk, d)
    sinks = ctx.randn(hq)
    _gradients_first(ctx, q, k, v, sinks=sinks, causal=True,
                     label=f"(Hq={hq}, Hkv={hkv}, Nq={nq}, Nk={nk}, causal, learned sinks)")
    shapes = ctx.learner.attention(q, k, v, causal=True, sinks=sinks, _harness="saved_for_backward")
    largest_input = max(t.numel() for t in (q, k, v))
    for shape in shapes:
        numel = 1
        for n in shape:
            numel *= n
        ctx.expect(numel <= largest_input and not (nq in shape and nk in shape),
                   f"the forward keeps a tensor of shape {shape} for the backward (q is {tuple(q.shape)}, k "
                   f"{tuple(k.shape)}): that is the size of the attention matrix, which is what FlashAttention "
                   "never stores")
    ctx.expect((b, hq, nq) in shapes, f"the forward should keep lse, shape {(b, hq, nq)}, for the backward; "
                                      f"it keeps {shapes}")


# -- Part 3: the operator (TODO 9e, 9f) ----------------------------------------------------------

@check(points=1, hint="the fake forward returns torch.empty_like(q) and q.new_empty(B, Hq, Nq, dtype=torch.float32): "
                      "the real forward's shapes, dtypes and device, with nothing computed")
def op_opcheck(ctx):
    """torch.library.opcheck on attention_forward and attention_backward: schema, fake and autograd rule."""
    q, k, v, do = _inputs(ctx, 1, 4, 2, 40, 33, 16)
    sinks = _learned_sinks(ctx, 4)
    for opts in ((True, 9, 2, None), (False, None, 0, 0.3)):
        ctx.learner.attention_forward(q, k, v, sinks, *opts, _harness="opcheck")
    o, lse = reference.attention(q, k, v, sinks=sinks, causal=True, window=9, sink_tokens=2)
    ctx.learner.attention_backward(q, k, v, o.to(q.dtype), lse.float(), do, sinks, True, 9, 2, None,
                                   grad=False, _harness="opcheck")


@check(points=2, hint="_setup_context saves q, k, v, o, lse, sinks with ctx.save_for_backward and keeps "
                      "ctx.options = (causal, window, sink_tokens, sm_scale); inputs come in the forward's order")
def op_gradients(ctx):
    """attention_op forward and backward: the same gradients as attention, with and without learned sinks."""
    for (hq, hkv, nq, nk, opts, learned) in ((4, 2, 50, 40, dict(causal=True, window=9, sink_tokens=2), True),
                                             (2, 2, 33, 45, dict(sm_scale=0.3), False)):
        q, k, v, do = _inputs(ctx, 1, hq, hkv, nq, nk, 16)
        sinks = _learned_sinks(ctx, hq) if learned else None
        label = f"(attention_op, Hq={hq}, Hkv={hkv}, Nq={nq}, Nk={nk}, {opts}{', learned sinks' if learned else ''})"
        _grads_close(ctx, q, k, v, do, sinks=sinks, attend="attention_op", label=label, **opts)


@check(points=1, hint="torch.compile(fullgraph=True) fails at the first graph break: attention_op must call only "
                      "the registered operator, and the fake forward must not touch the tensors' values")
def op_compiles_fullgraph(ctx):
    """torch.compile(fullgraph=True) of a function calling attention_op: its gradients, judged as eager ones are."""
    q, k, v, do = _inputs(ctx, 1, 4, 2, 40, 40, 16)
    sinks = _learned_sinks(ctx, 4)
    opts = dict(causal=True, window=9)
    label = "(attention_op under torch.compile(fullgraph=True), Hq=4, Hkv=2, N=40, causal, window 9, learned sinks)"
    _grads_close(ctx, q, k, v, do, sinks=sinks, attend="attention_op", harness="compiled_gradients", label=label,
                 **opts)


@check(points=2, gpu=True, hint="cast p and dS to the inputs' dtype before tl.dot and accumulate dq, dk, dv in "
                                "float32")
def gpu_half_gradients(ctx):
    """float16 and bfloat16 at real sizes: GQA, causal, window 128 with sink tokens and learned sinks."""
    cases = ((torch.float16, 64, 1023, 1023, dict(causal=True, window=128, sink_tokens=4), True),
             (torch.bfloat16, 128, 777, 1025, dict(causal=True), True),
             (torch.bfloat16, 64, 1025, 1025, {}, False))
    for dtype, d, nq, nk, opts, learned in cases:
        q, k, v, do = _inputs(ctx, 2, 8, 2, nq, nk, d, dtype=dtype)
        sinks = ctx.randn(8) if learned else None
        _grads_close(ctx, q, k, v, do, sinks=sinks, label=f"({dtype}, D={d}, Nq={nq}, Nk={nk}, {opts})",
                     device=runtime.DEVICE, **opts)


@check(points=1, gpu=True, timeout=300.0,
       hint="allocate nothing of size Nq x Nk: delta and lse are (B, H, Nq); dq, dk, dv are written once")
def gpu_peak_memory(ctx):
    """Forward + backward at N = 32768, D = 128, B1 H8 in bfloat16 peaks within 1.2x its unavoidable tensors."""
    n, d, b, h = 32768, 128, 1, 8
    report = ctx.learner.attention(n=n, head_dim=d, batch=b, heads=h, kv_heads=h, dtype=torch.bfloat16,
                                   verbose=False, _harness="peak_memory")
    needed = 8 * b * h * n * d * 2                 # q, k, v, dO, o, dq, dk, dv in bfloat16
    peak, mib = report["peak_bytes"], 2 ** 20
    ctx.expect(peak <= 1.2 * needed,
               f"peak memory {peak / mib:.0f} MiB exceeds 1.2x the {needed / mib:.0f} MiB of q, k, v, dO, o, dq, "
               f"dk and dv ({1.2 * needed / mib:.0f} MiB): something of size N x N, or extra copies of "
               "inputs, is allocated")
