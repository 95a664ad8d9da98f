"""The TMA variant of the backward (solutions/fast_backward_tma.py) against float64 autograd.

The gradients are judged as stage 9's checks judge them: against autograd through the float64
reference, allowing 3x the error of the same computation in the inputs' dtype.  On the CPU
Triton's interpreter runs the descriptors as ordinary loads; the GPU runs add bfloat16 and
long sequences, where the autotuner picks the tiles.
"""

import ctypes
import re
import subprocess

from kernels import cuda_build, reference, runtime, tolerance
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


def test_strided_inputs_and_a_fixed_dq_tile(fast):
    q, k, v, do = _inputs(2, 4, 2, 45, 45, 32, torch.float32, seed=1)
    qt, kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))   # (B, N, H, D)
    assert not qt.is_contiguous() and do.is_contiguous()        # dO in the other layout: strides of its own
    o, lse = fast.flash_attention(qt, kt, vt, causal=True, sm_scale=0.3)
    got = fast.flash_attention_backward(qt, kt, vt, o, lse, do, causal=True, sm_scale=0.3, block_m=16, block_n=16)
    # Read where they lie, the gradients in the inputs' layout: no copy on the way in or out.
    assert [g.stride() for g in got[:3]] == [qt.stride(), kt.stride(), vt.stride()]
    _check_grads(got, q, k, v, do, causal=True, sm_scale=0.3)


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


WGMMA_PROBE = ROOT / "grader" / "bench" / "probes" / "wgmma_backward.py"


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("d, config, leave_out", [(64, "2x2-tma2", 0), (128, "2x2-tma2", 0), (128, "2x3-tma1", 0),
                                                  (128, "2x2-atomic", 0), (128, "2x2-tma2", 1), (64, "2x2-atomic", 2),
                                                  (64, "2x2-warp1-order", 0), (128, "2x2-warp2-early", 0),
                                                  (128, "2x2-warp1", 1)])
def test_the_wgmma_backward_probe_compiles_for_hopper(d, config, leave_out, tmp_path):
    """grader/bench/probes/wgmma_backward.py builds its kernel on the GPU machine; here, without a
    GPU, each kind of variant it times compiles for sm_90a with no spilled register and no
    serialized matrix product (ptxas's "wgmma.mma_async instructions are serialized" warning),
    asks for shared memory an H100 has, and moves registers between its warpgroups within the
    block's allocation."""
    probe = load_file(WGMMA_PROBE)
    lib = probe.build(d, config, tmp_path, leave_out=leave_out)
    entries = re.findall(r"Function properties for (\S+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores",
                         lib.ptxas)
    ours = [(name, spills) for name, spills in entries if "bwdw" in name]
    assert len(ours) == 4, lib.ptxas[-2000:]          # float16 and bfloat16, dense and causal
    assert all(spills == "0" for _, spills in ours), ours
    assert "serialized" not in lib.ptxas, lib.ptxas[-2000:]
    config_out = (ctypes.c_int * 6)()
    lib.bwdw_config(config_out)
    assert list(config_out)[:3] == [d, 128, 384] and config_out[3] <= 227 * 1024
    # setmaxnreg only moves registers within what the block was launched with: asking for more hangs.
    launched = {int(n) for n in re.findall(r"Used (\d+) registers", lib.ptxas)}
    assert len(launched) == 1, launched
    assert 128 * config_out[4] + 256 * config_out[5] <= launched.pop() * 384, list(config_out)


@pytest.mark.parametrize("shape, words", [((1, 2, 200, 64), "N must be a multiple of 128"),
                                          ((1, 2, 128, 96), "D 64 or 128")])
def test_the_wgmma_backward_probe_refuses_shapes_its_kernel_does_not_take(shape, words):
    """Its kernel reads lse and delta in whole 64-row blocks and splits dQ's columns in panels:
    other shapes are refused before anything is launched, naming q."""
    probe = load_file(WGMMA_PROBE)
    q = torch.zeros(shape)
    with pytest.raises(ValueError, match=f"q: .*{words}"):
        probe.backward(None, q, q, q, q, None, q, False, None)
    with pytest.raises(ValueError, match="k: .*contiguous"):
        probe.backward(None, q, q.transpose(1, 2), q, q, None, q, False, None)


def test_the_wgmma_backward_probe_refuses_what_its_kernel_does_not_compute():
    """K/V heads must divide the query heads, and the workbook's window comes with causal."""
    probe = load_file(WGMMA_PROBE)
    q, kv = torch.zeros(1, 4, 128, 64), torch.zeros(1, 3, 128, 64)
    with pytest.raises(ValueError, match="k: its 3 heads must divide q's 4"):
        probe.backward(None, q, kv, kv, q, None, q, True, None)
    with pytest.raises(ValueError, match="window: .*causal"):
        probe.backward(None, q, q[:, :2].contiguous(), q[:, :2].contiguous(), q, None, q, False, None, 64)


