"""The TMA variant of the backward (solutions/fast_backward_tma.py) against float64 autograd.

The gradients are judged as stage 9's checks judge them: against autograd through the float64
reference, allowing 3x the error of the same computation in the inputs' dtype.  On the CPU
Triton's interpreter runs the descriptors as ordinary loads; the GPU runs add bfloat16 and
long sequences, where the autotuner picks the tiles.
"""

from kernels import reference, runtime, tolerance
from kernels.loader import ROOT, load_file

import pytest
import torch
from test_fast_forward import CASES as FORWARD_CASES

PATH = ROOT / "solutions" / "fast_backward_tma.py"
pytestmark = pytest.mark.skipif(not PATH.exists(), reason="this copy of the workbook has no solutions/")
DEVICE = "cuda" if runtime.ON_GPU else "cpu"
# On a GPU a float32 tl.dot runs in TF32, which autograd cannot reproduce: float16 there.
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.float16]


@pytest.fixture(scope="module")
def fast():
    return load_file(PATH)


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q, do = (torch.randn(b, hq, nq, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, hkv, nk, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v, do


def _check_grads(got, q, k, v, do, sinks=None, **mask):
    # (dq, dk, dv, dsinks) by autograd through the reference, as stage 9's checks compute them.
    grads = reference.attention_grads(q, k, v, do, sinks=sinks, **mask)
    floors = reference.gradient_floors(q, k, v, do, grads, sinks=sinks, **mask)
    ref = grads[1:]
    base = reference.attention_grads(q, k, v, do, sinks=sinks, compute_dtype=tolerance.baseline_dtype(q.dtype),
                                     **mask)[1:]
    factor = tolerance.GRADIENT_FACTOR
    for name, x, r, b, like in zip(("dq", "dk", "dv"), got[:3], ref[:3], base[:3], (q, k, v)):
        assert x.dtype == like.dtype and x.shape == like.shape, name
        report = tolerance.compare(x, r, b, name=name, factor=factor, floor=floors[name])
        assert report.ok, report.message
    if sinks is None:
        assert got[3] is None
    else:
        assert got[3].dtype == sinks.dtype
        report = tolerance.compare(got[3], ref[3], base[3], name="dsinks", factor=factor, floor=floors["dsinks"])
        assert report.ok, report.message


# The forward's shapes and masks (partial blocks, MQA rows that see nothing, short windows, sink
# tokens, groups of 4 and 8), with learned sinks added.
CASES = FORWARD_CASES + [
    (1, 4, 2, 60, 60, 16, dict(learned_sinks=True)),
    (1, 8, 2, 66, 66, 32, dict(causal=True, window=10, sink_tokens=2, learned_sinks=True)),
    (1, 4, 4, 70, 30, 16, dict(causal=True, learned_sinks=True)),   # rows that see no key but the sink
]


@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, mask", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_float64_autograd(fast, b, hq, hkv, nq, nk, d, mask, dtype):
    q, k, v, do = _inputs(b, hq, hkv, nq, nk, d, dtype)
    mask = dict(mask)
    if mask.pop("learned_sinks", False):
        mask["sinks"] = torch.linspace(-3.0, 4.0, hq, device=DEVICE)
    o, lse = fast.flash_attention(q, k, v, **mask)
    got = fast.flash_attention_backward(q, k, v, o, lse, do, **mask)
    _check_grads(got, q, k, v, do, **mask)


def test_rows_that_see_nothing_get_zero_gradients(fast):
    q, k, v, do = _inputs(1, 2, 2, 50, 20, 16, torch.float32)
    o, lse = fast.flash_attention(q, k, v, causal=True)
    dq, dk, dv, _ = fast.flash_attention_backward(q, k, v, o, lse, do, causal=True)
    assert torch.all(dq[:, :, :30] == 0) and torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("host", [True, False])     # the descriptors made on the host, or in the kernels
def test_strided_inputs_and_a_fixed_dq_tile(fast, host):
    q, k, v, do = _inputs(2, 4, 2, 45, 45, 32, torch.float32, seed=1)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))   # (B, N, H, D)
    assert not qt.is_contiguous() and do.is_contiguous()        # dO in the other layout: strides of its own
    o, lse = fast.flash_attention(qt, kt, vt, causal=True, sm_scale=0.3, host_descriptors=host)
    got = fast.flash_attention_backward(qt, kt, vt, o, lse, do, causal=True, sm_scale=0.3, block_m=16, block_n=16,
                                        host_descriptors=host)
    # Read where they lie, the gradients in the inputs' layout: no copy on the way in or out.
    assert [g.stride() for g in got[:3]] == [qt.stride(), kt.stride(), vt.stride()]
    _check_grads(got, q, k, v, do, causal=True, sm_scale=0.3)


