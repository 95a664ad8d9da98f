"""Stage 4's Hopper variant (solutions/fast_variable_block_wgmma.py/.cu) against the float64 reference.

Without a GPU: nvcc builds the .cu for sm_90a (the build's own record of its shared memory must
match the .py's plan), every planned tile fits, bad input is refused by name, and the bench
says why it cannot time it.  On an H100 or H200 the kernel runs against float64 attention.
"""

import ctypes
import subprocess

from kernels import cuda_build, runtime
from kernels.loader import ROOT, load_file

import pytest
import torch
from test_fast_forward import CASES, _check, _with_sinks  # o and lse against float64, as the forward's tests judge them

from grader.bench import measure
from grader.bench.cases import PROVIDERS, Case

PATH = ROOT / "solutions" / "fast_variable_block_wgmma.py"
pytestmark = pytest.mark.skipif(not PATH.exists(), reason="this copy of the workbook has no solutions/")
DEVICE = "cuda" if runtime.ON_GPU else "cpu"
ON_HOPPER = runtime.ON_GPU and torch.cuda.get_device_capability() == (9, 0)
needs_hopper = pytest.mark.skipif(not ON_HOPPER, reason="wgmma and setmaxnreg need an sm_90 GPU (H100, H200)")


@pytest.fixture(scope="module")
def fast():
    return load_file(PATH)


