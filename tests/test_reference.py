"""The float64 reference and the masks are the specification: test them against independent code."""

import math

from kernels import masks, reference, tolerance

import pytest
import torch
import torch.nn.functional as F

torch.manual_seed(0)


def _loop_attention(q, k, v, visible, sinks=None, scale=None):
    """Row by row in Python: slow, obvious, and written independently of reference.attention."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    scale = scale or 1 / math.sqrt(D)
    o = torch.zeros(B, Hq, Nq, D, dtype=torch.float64)
    lse = torch.full((B, Hq, Nq), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            g = h // (Hq // Hkv)
            for i in range(Nq):
                keys = [j for j in range(Nk) if visible[i][j]]
                logits = [float(q[b, h, i].double() @ k[b, g, j].double()) * scale for j in keys]
                if sinks is not None:
                    logits_all = logits + [float(sinks[h])]
                else:
                    logits_all = logits
                if not logits_all:
                    continue
                mx = max(logits_all)
                total = sum(math.exp(x - mx) for x in logits_all)
                lse[b, h, i] = mx + math.log(total)
                for j, x in zip(keys, logits):
                    o[b, h, i] += math.exp(x - lse[b, h, i]) * v[b, g, j].double()
    return o, lse


def _grid(nq, nk, rule):
    return [[rule(i, j) for j in range(nk)] for i in range(nq)]


CASES = [
    # (Nq, Nk, Hq, Hkv, kwargs, visibility rule written from DESIGN.md's sentences)
    (5, 7, 2, 2, {}, lambda i, j, nq, nk: True),
    (3, 5, 2, 1, dict(causal=True), lambda i, j, nq, nk: j <= i + nk - nq),
    (5, 3, 4, 2, dict(causal=True), lambda i, j, nq, nk: j <= i + nk - nq),
    (9, 9, 2, 2, dict(causal=True, window=3), lambda i, j, nq, nk: i + nk - nq - 3 < j <= i + nk - nq),
    (6, 10, 2, 2, dict(causal=True, window=2, sink_tokens=2),
     lambda i, j, nq, nk: j <= i + nk - nq and (j > i + nk - nq - 2 or j < 2)),
]


@pytest.mark.parametrize("nq,nk,hq,hkv,kw,rule", CASES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_matches_row_by_row_loop(nq, nk, hq, hkv, kw, rule, with_sinks):
    q, k, v = torch.randn(2, hq, nq, 8), torch.randn(2, hkv, nk, 8), torch.randn(2, hkv, nk, 8)
    sinks = torch.tensor([-1.5, 0.5, 2.0, 30.0][:hq]) if with_sinks else None
    o, lse = reference.attention(q, k, v, sinks=sinks, **kw)
    o2, lse2 = _loop_attention(q, k, v, _grid(nq, nk, lambda i, j: rule(i, j, nq, nk)), sinks)
    torch.testing.assert_close(o, o2, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, lse2, rtol=1e-10, atol=1e-10)


def test_reference_matches_sdpa_and_gqa_equals_repeated_heads():
    q, k, v = torch.randn(2, 8, 33, 16), torch.randn(2, 2, 33, 16), torch.randn(2, 2, 33, 16)
    o, _ = reference.attention(q, k, v, causal=True)
    kr, vr = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    o_sdpa = F.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), is_causal=True)
    torch.testing.assert_close(o, o_sdpa)


def test_empty_rows_are_zero_never_nan():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    o, lse = reference.attention(q, k, v, causal=True)           # rows 0..2 see no key
    assert torch.equal(o[:, :, :3], torch.zeros_like(o[:, :, :3]))
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
    sinks = torch.tensor([0.25, -3.0])
    o, lse = reference.attention(q, k, v, causal=True, sinks=sinks)
    assert torch.equal(o[:, :, :3], torch.zeros_like(o[:, :, :3]))
    torch.testing.assert_close(lse[0, :, 0], sinks.double())


def test_large_learned_sink_takes_the_mass_without_overflow():
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    o, lse = reference.attention(q, k, v, sinks=torch.tensor([40.0]))
    assert torch.isfinite(o).all() and o.abs().max() < 1e-12
    torch.testing.assert_close(lse, torch.full_like(lse, 40.0), rtol=0, atol=1e-12)


def test_window_without_causal_and_bad_sinks_are_rejected():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="window"):
        reference.attention(q, q, q, window=2)
    with pytest.raises(ValueError, match="sinks"):
        reference.attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="Hq % Hkv"):
        reference.attention(torch.randn(1, 3, 4, 8), q, q)


def test_softmax_reference_rows_of_minus_inf():
    x = torch.tensor([[0.0, -math.inf, 1.0], [-math.inf] * 3])
    y = reference.softmax(x)
    torch.testing.assert_close(y[0], torch.softmax(x[0].double(), -1))
    assert torch.equal(y[1], torch.zeros(3, dtype=torch.float64))


def test_masks_compose_as_the_docstring_draws():
    m = masks.materialize(masks.attention_mask(6, 6, causal=True, window=2, sink_tokens=1), 6, 6)
    drawn = ["#.....", "##....", "###...", "#.##..", "#..##.", "#...##"]
    assert [''.join('#' if x else '.' for x in row) for row in m.tolist()] == drawn


def test_tf32_keeps_ten_mantissa_bits():
    x = torch.tensor([1.0 + 2**-10, 1.0 + 2**-11 + 2**-12, -1.0 - 2**-10 - 2**-11, 3.0])
    y = tolerance.truncate_tf32(x)
    assert y.tolist() == [1.0 + 2**-10, 1.0, -1.0 - 2**-10, 3.0]


def test_tolerance_reports_nan_position_and_tile():
    ref = torch.randn(1, 1, 40, 4, dtype=torch.float64)
    out = ref.clone().float()
    out[0, 0, 33, 1] = float("nan")
    r = tolerance.compare(out, ref, ref.float(), name="o", dims=("b", "h", "i", "d"), row_dim=2, block_m=16)
    assert not r.ok and "i=33" in r.message and "query block 2" in r.message and "NaN" in r.message
    assert tolerance.compare(ref.float(), ref, ref.float(), name="o").ok


def test_tf32_cut_keeps_values_and_lets_gradients_through():
    from kernels import tolerance
    x = torch.tensor([1.0 + 2 ** -20, -3.14159, 1e-30], requires_grad=True)
    cut = tolerance.truncate_tf32(x)
    assert torch.equal(cut.detach(), tolerance.truncate_tf32(x.detach()))
    assert cut[0].item() == 1.0 and cut[1].item() != -3.14159
    (cut * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(x.grad, torch.tensor([1.0, 2.0, 3.0]))


def test_the_sink_gradient_floor_follows_the_terms_not_their_cancelling_sum():
    """dsinks[h] sums B x Nq terms of either sign: where they cancel, float32 rounding still errs in
    proportion to the terms, so the floor must come from them and not from |dsinks|."""
    from kernels import tolerance
    lse = torch.zeros(1, 1, 4, dtype=torch.float64)                  # exp(sink - lse) = 1 with sink 0
    delta = torch.tensor([[[100.0, -100.0, 50.0, -50.0]]], dtype=torch.float64)
    sinks = torch.zeros(1)
    floor = tolerance.sink_gradient_floor(lse, delta, sinks)
    assert floor == 4 * tolerance.EPS32 * (1 + 300.0)
    assert floor > 50 * tolerance.default_floor(torch.zeros(1, dtype=torch.float64))   # |dsinks| = 0 here


def test_the_sink_gradient_floor_allows_for_the_output_stored_in_half_precision():
    """The backward's delta = rowsum(dO * O) reads O as the forward stored it: in float16 each O is off
    by up to 2**-11 of itself, so each term of dsinks by that x rowsum|dO O|, weighted like the term."""
    from kernels import tolerance
    lse = torch.zeros(1, 1, 2, dtype=torch.float64)
    delta = torch.tensor([[[1.0, -1.0]]], dtype=torch.float64)
    row = torch.tensor([[[30.0, 10.0]]], dtype=torch.float64)
    plain = tolerance.sink_gradient_floor(lse, delta, torch.zeros(1))
    half = tolerance.sink_gradient_floor(lse, delta, torch.zeros(1), row=row, stored=torch.float16)
    assert half == pytest.approx(plain + 2 ** -11 * 40.0)
    assert tolerance.stored_rounding(torch.bfloat16) == 2 ** -8 and tolerance.stored_rounding(torch.float64) == 0.0
    # an error of a wrong dsinks (one term's worth, 1.0) is still far outside the widened floor
    assert half < 0.05


def _flash_style_grads(q, k, v, do, **mask):
    """dq, dk, dv in float32 the way a FlashAttention backward computes them: p from the saved lse in
    base 2, and delta = rowsum(dO * O) from the rounded output rather than from dP."""
    scale = 1 / math.sqrt(q.shape[-1])
    o, lse = reference.attention(q, k, v, **mask)
    o, lse = o.float(), lse.float()
    s = (q @ k.transpose(-1, -2)) * (scale * 1.4426950408889634)
    seen = masks.materialize(masks.attention_mask(q.shape[2], k.shape[2], **mask), q.shape[2], k.shape[2])
    p = torch.where(seen, torch.exp2(s - lse[..., None] * 1.4426950408889634), torch.zeros_like(s))
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return scale * ds @ k, scale * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


def test_gradient_floors_cover_the_backward_own_roundings_and_no_real_mistake():
    """With a window of 1 every p is 1 and dS = p (dP - delta) is zero in exact arithmetic.  PyTorch's
    autograd cancels it exactly, so its own error in dq is zero; a FlashAttention backward takes delta
    from O and dP from V, two roundings that do not cancel.  The floors allow for those roundings,
    and still reject dq without its scale."""
    for seed, window in ((0, 1), (1, 1), (2, 1), (3, 4), (4, 4)):
        mask = dict(causal=True, window=window)
        gen = torch.Generator().manual_seed(seed)
        q, k, v, do = (torch.randn(1, 1, 40, 32, generator=gen) for _ in range(4))
        ref = reference.attention_grads(q, k, v, do, **mask)
        base = reference.attention_grads(q, k, v, do, compute_dtype=torch.float32, **mask)
        floors = reference.gradient_floors(q, k, v, do, ref, **mask)
        flash = _flash_style_grads(q, k, v, do, **mask)
        if window == 1:
            assert float((base[1].double() - ref[1]).abs().max()) < 1e-12, "PyTorch's own dq cancels exactly here"
            assert float((flash[0].double() - ref[1]).abs().max()) > 0, "the flash-style dq does not"
        for name, got, i in (("dq", flash[0], 1), ("dk", flash[1], 2), ("dv", flash[2], 3)):
            report = tolerance.compare(got, ref[i], base[i], name=name, factor=tolerance.GRADIENT_FACTOR,
                                       floor=floors[name])
            assert report.ok, f"seed {seed}, window {window}: {report.message}"
        if window > 1:
            unscaled = flash[0] * math.sqrt(32)
            assert not tolerance.compare(unscaled, ref[1], base[1], factor=tolerance.GRADIENT_FACTOR,
                                         floor=floors["dq"]).ok, "dq without its scale passed: the floor is too loose"