@pytest.mark.parametrize("text", ["2x2", "1x2-tma2", "2x2-tma3", "2x2-atomics", "2xa-tma1", "2x5-atomic",
                                  "2x2-warp", "2x2-warp1-late", "2x2-early", "2x2-warp1-order-early"])
def test_the_wgmma_backward_probe_names_a_bad_configuration(text):
    probe = load_file(WGMMA_PROBE)
    with pytest.raises(SystemExit, match="--configs"):
        probe.parse_config(text)
    assert probe.parse_config("2x3-tma1") == (3, 1, 1, 0, 0) and probe.parse_config("2x2-atomic") == (2, 0, 0, 0, 0)
    assert probe.parse_config("2x2-warp2-early") == (2, 2, 2, 1, 0)
    assert probe.parse_config("2x2-warp1-early-order") == (2, 2, 1, 1, 1)


@pytest.mark.parametrize("d", [64, 128])
def test_the_writer_warps_fragment_order_is_put_back_in_rows(d):
    """With a writer warp (``warp1``, ``warp2``) each consumer thread stores its dQ fragments in
    register order and the float32 buffer keeps that order; the probe's ``rows_of_fragments`` must
    undo it.  The expected buffer is laid out here element by element from the kernel's own
    addresses: warpgroup w, warp w4, lane 4 g + t, register 4 j + 2 i + e holds row
    16 w4 + g + 8 i, column w D / 2 + 8 j + 2 t + e of its 64-row tile, stored at float
    w 64 D / 2 + 4 (32 (4 j + w4) + lane) + 2 i + e of the tile."""
    probe = load_file(WGMMA_PROBE)
    B, H, N = 1, 2, 128
    rows = torch.arange(B * H * N * d, dtype=torch.float32).reshape(B, H, N, d)
    stored = torch.empty(B * H * N * d)
    for bh in range(B * H):
        for tile in range(N // 64):
            base = (bh * N + tile * 64) * d
            for w in range(2):
                for w4 in range(4):
                    for lane in range(32):
                        g, t = divmod(lane, 4)
                        for j in range(d // 16):
                            for r in range(4):
                                i, e = divmod(r, 2)
                                at = base + w * 64 * (d // 2) + 4 * (32 * (4 * j + w4) + lane) + r
                                row, col = 16 * w4 + g + 8 * i, w * (d // 2) + 8 * j + 2 * t + e
                                stored[at] = rows[bh // H, bh % H, tile * 64 + row, col]
    got = probe.rows_of_fragments(stored.reshape(B, H, N, d), 0.5, torch.float32)
    assert got.is_contiguous() and torch.equal(got, rows * 0.5)
    assert probe.rows_of_fragments(stored.reshape(B, H, N, d), 1.0, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("d", [64, 128])
def test_no_branch_an_element_while_a_product_is_in_flight(d, tmp_path):
    """Between the wait for S^T and the wait for dP^T, while dP^T multiplies, the one pass turns S^T
    into P^T.  Where the workbook's rule cuts the block it masks each element; if that test becomes
    a branch per element (as a window test written with && and || once did: 64 of them), the warps
    stall there.  In the PTX for sm_90a a masked kernel may branch at most 3 times in that stretch
    (choosing the masked or the plain loop), and a dense one not at all."""
    probe = load_file(WGMMA_PROBE)
    ptx = tmp_path / "backward.ptx"
    done = subprocess.run(probe.nvcc_command(d, "2x2-warp1-early") + ["-ptx", "-o", str(ptx)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    text = ptx.read_text()
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry (\S+)\(", text)]
    counted = {}
    for i, (start, name) in enumerate(starts):
        if "bwdw" not in name:
            continue
        body = text[start:starts[i + 1][0] if i + 1 < len(starts) else len(text)]
        s_ready = body.index("wgmma.wait_group.sync.aligned 1")
        dp_ready = body.index("wgmma.wait_group.sync.aligned 0", s_ready)
        counted[name] = len(re.findall(r"\bbra(\.uni)?\s", body[s_ready:dp_ready]))
    assert len(counted) == 4, counted            # float16 and bfloat16, dense and causal
    for name, branches in counted.items():
        assert branches <= (3 if name.endswith("Lb1EEEvNS_6ParamsE") else 0), counted