def _inputs(b, h, nq, nk, d, dtype, seed=0, scale=1.0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(b, h, nq, d, device=DEVICE, dtype=dtype, generator=gen) * scale
    k, v = (torch.randn(b, h, nk, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    return q.to(dtype), k, v


# ---- any machine -------------------------------------------------------------------------

def test_every_planned_tile_fits_in_shared_memory(fast):
    assert set(fast.WINDOW_TILES) == set(fast.TILES)
    for d in range(16, 257, 8):
        for causal, window in ((False, False), (True, False), (True, True)):
            block_n, warpgroups, stages, _ = fast.plan(d, causal, window)
            assert fast.smem_bytes(d, block_n, warpgroups, stages) <= fast.SMEM_LIMIT - 256, (d, causal, window)
    with pytest.raises(ValueError, match="head_dim"):
        fast.plan(264)


def test_the_host_call_s_arguments(fast):
    """forward_args and call, shared by flash_attention and solutions/attention_op: ARGTYPES' order,
    a window or sink tokens past Nk clamped to Nk, the strides as 12 int64, an error named."""
    q, k, v, o, lse = (torch.zeros(4, dtype=dtype) for dtype in (torch.float16,) * 4 + (torch.float32,))
    sinks = torch.zeros(2)
    args = fast.forward_args(q, k, v, o, lse, range(12), (1, 2, 1, 30, 40, 64), 0.5, True, 10**12, 10**11, sinks)
    assert args == (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), tuple(range(12)),
                    1, 2, 1, 30, 40, 64, 0.5, 0, 1, 40, 40, sinks.data_ptr())
    assert fast.forward_args(q.bfloat16(), k, v, o, lse, range(12), (1, 2, 1, 30, 40, 64), 0.5, False, None, 3,
                             None)[13:] == (1, 0, 0, 3, None)
    assert len(args) + 1 == len(fast.ARGTYPES)                  # + the stream

    class Lib:
        def stage4w_forward(self, *given):
            self.given = given
            return self.answer

        def stage4w_error_string(self, code):
            return b"the head dim does not match" if code == -1 else b"?"
    lib = Lib()
    lib.answer = 0
    fast.call(lib, args, 77)
    assert list(lib.given[5]) == list(range(12)) and lib.given[:5] + lib.given[6:] == args[:5] + args[6:] + (77,)
    lib.answer = -1
    with pytest.raises(RuntimeError, match="the wgmma kernel failed: the head dim does not match"):
        fast.call(lib, args, 77)


@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("d", [72, 160])
def test_nvcc_builds_the_planned_kernel_and_its_shared_memory_matches_the_plan(fast, d, tmp_path):
    """A host-side library needs no GPU: its stage4w_config reports what the kernel will ask for."""
    block_n, warpgroups, stages, pingpong = fast.plan(d)
    library = tmp_path / f"wgmma_{d}.so"
    cmd = [cuda_build.nvcc(), "-shared", "-Xcompiler", "-fPIC", cuda_build.gencode(fast.ARCH), *cuda_build.FLAGS,
           f"-DHEAD_DIM={d}", f"-DBLOCK_N={block_n}", f"-DWARPGROUPS={warpgroups}", f"-DSTAGES={stages}",
           f"-DPINGPONG={int(pingpong)}", str(fast.CU_FILE), "-o", str(library)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    config = (ctypes.c_int * 7)()
    ctypes.CDLL(str(library)).stage4w_config(config)
    assert list(config) == [d, 64 * warpgroups, block_n, warpgroups, 128 * (warpgroups + 1),
                            fast.smem_bytes(d, block_n, warpgroups, stages), int(pingpong)]


def _planned_builds():
    """(head dim, mask) at the top of every table entry, the most registers the entry's tile
    needs: "full" and "causal" from TILES, "causal" from CAUSAL_TILES, "window" from WINDOW_TILES."""
    if not PATH.exists():
        return []
    fast = load_file(PATH)
    return list(dict.fromkeys([(d, "full") for d in fast.TILES] + [(d, "causal") for d in fast.TILES]
                              + [(d, "window") for d in fast.WINDOW_TILES]))     # causal: CAUSAL_TILES where listed


# How each mask's instantiation of attention_kernel<..., T, CAUSAL, WINDOW> ends in ptxas's names.
_MANGLED = {"full": "Lb0ELb0EEEvNS_6ParamsE", "causal": "Lb1ELb0EEEvNS_6ParamsE", "window": "Lb1ELb1EEEvNS_6ParamsE"}


def test_ptxas_lines_are_told_apart_by_kernel():
    """ptxas prints its warnings before the entry they are about, naming it; the frame line after."""
    report = """ptxas info    : (C7514) Performance Loss: wgmma ... serialized due to x in the function 'kB'
ptxas info    : (C7512) Performance Loss: wgmma ... serialized due to y for the function 'kA'
ptxas info    : Compiling entry function 'kA' for 'sm_90a'
ptxas info    : Function properties for kA
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'kB' for 'sm_90a'
ptxas info    : Function properties for kB
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""
    said = cuda_build.ptxas_by_function(report)
    assert list(said) == ["kB", "kA"]
    assert "(C7512)" in said["kA"][0] and said["kA"][1].startswith("0 bytes stack frame")
    assert "(C7514)" in said["kB"][0] and said["kB"][1].startswith("8 bytes stack frame, 4 bytes spill stores")


@pytest.mark.slow
@pytest.mark.skipif(cuda_build.nvcc() is None, reason="nvcc not found")
@pytest.mark.parametrize("d, mask", _planned_builds())
def test_ptxas_keeps_every_planned_tiles_products_in_flight(fast, d, mask, tmp_path):
    """ptxas says when it makes a kernel's wgmmas wait for each other (C7510-C7515: an accumulator
    touched while in flight, too few registers): the instantiation each planned tile serves (both
    dtypes) must compile without it, and without spilling.  Each build holds that mask's kernels
    alone (ONLY_MASK): the others' are another tile's business."""
    block_n, warpgroups, stages, pingpong = fast.plan(d, mask != "full", mask == "window")
    defines = (f"-DHEAD_DIM={d}", f"-DBLOCK_N={block_n}", f"-DWARPGROUPS={warpgroups}", f"-DSTAGES={stages}",
               f"-DPINGPONG={int(pingpong)}", f"-DONLY_MASK={list(_MANGLED).index(mask)}")
    cmd = [cuda_build.nvcc(), "-cubin", cuda_build.gencode(fast.ARCH), *cuda_build.FLAGS, "-Xptxas", "-v",
           *defines, str(fast.CU_FILE), "-o", str(tmp_path / "k.cubin")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    functions = cuda_build.ptxas_by_function(result.stderr)
    served = {name: notes for name, notes in functions.items() if name.endswith(_MANGLED[mask])}
    assert len(functions) == 2 and len(served) == 2, list(functions)
    for name, notes in served.items():
        assert any(" 0 bytes spill stores" in n for n in notes), (name, notes)
        assert not [n for n in notes if "(C75" in n or "spill stores" in n and " 0 bytes spill stores" not in n], \
            (name, notes)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(block_n=24), ValueError, ["block_n", "multiple of 16"]),
    (dict(warpgroups=4), ValueError, ["warpgroups"]),
    (dict(stages=1), ValueError, ["stages"]),
    (dict(d=256, block_n=256, warpgroups=3, stages=4), ValueError, ["shared memory", "block_n = 256"]),
    (dict(d=12), ValueError, ["head_dim"]),
    (dict(pingpong=1), ValueError, ["pingpong", "True or False"]),
])
def test_bad_input_names_the_argument(fast, kwargs, error, words):
    d = kwargs.pop("d", 64)
    q, k, v = _inputs(1, 1, 8, 8, d, torch.float16)
    with pytest.raises(error) as info:
        fast.flash_attention(q, k, v, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_query_heads_that_are_not_a_multiple_of_the_kv_heads_are_refused(fast):
    q, _, _ = _inputs(1, 3, 8, 8, 64, torch.float16)
    k, v, _ = _inputs(1, 2, 8, 8, 64, torch.float16)
    with pytest.raises(ValueError, match="multiple"):
        fast.flash_attention(q, k, v)


@pytest.mark.skipif(ON_HOPPER, reason="checks the message given off Hopper")
def test_off_hopper_it_says_which_gpu_it_needs(fast):
    q, k, v = _inputs(1, 1, 8, 8, 64, torch.float16)
    with pytest.raises(RuntimeError, match="sm_90"):
        fast.flash_attention(q, k, v)


def test_the_bench_lists_it_for_stage4_and_says_where_it_cannot_go():
    assert all("solution-wgmma" in PROVIDERS[f"stage{n}"] for n in range(4, 9))     # it takes stages 5-8's masks too
    cases = [Case(1, 2, 64, 64, 72, dtype=torch.float16)]
    quiet = dict(timer=lambda fn: 1.0, memory=lambda make: None, log=lambda *a, **k: None)
    learner = measure.run("stage4", source="stages", cases=cases, providers=["solution-wgmma"], device=DEVICE, **quiet)
    assert learner[0]["note"] == ("n/a: the wgmma variant is an instructor's file, "
                                  "solutions/fast_variable_block_wgmma.py")
    if not ON_HOPPER:
        rows = measure.run("stage4", cases=cases, providers=["solution-wgmma"], device=DEVICE, **quiet)
        assert rows[0]["note"] == "n/a: the wgmma variant runs on sm_90 GPUs (H100, H200) only"


# ---- on an H100 / H200 -------------------------------------------------------------------

HEAD_DIMS = [16, 40, 64, 72, 96, 128, 160, 200, 256]


@needs_hopper
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_head_dims(fast, d, dtype):
    q, k, v = _inputs(2, 3, 131, 257, d, dtype, seed=d)
    _check(*fast.flash_attention(q, k, v), q, k, v)


@needs_hopper
@pytest.mark.parametrize("d", [48, 72, 96, 160])
@pytest.mark.parametrize("nq, nk", [(200, 200), (77, 300), (300, 77), (1, 129), (1000, 129), (129, 1000)])
def test_gpu_causal_and_odd_lengths(fast, d, nq, nk):
    q, k, v = _inputs(1, 2, nq, nk, d, torch.bfloat16, seed=nq + nk, scale=2.0)
    o, lse = fast.flash_attention(q, k, v, causal=True)
    _check(o, lse, q, k, v, causal=True)
    if nq > nk:                                  # the first nq - nk rows see no key
        assert torch.all(o[:, :, : nq - nk] == 0) and torch.all(lse[:, :, : nq - nk] == float("-inf"))


@needs_hopper
@pytest.mark.parametrize("tiles", [dict(block_n=128, warpgroups=2, stages=3), dict(block_n=64, warpgroups=1),
                                   dict(block_n=32, warpgroups=3, stages=4), dict(block_n=176, warpgroups=2),
                                   dict(block_n=128, warpgroups=3, pingpong=False),
                                   dict(block_n=64, warpgroups=3, pingpong=True),
                                   dict(block_n=96, warpgroups=2, stages=3, pingpong=True)])
def test_gpu_tile_overrides(fast, tiles):
    q, k, v = _inputs(1, 2, 300, 450, 96, torch.float16, seed=7)
    _check(*fast.flash_attention(q, k, v, causal=True, **tiles), q, k, v, causal=True)


@needs_hopper
def test_gpu_non_contiguous_inputs_and_scale(fast):
    q, k, v = (torch.randn(2, n, 3, 72, device=DEVICE, dtype=torch.bfloat16).transpose(1, 2) for n in (100, 140, 140))
    o, lse = fast.flash_attention(q, k, v, sm_scale=0.2)
    _check(o, lse, q, k, v, sm_scale=0.2)


@needs_hopper
def test_gpu_contiguous_inputs_that_start_off_16_bytes(fast):
    q, k, v = (torch.randn(1 * 2 * 90 * 72 + 1, device=DEVICE, dtype=torch.float16)[1:].view(1, 2, 90, 72)
               for _ in range(3))
    assert q.is_contiguous() and q.data_ptr() % 16
    _check(*fast.flash_attention(q, k, v), q, k, v)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_long_sequences(fast, causal):
    q, k, v = _inputs(1, 4, 2048, 2048, 96, torch.bfloat16, seed=3)
    o, lse = fast.flash_attention(q, k, v, causal=causal)
    _check(o, lse, q, k, v, causal=causal)


# The TMA forward's cases (GQA, windows, sink tokens, learned sinks), then longer ones whose
# windows start many key blocks in and whose sink tokens fill more than one block.
MASK_CASES = CASES + [
    (1, 4, 2, 60, 60, 16, dict(learned_sinks=True)),
    (1, 8, 2, 66, 66, 32, dict(causal=True, window=10, sink_tokens=2, learned_sinks=True)),
    (1, 4, 4, 70, 30, 16, dict(causal=True, learned_sinks=True)),   # rows that see no key: o = 0, lse = the sink
    (1, 8, 1, 1500, 1500, 64, dict(causal=True, window=300, sink_tokens=200, learned_sinks=True)),
    (2, 4, 2, 700, 1100, 128, dict(causal=True, window=128, sink_tokens=4)),
    (1, 4, 4, 600, 600, 96, dict(causal=True, window=1)),
    (1, 6, 3, 900, 500, 72, dict(causal=True, window=257, sink_tokens=129)),
    (1, 16, 2, 1000, 1000, 64, dict(learned_sinks=True)),
    (1, 4, 1, 800, 800, 160, dict(causal=True, learned_sinks=True)),
]


@needs_hopper
@pytest.mark.parametrize("b, hq, hkv, nq, nk, d, mask", MASK_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_gqa_windows_and_sinks(fast, b, hq, hkv, nq, nk, d, mask, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(nq + d)
    q = torch.randn(b, hq, nq, d, device=DEVICE, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, nk, d, device=DEVICE, dtype=dtype, generator=gen) for _ in range(2))
    mask = _with_sinks(dict(mask), hq)
    o, lse = fast.flash_attention(q, k, v, **mask)
    _check(o, lse, q, k, v, **mask)


@needs_hopper
@pytest.mark.parametrize("tiles", [dict(block_n=128, warpgroups=3), dict(block_n=64, warpgroups=1, pingpong=False),
                                   dict(block_n=16, warpgroups=2, stages=3)])
def test_gpu_window_with_tile_overrides(fast, tiles):
    q, k, v = _inputs(1, 4, 777, 777, 64, torch.bfloat16, seed=11)
    sinks = torch.linspace(-2.0, 3.0, 4, device=DEVICE)
    opts = dict(causal=True, window=100, sink_tokens=20, sinks=sinks)
    _check(*fast.flash_attention(q, k, v, **opts, **tiles), q, k, v, **opts)


@needs_hopper
def test_gpu_windows_and_sink_tokens_past_every_key_mean_every_key(fast):
    """A window or sink-token count larger than a C int reaches the kernel as Nk, not wrapped."""
    q, k, v = _inputs(1, 2, 300, 200, 64, torch.bfloat16, seed=5)
    for huge in (dict(window=2**32 + 5), dict(window=3, sink_tokens=2**32 + 5)):
        o, lse = fast.flash_attention(q, k, v, causal=True, **huge)
        _check(o, lse, q, k, v, causal=True, **huge)


@needs_hopper
def test_gpu_a_sink_of_minus_infinity_on_rows_that_see_no_key(fast):
    q, k, v = _inputs(1, 2, 70, 30, 64, torch.bfloat16, seed=6)
    sinks = torch.tensor([float("-inf"), 1.0], device=DEVICE)
    o, lse = fast.flash_attention(q, k, v, causal=True, sinks=sinks)
    assert torch.all(o[:, :, :40] == 0) and not o.isnan().any()
    assert torch.all(lse[:, 0, :40] == float("-inf")) and torch.all(lse[:, 1, :40] == 1.0)
    _check(o, lse, q, k, v, causal=True, sinks=sinks)