def test_host_made_descriptors_take_the_query_block_the_autotuner_tries(fast):
    """The dK/dV autotuner's hook sets each configuration's query block on the four host-made
    descriptors: q's and dO's tiles and lse's and delta's rows."""
    q, k, v, do = _inputs(1, 4, 2, 40, 40, 32, torch.float32)
    lse = torch.zeros(4, 40, device=DEVICE)
    made = fast.dkdv_descriptors(q, do, lse, lse, tuple(q.shape), q.stride(), do.stride(), 16)
    assert [d.block_shape for d in made] == [[1, 1, 16, 32], [1, 1, 16, 32], [1, 16], [1, 16]]
    assert made[2].shape == [4, 40] and made[2].strides == [40, 1]
    fast._dkdv_descriptor_tiles(dict(Q=made[0], DO=made[1], LSE=made[2], DELTA=made[3], HOST_DESC=True, BLOCK_M=64,
                                     HEAD_DIM_PAD=32))
    assert [d.block_shape for d in made] == [[1, 1, 64, 32], [1, 1, 64, 32], [1, 64], [1, 64]]
    empty = q[:, :, :0]
    assert fast.dkdv_descriptors(empty, empty, lse, lse, tuple(empty.shape), q.stride(), q.stride(), 16) is None


@pytest.mark.parametrize("nq", [48, 45])        # rows of lse that TMA can take as they are, and rows it cannot
def test_lse_that_starts_off_16_bytes(fast, nq):
    # The dK/dV kernel reads lse through a descriptor, which needs a 16-byte-aligned start:
    # an lse sliced out of a larger buffer (here 4 bytes in) must still work.
    q, k, v, do = _inputs(1, 4, 2, nq, nq, 16, torch.float32, seed=2)
    o, lse = fast.flash_attention(q, k, v, causal=True)
    shifted = torch.empty(lse.numel() + 1, device=DEVICE)[1:].view(lse.shape)
    shifted.copy_(lse)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16
    got = fast.flash_attention_backward(q, k, v, o, shifted, do, causal=True)
    _check_grads(got, q, k, v, do, causal=True)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(d=48), ValueError, ["head_dim", "powers of two"]),
    (dict(window=8), ValueError, ["window", "causal"]),
    (dict(o="short"), ValueError, ["o must be"]),
    (dict(lse="double"), ValueError, ["lse must be"]),
    (dict(block_m=24), ValueError, ["block_m"]),
    (dict(host_descriptors="yes"), TypeError, ["host_descriptors"]),
])
def test_bad_input_names_the_argument(fast, kwargs, error, words):
    d, hq = kwargs.pop("d", 16), kwargs.pop("hq", 1)
    q, k, v, do = _inputs(1, hq, 1 if hq == 1 else hq // 2, 8, 8, d, torch.float32)
    o, lse = torch.zeros_like(q), torch.zeros(q.shape[:3])
    if kwargs.pop("o", None):
        o = o[:, :, :4]
    if kwargs.pop("lse", None):
        lse = lse.double()
    with pytest.raises(error) as info:
        fast.flash_attention_backward(q, k, v, o, lse, do, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.skipif(not runtime.ON_GPU, reason="bfloat16 and the autotuned tiles need a CUDA GPU")
@pytest.mark.parametrize("mask", [dict(causal=True), dict(causal=True, window=300), dict(learned_sinks=True)])
def test_gpu_long_sequences_in_bfloat16(fast, mask):
    q, k, v, do = _inputs(1, 8, 2, 2048, 2048, 64, torch.bfloat16)    # 2048 x 2048 pairs: the autotuner runs
    mask = dict(mask)
    if mask.pop("learned_sinks", False):
        mask["sinks"] = torch.linspace(-3.0, 4.0, 8, device=DEVICE)
    o, lse = fast.flash_attention(q, k, v, **mask)
    got = fast.flash_attention_backward(q, k, v, o, lse, do, **mask)
    # dk and dv of KV head 0 need all four of its query heads: judge those against autograd on them.
    small = dict(mask, sinks=mask["sinks"][:4]) if "sinks" in mask else mask
    _check_grads((got[0][:, :4], got[1][:, :1], got[2][:, :1], got[3][:4] if got[3] is not None else None),
                 q[:, :4], k[:, :1], v[:, :1], do[:, :4], **small)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tile", [(16, 32, 4, 1), (32, 16, 4, 1)])
def test_the_one_pass_probe_s_kernel_matches_float64_autograd(fast, causal, tile):
    """grader/bench/probes/fused_dq_backward.py times a one-pass backward (dQ added by the dK/dV
    program); its element-wise variant, judged here as the TMA backward is, so that the probe
    never times a wrong kernel."""
    probe = load_file(ROOT / "grader" / "bench" / "probes" / "fused_dq_backward.py")
    q, k, v, do = _inputs(1, 2, 2, 64, 64, 32, DTYPES[-1], seed=3)
    o, lse = fast.flash_attention(q, k, v, causal=causal)
    got = probe.fused_backward(q, k, v, o, lse, do, causal, tile, False, fast._stage9.backward_preprocess)
    _check_grads((*got, None), q, k, v, do, causal=causal)
