"""The TMA variant of the forward (solutions/fast_forward_tma.py) against the float64 reference.

On the CPU Triton's interpreter runs the descriptors as ordinary loads; the GPU runs add
bfloat16 and long sequences, where the autotuner picks the tile.
"""

from kernels import runtime
from kernels.loader import ROOT, load_file

import pytest
import torch

from grader.bench import measure
from grader.bench.cases import PROVIDERS, Case
from grader.checks import attention

PATH = ROOT / "solutions" / "fast_forward_tma.py"
pytestmark = pytest.mark.skipif(not PATH.exists(), reason="this copy of the workbook has no solutions/")
DEVICE = "cuda" if runtime.ON_GPU else "cpu"


@pytest.fixture(scope="module")
def fast():
    return load_file(PATH)


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed=0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(b, hq, nq, d, device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, nk, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    return q, k, v


def _check(o, lse, q, k, v, **mask):
    # The numbers of the grader's one attention judge: the same references and tolerance.
    for report in attention.reports(o, lse, attention.references(q, k, v, **mask), what=""):
        assert report.ok, report.message


CASES = [  # b, hq, hkv, nq, nk, d, mask
    (1, 2, 2, 40, 40, 16, {}),
    (2, 4, 2, 37, 53, 32, dict(causal=True)),                   # GQA, Nq < Nk, partial blocks
    (1, 2, 1, 70, 30, 16, dict(causal=True)),                   # MQA; Nq > Nk: the first 40 rows see nothing
    (1, 4, 2, 90, 90, 32, dict(causal=True, window=9)),         # a window shorter than a block
    (1, 2, 2, 75, 64, 64, dict(causal=True, window=40)),
    (1, 4, 1, 160, 160, 16, dict(causal=True, window=70)),      # masked edge blocks on both sides of whole ones
    (1, 1, 1, 33, 65, 128, {}),
    (2, 8, 2, 45, 45, 16, dict(causal=True, window=12, sink_tokens=3)),   # 4 heads a group; 3 sink tokens
    (1, 8, 1, 50, 70, 32, dict(causal=True, window=20, sink_tokens=40)),  # 8 heads; sinks reach into the window
]


def _with_sinks(mask, hq):
    if not mask.pop("learned_sinks", False):
        return mask
    return dict(mask, sinks=torch.linspace(-3.0, 40.0, hq, device=DEVICE))    # up to a sink that swamps every row


@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, mask", CASES + [
    (1, 4, 2, 60, 60, 16, dict(learned_sinks=True)),
    (1, 8, 2, 66, 66, 32, dict(causal=True, window=10, sink_tokens=2, learned_sinks=True)),
    (1, 4, 4, 70, 30, 16, dict(causal=True, learned_sinks=True)),   # rows that see no key: o = 0, lse = the sink
])
@pytest.mark.parametrize("pack_gqa", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_the_float64_reference(fast, b, hq, hkv, nq, nk, d, mask, pack_gqa, dtype):
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, dtype)
    mask = _with_sinks(dict(mask), hq)
    o, lse = fast.flash_attention(q, k, v, pack_gqa=pack_gqa, **mask)
    assert o.dtype == dtype and lse.dtype == torch.float32 and o.shape == q.shape and lse.shape == q.shape[:3]
    _check(o, lse, q, k, v, **mask)


WINDOWED = [case for case in CASES if case[-1].get("window")]


@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, mask", WINDOWED)
@pytest.mark.parametrize("most", [0, 1 << 20])
def test_a_windows_blocks_in_one_masked_loop_or_in_two(fast, b, hq, hkv, nq, nk, d, mask, most):
    """Every window above, its blocks taken in two loops (``one_loop_window=0``) and in one masked loop
    (every window at most ``1 << 20``), whichever ``ONE_LOOP_WINDOW`` would pick."""
    assert fast.one_loop(mask["window"]) == (mask["window"] <= fast.ONE_LOOP_WINDOW)
    assert fast.one_loop(mask["window"], most) == (mask["window"] <= most) and not fast.one_loop(0, most)
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, torch.float32, seed=2)
    o, lse = fast.flash_attention(q, k, v, one_loop_window=most, **mask)
    _check(o, lse, q, k, v, **mask)


