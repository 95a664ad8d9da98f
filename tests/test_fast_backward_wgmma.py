"""The one-pass wgmma backward (solutions/fast_backward_wgmma.{py,cu}) and the probe that times its variants.

Without a GPU: every kind of variant compiles for sm_90a without spills or serialized products,
within the block's registers and an H100's shared memory; the masked loop has no branch per
element; the fragment order of dQ is put back in rows of any layout; bad input is refused by
name.  On an sm_90 GPU: gradients against float64 autograd (GQA, windows, sink tokens, learned
sinks, (B, N, H, D) views), judged as stage 9's checks judge them.
"""

import re
import subprocess

from kernels import cuda_build, runtime
from kernels.loader import ROOT, load_file

import pytest
import torch
from test_fast_backward import _check_grads

PATH = ROOT / "solutions" / "fast_backward_wgmma.py"
pytestmark = pytest.mark.skipif(not PATH.exists(), reason="this copy of the workbook has no solutions/")
PROBE = ROOT / "grader" / "bench" / "probes" / "wgmma_backward.py"
HOPPER = runtime.ON_GPU and torch.cuda.get_device_capability() == (9, 0) and cuda_build.nvcc() is not None


@pytest.fixture(scope="module")
def fast():
    return load_file(PATH)


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
# Leaving dQ's additions out (leave_out 1) takes out what the dQ modes do differently, so that a tma
# build without them is the warp1 one less nothing but its last wait for the bulk copies (which the
# tma builds compile) and a larger shared memory: (128, "2x2-warp1", 1) stands for both.
@pytest.mark.parametrize("d, config, leave_out", [(64, "2x2-warp1-early", 0), (128, "2x2-warp1-early", 0),
                                                  (64, "2x2-tma2", 0), (128, "2x3-tma1", 0),
                                                  (128, "2x2-atomic", 0), (64, "2x2-atomic", 2),
                                                  (64, "2x2-warp1", 0), (128, "2x2-warp2-early", 0),
                                                  (128, "2x2-warp1", 1), (64, "2x3-warp1-early-prefetch", 0)])