def test_rows_that_see_nothing_give_zero_and_minus_infinity(fast):
    q, k, v = _inputs(1, 2, 2, 50, 20, 16, torch.float32)
    o, lse = fast.flash_attention(q, k, v, causal=True)
    assert torch.all(o[:, :, :30] == 0) and torch.all(lse[:, :, :30] == float("-inf"))
    assert torch.isfinite(lse[:, :, 30:]).all()


@pytest.mark.parametrize("hq, hkv", [(3, 3), (4, 2)])   # one head a program, and a packed GQA group
@pytest.mark.parametrize("host", [True, False])          # K's and V's descriptors made on the host, or in the kernel
def test_strided_inputs_and_fixed_tiles(fast, hq, hkv, host):
    q, k, v = _inputs(2, hq, hkv, 45, 45, 32, torch.float32, seed=1)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))   # (B, N, H, D) storage
    assert not qt.is_contiguous() and fast.tma_compatible(qt)
    o, lse = fast.flash_attention(qt, kt, vt, causal=True, sm_scale=0.3, block_m=16, block_n=32,
                                  host_descriptors=host)
    assert o.stride() == qt.stride()            # read where it lies and written in the same layout: no copy
    _check(o, lse, q, k, v, causal=True, sm_scale=0.3)


def test_host_made_descriptors_take_the_tile_the_autotuner_tries(fast):
    """The autotuner's hook sets each configuration's key block on host-made descriptors (their
    tile must be the kernel's); the kernel's own descriptors need nothing.  An empty tensor gets
    no host descriptor (none can describe it): the kernel makes its own."""
    q, k, v = _inputs(1, 4, 2, 40, 40, 32, torch.float32)
    k_desc, v_desc = fast.kv_descriptors(k, v, tuple(k.shape), k.stride(), v.stride(), 16)
    assert k_desc.base is k and v_desc.base is v and k_desc.block_shape == [1, 1, 16, 32]
    fast._descriptor_tiles(dict(K=k_desc, V=v_desc, HOST_DESC=True, BLOCK_N=64, HEAD_DIM_PAD=32))
    assert k_desc.block_shape == v_desc.block_shape == [1, 1, 64, 32]
    fast._descriptor_tiles(dict(K=k, V=v, HOST_DESC=False, BLOCK_N=64, HEAD_DIM_PAD=32))      # tensors: untouched
    empty = k[:, :, :0]
    assert fast.kv_descriptors(empty, empty, tuple(empty.shape), empty.stride(), empty.stride(), 16) is None


def test_strides_a_descriptor_cannot_take_are_copied_first(fast):
    q, k, v = _inputs(1, 2, 2, 33, 33, 18, torch.float32, seed=3)
    qs, ks, vs = (x[..., :16] for x in (q, k, v))          # rows 72 bytes apart: not on 16 bytes
    assert not fast.tma_compatible(qs)
    o, lse = fast.flash_attention(qs, ks, vs, causal=True)
    assert o.is_contiguous()
    _check(o, lse, qs, ks, vs, causal=True)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(d=48), ValueError, ["head_dim", "powers of two"]),
    (dict(window=8), ValueError, ["window", "causal"]),
    (dict(sm_scale=-1.0), ValueError, ["sm_scale"]),
    (dict(block_m=24), ValueError, ["block_m"]),
    (dict(pack_gqa=1), TypeError, ["pack_gqa"]),
    (dict(host_descriptors=1), TypeError, ["host_descriptors"]),
    (dict(one_loop_window=-1), ValueError, ["one_loop_window"]),
    (dict(one_loop_window=True), ValueError, ["one_loop_window"]),
    (dict(sinks=torch.zeros(3)), ValueError, ["sinks"]),
])
def test_bad_input_names_the_argument(fast, kwargs, error, words):
    d = kwargs.pop("d", 16)
    q, k, v = _inputs(1, 1, 1, 8, 8, d, torch.float32)
    with pytest.raises(error) as info:
        fast.flash_attention(q, k, v, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_the_bench_times_it_beside_the_solution_and_says_where_it_cannot_go():
    forward = Case(1, 4, 40, 40, 16, kv_heads=2, causal=True, window=8, dtype=torch.float32)
    cases = [forward, Case(1, 4, 40, 40, 16, kv_heads=2, causal=True, window=8, backward=True,
                                 dtype=torch.float32),
             Case(1, 4, 40, 40, 16, kv_heads=2, causal=True, window=8, sink_tokens=2, sinks=True,
                        dtype=torch.float32),
             Case(1, 2, 40, 40, 24, dtype=torch.float32)]
    for stage in ("stage5", "stage6", "stage7", "stage8", "stage9"):
        assert "solution-tma" in PROVIDERS[stage]
    rows = measure.run("stage8", cases=cases, providers=["solution-tma"], device=DEVICE, timer=lambda fn: 1.0,
                       memory=lambda make: None, log=lambda *a, **k: None)
    assert [r["note"] for r in rows] == ["", "", "", "n/a: the TMA variant takes head dims that are powers of two"]
    assert rows[0]["ms"] == rows[1]["ms"] == rows[2]["ms"] == 1.0   # checked against the reference, then timed
    learner = measure.run("stage7", source="stages", cases=cases[:1], providers=["solution-tma"], device=DEVICE,
                          timer=lambda fn: 1.0, memory=lambda make: None, log=lambda *a, **k: None)
    assert learner[0]["note"] == "n/a: the TMA variant is an instructor's file, solutions/fast_forward_tma.py"


@pytest.mark.skipif(not runtime.ON_GPU, reason="bfloat16 and the autotuned tiles need a CUDA GPU")
@pytest.mark.parametrize("mask", [{}, dict(causal=True), dict(causal=True, window=300)])
def test_gpu_long_sequences_in_bfloat16(fast, mask):
    q, k, v = _inputs(1, 4, 2, 2048, 2048, 128, torch.bfloat16)       # 2048 x 2048 pairs: the autotuner runs
    o, lse = fast.flash_attention(q, k, v, **mask)
    _check(o[:, :2], lse[:, :2], q[:, :2], k[:, :1], v[:, :1], **mask)


@pytest.fixture(scope="module")
def split_probe():
    return load_file(ROOT / "grader" / "bench" / "probes" / "split_q_forward.py")


def _max_growth(q, k, causal, first_keys, log2e):
    """The most any row's running maximum (log2 units, the kernels' scale) grows from its first
    block of ``first_keys`` keys to the end, in float64."""
    s = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5 * log2e
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return (s.amax(-1) - s[..., :first_keys].amax(-1)).max().item()


def _growing_inputs(kind):
    """Inputs whose row maxima grow past float32's range (2**128) after the first key block:
    ``all`` rows at once (keys that grow along the sequence), or ``one`` row alone (one query and
    one later key that meet in a coordinate no other row or key uses)."""
    q, k, v = _inputs(1, 2, 2, 64, 64, 16, torch.float32, seed=5)
    if kind == "all":
        return q, k * torch.linspace(0.1, 60.0, 64, device=DEVICE)[:, None], v
    q, k = q.clone(), k.clone()
    q[..., 0], k[..., 0] = 0.0, 0.0
    q[0, 0, 50, 0] = k[0, 0, 40, 0] = 40.0                  # row 50 meets key 40: logit 400 / 4 (x log2 e)
    return q, k, v


@pytest.mark.parametrize("kind", ["all", "one"])
@pytest.mark.parametrize("variant", ["plain", "split", "lazy", "split+lazy"])
@pytest.mark.parametrize("causal", [False, True])
def test_the_split_query_probe_s_kernel_matches_the_float64_reference(split_probe, variant, causal, kind):
    """grader/bench/probes/split_q_forward.py times a forward with two query halves a program and
    a lazy rescale; each variant is judged here as the TMA forward is, so that the probe never times
    a wrong kernel.  In both kinds of input some row's maximum grows by more than float32's range
    after its first key block, so a lazy rescale that waits too long overflows, and with ``one``
    only one row's does, so a test on the rows' smallest growth misses it."""
    q, k, v = _growing_inputs(kind)
    assert _max_growth(q, k, causal, first_keys=16, log2e=split_probe.LOG2E) > 128
    o, lse = split_probe.forward(q, k, v, causal, (32, 16, 4, 1), *split_probe.VARIANTS[variant])
    _check(o, lse, q, k, v, causal=causal)