def test_each_variant_compiles_for_hopper(d, config, leave_out, tmp_path):
    """The probe builds the kernel's variants on the GPU machine (the first two are the fast
    path's defaults, built here with both dtypes; the others with bfloat16 alone, since what they
    change no dtype touches); here, without a GPU, each kind compiles for sm_90a with no spilled
    register and no serialized matrix product (ptxas's "wgmma.mma_async instructions are
    serialized" warning), asks for shared memory an H100 has, and moves registers between its
    warpgroups within the block's allocation (asking for more hangs the GPU)."""
    probe = load_file(PROBE)
    dtypes = 2 if (config, leave_out) == ("2x2-warp1-early", 0) else 1
    lib = probe.build(d, config, tmp_path, leave_out=leave_out, bf16_only=dtypes == 1)
    entries = re.findall(r"Function properties for (\S+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores"
                         r".*\n.*Used (\d+) registers", lib.ptxas)
    ours = [(name, spills, regs) for name, spills, regs in entries if "backward_kernel" in name]
    assert len(ours) == 2 * dtypes, lib.ptxas[-2000:]          # each dtype dense and causal
    assert all("bfloat16" in name for name, *_ in ours) or dtypes == 2
    rows = [name for name, *_ in entries if "rows_kernel" in name]
    assert len(rows) == dtypes, lib.ptxas[-2000:]              # dQ back in rows
    assert len(entries) == 3 * dtypes, [name for name, *_ in entries]   # none of the forward's kernels
    assert all(spills == "0" for _, spills, _ in entries), entries
    assert "serialized" not in lib.ptxas, lib.ptxas[-2000:]
    assert lib.config[:3] == (d, 128, 384) and lib.config[3] <= 227 * 1024
    assert lib.config[6] == probe.parse_config(config)[1]
    launched = {int(regs) for *_, regs in ours}
    assert len(launched) == 1, launched
    assert 128 * lib.config[4] + 256 * lib.config[5] <= launched.pop() * 384, lib.config


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("d", [64, 128])
def test_no_branch_an_element_while_a_product_is_in_flight(d, tmp_path):
    """Between the wait for S^T and the wait for dP^T, while dP^T multiplies, the one pass turns S^T
    into P^T.  Where the workbook's rule cuts the block it masks each element; if that test becomes
    a branch per element (as a window test written with && and || once did: 64 of them), the warps
    stall there.  In the PTX for sm_90a a masked kernel may branch at most 3 times in that stretch
    (choosing the masked or the plain loop), and a dense one not at all."""
    probe = load_file(PROBE)
    ptx = tmp_path / "backward.ptx"
    done = subprocess.run(probe.nvcc_command(d, "2x2-warp1-early") + ["-ptx", "-o", str(ptx)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    text = ptx.read_text()
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry (\S+)\(", text)]
    counted = {}
    for i, (start, name) in enumerate(starts):
        if "backward_kernel" not in name:
            continue
        body = text[start:starts[i + 1][0] if i + 1 < len(starts) else len(text)]
        s_ready = body.index("wgmma.wait_group.sync.aligned 1")
        dp_ready = body.index("wgmma.wait_group.sync.aligned 0", s_ready)
        counted[name] = len(re.findall(r"\bbra(\.uni)?\s", body[s_ready:dp_ready]))
    assert len(counted) == 4, counted            # float16 and bfloat16, dense and causal
    for name, branches in counted.items():
        assert branches <= (3 if name.endswith("Lb1EEEvNS_6ParamsE") else 0), counted


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
def test_the_fast_paths_own_source_compiles_alone(fast, tmp_path):
    """``library`` builds a copy of the source elsewhere, so the forward's helpers are inlined into
    it (``source``); that text compiles by itself, from a folder without the forward's file."""
    text = fast.source()
    assert fast.FORWARD_INCLUDE not in text and "namespace stage4w" in text and "bwdw_backward" in text
    alone = tmp_path / "kernel.cu"
    alone.write_text(text)
    done = cuda_build.compile_only(alone, arch="sm_90a", defines={"HEAD_DIM": 64})
    assert done.ok, done.output[-2000:]


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
def test_prefetching_at_head_dim_128_is_refused_when_it_compiles():
    """The prefetching variant holds the next step's S^T beside dK, dV and dQ: at head dim 128 that
    spills registers, so the source refuses it with a message rather than build a slow kernel."""
    done = cuda_build.compile_only(ROOT / "solutions" / "fast_backward_wgmma.cu", arch="sm_90a",
                                   defines={"HEAD_DIM": 128, "BWD_STAGES": 3, "BWD_PREFETCH": 1})
    assert not done.ok and "BWD_PREFETCH: at D 128 the next step's S^T spills registers" in done.output


@pytest.mark.parametrize("text", ["2x2", "1x2-tma2", "2x2-tma3", "2x2-atomics", "2xa-tma1", "2x5-atomic",
                                  "2x2-warp", "2x2-warp1-late", "2x2-early", "2x2-warp1-order-early",
                                  "2x2-warp1-order-prefetch"])
def test_the_probe_names_a_bad_configuration(text):
    probe = load_file(PROBE)
    with pytest.raises(SystemExit, match="--configs"):
        probe.parse_config(text)
    assert probe.parse_config("2x3-tma1") == (3, 1, 1, 0, 0, 0)
    assert probe.parse_config("2x2-atomic") == (2, 0, 0, 0, 0, 0)
    assert probe.parse_config("2x2-warp2-early") == (2, 2, 2, 1, 0, 0)
    assert probe.parse_config("2x2-warp1-early-order") == (2, 2, 1, 1, 1, 0)
    assert probe.parse_config("2x3-warp1-early-prefetch-order") == (3, 2, 1, 1, 1, 1)
    assert probe.head_dims("2x3-warp1-early-prefetch") == (64,) and probe.head_dims("2x2-warp1") == (64, 128)


def _fragment_order(rows: torch.Tensor) -> torch.Tensor:
    """The float32 buffer the kernel leaves, laid out element by element from its own addresses:
    warpgroup w, warp w4, lane 4 g + t, register 4 j + 2 i + e holds row 16 w4 + g + 8 i, column
    w D / 2 + 8 j + 2 t + e of its 64-row tile, stored at float w 64 D / 2 + 4 (32 (4 j + w4) + lane)
    + 2 i + e of the tile."""
    B, H, N, d = rows.shape
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
    return stored.reshape(B, H, N, d)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_the_fragment_order_is_put_back_in_rows_of_any_layout(fast, d, layout):
    """``rows_of_fragments`` undoes the writer warp's order, scaled and cast, into dq where it lies:
    a (B, H, N, D) tensor, or a (B, N, H, D) one seen as (B, H, N, D)."""
    B, H, N = 1, 2, 128
    rows = torch.arange(B * H * N * d, dtype=torch.float32).reshape(B, H, N, d)
    stored = _fragment_order(rows)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(B, H, N, d, dtype=dtype) if layout == "bhnd" else \
            torch.empty(B, N, H, d, dtype=dtype).transpose(1, 2)
        fast.rows_of_fragments(stored, out, 0.5)
        assert torch.equal(out, (rows * 0.5).to(dtype))
    wrong = stored.clone().view(-1)
    wrong[[0, 1]] = wrong[[1, 0]]                     # two registers swapped: caught
    out = torch.empty(B, H, N, d)
    assert not torch.equal(fast.rows_of_fragments(wrong.view(B, H, N, d), out, 0.5), rows * 0.5)


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100, H200) and nvcc")
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("layout", ["bhnd", "bnhd", "padded"])
def test_gpu_rows_kernel_is_rows_of_fragments(fast, d, layout):
    """The library's dQ conversion writes exactly what ``rows_of_fragments`` (held to the writer's
    order above) writes, into dq where it lies; a dq it cannot write (rows 4 elements apart) is
    written by ``rows_of_fragments`` instead."""
    B, H, N = 2, 3, 256
    stored = torch.randn(B, H, N, d, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        if layout == "bhnd":
            out = torch.empty(B, H, N, d, device="cuda", dtype=dtype)
        elif layout == "bnhd":
            out = torch.empty(B, N, H, d, device="cuda", dtype=dtype).transpose(1, 2)
        else:
            out = torch.empty(B, H, N, d + 4, device="cuda", dtype=dtype)[..., :d]
        want = fast.rows_of_fragments(stored, torch.empty_like(out), 0.125)
        out.fill_(7)
        assert fast.rows_fit(out) == (layout != "padded")
        got = fast.rows(fast.library(d), stored, out, 0.125, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert got is out and torch.equal(out, want), (layout, dtype)


def _bf16(*shape):
    return torch.zeros(shape, dtype=torch.bfloat16)


@pytest.mark.parametrize("change, error, words", [
    (dict(q=_bf16(1, 2, 128, 96), k=_bf16(1, 2, 128, 96), v=_bf16(1, 2, 128, 96)), ValueError, "head_dim is 96"),
    (dict(q=_bf16(1, 2, 200, 64)), ValueError, "q and k: .*multiples of 128"),
    (dict(k=_bf16(1, 2, 200, 64), v=_bf16(1, 2, 200, 64)), ValueError, "q and k: .*multiples of 128"),
    (dict(k=_bf16(1, 3, 128, 64), v=_bf16(1, 3, 128, 64)), ValueError, "multiple of the number of key/value"),
    (dict(lse=torch.zeros(1, 2, 128, dtype=torch.float16)), ValueError, "lse must be"),
    (dict(do=_bf16(1, 2, 128, 32)), ValueError, "do must be"),
    (dict(order=2), ValueError, "order must be"),
    (dict(window=64), ValueError, "window"),
    (dict(), RuntimeError, "needs an sm_90 GPU"),
])
def test_bad_input_names_the_argument(fast, change, error, words):
    """Shapes the kernel does not take are refused before anything is built or launched."""
    args = dict(q=_bf16(1, 2, 128, 64), k=_bf16(1, 2, 128, 64), v=_bf16(1, 2, 128, 64), o=None, lse=None,
                do=None, order=None)
    args.update(change)
    q = args["q"]
    args["o"] = args["o"] if args["o"] is not None else torch.zeros_like(q)
    args["do"] = args["do"] if args["do"] is not None else torch.zeros_like(q)
    if args["lse"] is None:
        args["lse"] = torch.zeros(q.shape[:3])
    window = args.pop("window", None)
    with pytest.raises(error, match=words):
        fast.flash_attention_backward(**args, window=window)


def test_order_launches_few_causal_blocks_longest_first(fast, monkeypatch):
    """Longest first only under the causal mask, and only for grids of a few waves."""
    class Props:
        multi_processor_count = 132
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    assert fast.order_for(1, 8, 4096, True, None) == 1             # 256 blocks
    assert fast.order_for(4, 16, 4096, True, None) == 0            # 2048 blocks
    assert fast.order_for(1, 8, 4096, False, None) == 0
    assert not fast.supports(1, 8, 4096, 4000, 64) and fast.supports(1, 8, 4096, 4096, 128)


# (batch, query heads, K/V heads, Nq, Nk, D, mask, learned sinks, layout)
GPU_CASES = [
    (2, 3, 3, 384, 384, 64, dict(), False, "bhnd"),
    (2, 3, 3, 384, 384, 128, dict(causal=True), False, "bhnd"),
    (1, 4, 2, 384, 384, 64, dict(causal=True), True, "bnhd"),
    (1, 4, 1, 256, 256, 128, dict(), False, "bnhd"),
    (1, 4, 2, 384, 384, 64, dict(causal=True, window=100, sink_tokens=4), True, "bhnd"),
    (1, 8, 2, 512, 512, 128, dict(causal=True, window=200), True, "bnhd"),
    (1, 2, 1, 256, 512, 64, dict(causal=True), False, "bhnd"),          # more keys than queries
    (1, 2, 2, 512, 256, 64, dict(causal=True), True, "bhnd"),           # rows that see no key but the sink
]


@pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100, H200) and nvcc")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, mask, learned, layout", GPU_CASES)
def test_gpu_gradients_match_float64_autograd(fast, b, hq, hkv, nq, nk, d, mask, learned, layout, dtype):
    """Against autograd through the float64 reference, both launch orders, inputs as (B, H, N, D)
    tensors or (B, N, H, D) ones seen as (B, H, N, D) (read and written where they lie)."""
    forward = load_file(ROOT / "solutions" / "fast_forward_tma.py")
    gen = torch.Generator(device="cuda").manual_seed(nq + d)

    def make(h, n):
        x = torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=gen)
        return x.transpose(1, 2) if layout == "bnhd" else x.transpose(1, 2).contiguous()
    q, do = make(hq, nq), make(hq, nq)
    k, v = make(hkv, nk), make(hkv, nk)
    sinks = torch.randn(hq, device="cuda", generator=gen) if learned else None
    o, lse = forward.flash_attention(q, k, v, sinks=sinks, **mask)
    for order in (0, 1):
        got = fast.flash_attention_backward(q, k, v, o, lse, do, sinks=sinks, order=order, **mask)
        for x, like in zip(got[:3], (q, k, v)):
            assert x.stride() == like.stride()
        _check_grads(got, q, k, v, do, sinks=sinks, **mask)


def test_the_inlined_source_is_kept_under_its_hash(fast, tmp_path, monkeypatch):
    """The build reads a copy of ``source()`` named by its hash and written whole: two versions
    (or two processes) never share, or half-read, one file."""
    monkeypatch.setenv("WORKBOOK_CACHE", str(tmp_path))
    path = fast._inlined_file()
    assert path.read_text() == fast.source() and path.parent.parent == tmp_path / "cuda"
    assert fast._inlined_file() == path and [p.name for p in path.parent.iterdir()] == [path.name]
    monkeypatch.setattr(fast, "source", lambda: "// another version\n")
    other = fast._inlined_file()
    assert other != path and other.read_text() == "// another version\n" and path.exists()
