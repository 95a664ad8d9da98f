"""The op's C++ eager path (solutions/attention_op/native.py and native.cpp).

On the CPU: native.cpp compiles against this PyTorch's headers; the description of a launch (what
C++ will repeat) is checked argument by argument on stand-in compiled kernels, with the cases it
must refuse; attention() calls the C++ path only where it may, and falls back when it has no plan.
On a GPU: the C++ path gives the Python path's bits, forward and backward, for the TMA kernels and
stage 9's, with and without sinks; a dO of another layout is copied, a key it cannot describe stays
in Python, CUDA graphs capture it, and a Triton launch hook keeps calls in Python.
"""

import shutil
import struct
import subprocess
import sysconfig
from pathlib import Path
from types import SimpleNamespace

from kernels import runtime
from kernels.loader import ROOT, load_package

import numpy as np
import pytest
import torch

PATH = ROOT / "solutions" / "attention_op"
pytestmark = pytest.mark.skipif(not PATH.exists(), reason="this copy of the workbook has no solutions/")
gpu = pytest.mark.skipif(not runtime.ON_GPU, reason="needs a CUDA GPU: the C++ path launches CUDA kernels")


@pytest.fixture(scope="module")
def op():
    return load_package(PATH)


# ---------------------------------------------------------------------------------------------
# CPU: the source compiles, launches are described exactly, attention() routes correctly.
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_native_source_compiles_against_this_torch(tmp_path):
    """g++ -fsyntax-only with this PyTorch's headers and CUDA's cuda.h (a CPU build of PyTorch lacks
    one generated CUDA header, stood in for here)."""
    include = Path(torch.__file__).parent / "include"
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    cuda_h = next((Path(root) / "include" / "cuda.h" for root in ("/usr/local/cuda", "/usr/cuda")
                   if (Path(root) / "include" / "cuda.h").exists()), None)
    if shutil.which("g++") is None or not python_h.exists() or cuda_h is None:
        pytest.skip("needs g++, Python's headers and CUDA's cuda.h")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    if not (include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=native_check", f"-I{tmp_path}",
           f"-I{include}", f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", f"-I{python_h.parent}",
           f"-I{cuda_h.parent}", str(PATH / "native.cpp")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def _compiled(signature, *, function=0x1234, num_warps=4, shared=1024, scratch=0, **meta):
    metadata = SimpleNamespace(num_warps=num_warps, shared=shared, global_scratch_size=scratch, num_ctas=1,
                               launch_pdl=False, launch_cooperative_grid=False, profile_scratch_size=0)
    for name, value in meta.items():
        setattr(metadata, name, value)
    return SimpleNamespace(metadata=metadata, function=function, src=SimpleNamespace(signature=signature))


SIGNATURE = {"q": "*bf16", "o": "*bf16", "lse": "*fp32", "stride": "i32", "big": "i64", "scale": "fp32",
             "flag": "u1", "BLOCK": "constexpr", "one": "constexpr"}


def test_a_launch_is_described_argument_by_argument(op):
    q = torch.zeros(2, 8)
    o, lse = torch.zeros(2, 8), torch.zeros(16)
    rows = lse.view(4, 4)                                   # a view of a buffer is that buffer
    record = [(_compiled(SIGNATURE, scratch=128), (3, 2), (q, o, rows, 7, 2**40, 0.125, True, 64, 1))]
    inputs, allocs, launches, outputs = op.native.describe_part(record, [q, None, o, lse], 2, [2, 3])
    assert (inputs, outputs) == (2, [2, 3]) and allocs[0] is o and allocs[1] is lse
    (function, grid, threads, shared, scratch, args, host_error, maps), = launches
    assert (function, grid, threads, shared, scratch, host_error) == (0x1234, [3, 2, 1], 128, 1024, 128 * 6, 0)
    assert maps == []
    n = op.native
    assert args == [(n.BUFFER, 0), (n.BUFFER, 2), (n.BUFFER, 3), (n.INT32, 7), (n.INT64, 2**40),
                    (n.FLOAT32, struct.unpack("<I", struct.pack("<f", 0.125))[0]), (n.INT8, 1)]
    # As launch.py records them: addresses, not tensors.
    addresses = (n.Pointer(q.data_ptr()), n.Pointer(o.data_ptr()), n.Pointer(rows.data_ptr()))
    record = [(_compiled(SIGNATURE, scratch=128), (3, 2), (*addresses, 7, 2**40, 0.125, True, 64, 1))]
    assert n.describe_part(record, [q, None, o, lse], 2, [2, 3])[2] == launches


DESC_SIGNATURE = {"q": "*bf16", "K": "tensordesc<bf16[1, 1, 32, 64]>", "n": "i32", "HOST_DESC": "constexpr"}
DESC_META = dict(swizzle=3, elem_size=2, elem_type=9, block_size=[1, 1, 32, 64], fp4_padded=False)


def _descriptor(op, k, block=(1, 1, 32, 64)):
    """A host-made descriptor of k (B, H, N, D) as launch.py records it (the CPU interpreter's
    TensorDescriptor takes any aligned tensor)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    return op.native.Descriptor(TensorDescriptor(k, list(k.shape), list(k.stride()), list(block)))


def test_a_host_made_descriptor_is_described_as_tritons_launcher_passes_it(op):
    """Triton's launcher passes a host-made TMA descriptor as the CUtensorMap it makes from the
    tensor's address (the tile, swizzle and data type the kernel was compiled for), then the
    shape and the strides; native.cpp makes the map again over the buffer of each call."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    n = op.native
    q = torch.zeros(2, 64)
    k = torch.zeros(2, 3, 40, 64).transpose(1, 2).contiguous().transpose(1, 2)     # (B, N, H, D) storage
    record = [(_compiled(DESC_SIGNATURE, tensordesc_meta=[DESC_META]), (5, 6), (q, _descriptor(op, k), 7, True))]
    inputs, allocs, launches, outputs = n.describe_part(record, [q, k], 2, [])
    (function, grid, threads, shared, scratch, args, host_error, maps), = launches
    assert args == [(n.BUFFER, 0), (n.TENSOR_MAP, 0), *((n.INT32, x) for x in (2, 3, 40, 64)),
                    *((n.INT64, x) for x in k.stride()), (n.INT32, 7)]
    assert maps == [[1, 3, 2, TMA_DTYPE_DEVICE_TO_HOST[9], 0, 4, 1, 1, 32, 64, 2, 3, 40, 64, *k.stride()]]


@pytest.mark.parametrize("case", ["lowered without a descriptor", "no buffer", "fp4", "a tensor for a descriptor"])
def test_descriptors_that_cannot_be_repeated_are_refused(op, case):
    q, k = torch.zeros(2, 64), torch.zeros(2, 3, 40, 64)
    meta, desc = dict(tensordesc_meta=[DESC_META]), _descriptor(op, k)
    if case == "lowered without a descriptor":                 # passed as a pointer, shape and strides instead
        meta = dict(tensordesc_meta=None)
    elif case == "no buffer":
        desc = _descriptor(op, torch.zeros(2, 3, 40, 64))
    elif case == "fp4":
        meta = dict(tensordesc_meta=[dict(DESC_META, fp4_padded=True)])
    elif case == "a tensor for a descriptor":
        desc = op.native.Pointer(k.data_ptr())
    record = [(_compiled(DESC_SIGNATURE, **meta), (1,), (q, desc, 7, True))]
    assert op.native.describe_part(record, [q, k], 2, []) is None


class _HostLib:
    """A stand-in for a built wgmma kernel: two C functions with addresses (libc's, never called)."""

    def __init__(self):
        import ctypes
        libc = ctypes.CDLL(None)
        self.stage4w_forward, self.stage4w_error_string = libc.strlen, libc.strerror


def _host_args(op, q, k, v, o, lse, sinks):
    """The arguments launch.py records, as the wgmma file's forward_args makes them (a bf16 q: dtype 1)."""
    return op.plans.wgmma.forward_args(q, k, v, o, lse, range(100, 112), (2, 8, 2, 40, 50, 72), 0.125, True, 16, 2,
                                       sinks)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_wgmma_call_is_described_as_native_cpp_calls_it(op, with_sinks):
    """The wgmma forward is a host function, not a Triton launch: recorded as a HostCall, described with
    its function's and its error text's addresses and every argument in the order native.cpp's
    HostForward takes them, buffers by index, absent sinks as NULL."""
    import ctypes
    n = op.native
    q, k, v, o, lse, sinks = (torch.zeros(16) for _ in range(6))
    q = q.to(torch.bfloat16)
    lib = _HostLib()
    call = n.HostCall(lib, _host_args(op, q, k, v, o, lse, sinks if with_sinks else None))
    buffers = [q, k, v, sinks if with_sinks else None, o, lse]
    (function, grid, threads, shared, scratch, args, host_error, maps), = n.describe_part([call], buffers, 4, [4, 5])[2]
    assert maps == []
    assert function == ctypes.cast(lib.stage4w_forward, ctypes.c_void_p).value
    assert host_error == ctypes.cast(lib.stage4w_error_string, ctypes.c_void_p).value != 0
    assert (grid, threads, shared, scratch) == ([1, 1, 1], 0, 0, 0)
    assert args[:5] == [(n.BUFFER, 0), (n.BUFFER, 1), (n.BUFFER, 2), (n.BUFFER, 4), (n.BUFFER, 5)]
    assert args[5:17] == [(n.INT64, s) for s in range(100, 112)]
    assert args[17:23] == [(n.INT32, x) for x in (2, 8, 2, 40, 50, 72)]
    assert args[23] == (n.FLOAT32, struct.unpack("<I", struct.pack("<f", 0.125))[0])
    assert args[24:28] == [(n.INT32, x) for x in (1, 1, 16, 2)]
    assert args[28] == ((n.BUFFER, 3) if with_sinks else (n.NULL, 0))
    assert len(args) == 29
    args = _host_args(op, q, k, v, o, lse, None)
    empty = n.HostCall(lib, (*args[:9], 0, *args[10:]))
    assert n.describe_part([empty], buffers, 4, [4, 5])[2][0][1] == [0, 1, 1]        # Nq = 0: nothing to launch
    stranger = n.HostCall(lib, _host_args(op, q, k, v, torch.zeros(16), lse, None))     # o none of the buffers
    assert n.describe_part([stranger], buffers, 4, [4, 5]) is None


def test_a_part_native_cpp_cannot_repeat_leaves_the_key_in_python(op):
    """launch.py records NOT_REPLAYED for the one-pass backward: the part is not described, so the
    key stays on the Python path."""
    q, o, lse = (torch.zeros(16) for _ in range(3))
    assert op.native.describe_part([op.native.NOT_REPLAYED], [q, None, o, lse], 2, [2, 3]) is None
    assert op.native.describe_part([], [q, None, o, lse], 2, [2, 3]) is not None


@pytest.mark.parametrize("case", ["unknown pointer", "one object twice", "two objects one pointer", "a cluster",
                                  "arguments missing", "a float where an int goes", "an address where an int goes",
                                  "a tuple argument", "no function", "scratch aligned wider"])
def test_launches_that_cannot_be_repeated_are_refused(op, case):
    q, o, lse = torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(16)
    args = [q, o, lse, 7, 2**40, 0.125, True, 64, 1]
    buffers, compiled = [q, None, o, lse], _compiled(SIGNATURE)
    if case == "unknown pointer":
        args[2] = torch.zeros(16)                            # a padded copy of lse, say
    elif case == "one object twice":
        buffers[1] = q
    elif case == "two objects one pointer":
        buffers[1] = q.view(16)
    elif case == "a cluster":
        compiled = _compiled(SIGNATURE, num_ctas=2)
    elif case == "arguments missing":
        args = args[:-1]
    elif case == "a float where an int goes":
        args[3] = 7.0
    elif case == "an address where an int goes":
        args[3] = op.native.Pointer(q.data_ptr())
    elif case == "scratch aligned wider":
        compiled = _compiled(SIGNATURE, scratch=128, global_scratch_align=1024)
    elif case == "a tuple argument":
        compiled = _compiled({**SIGNATURE, "stride": ("i32", "i32")})
    elif case == "no function":
        compiled = _compiled(SIGNATURE, function=None)
    assert op.native.describe_part([(compiled, (1,), tuple(args))], buffers, 2, [2, 3]) is None


class _Stand:
    """A stand-in for the built extension: answers ``result`` and keeps what it was given."""

    def __init__(self, result):
        self.result, self.calls, self.records = result, [], []

    def attention(self, *args):
        self.calls.append(args)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def record(self, *args):
        self.records.append(args)


@pytest.fixture
def stand_in(op, monkeypatch):
    def install(result):
        stand = _Stand(result)
        monkeypatch.setattr(op.native, "_module", stand)
        monkeypatch.setattr(op.native, "_started", True)     # no build may replace the stand-in
        return stand
    return install


def _small(grad=False):
    return [torch.randn(1, 2, 8, 16, device=runtime.DEVICE, dtype=torch.float32 if not runtime.ON_GPU
                        else torch.float16, requires_grad=grad) for _ in range(3)]


def test_a_plan_answers_the_call(op, stand_in):
    q, k, v = _small()
    stand = stand_in(sentinel := torch.ones(1))
    assert op.attention(q, k, v, is_causal=True, window=4, scale=0.5) is sentinel
    assert stand.calls == [(q, k, v, None, True, 0.5, False, 4, 0, "bhnd", op.plans.KERNELS)]


@pytest.mark.parametrize("result", [None, TypeError("incompatible function arguments")])
def test_no_plan_falls_back_to_python(op, stand_in, result):
    q, k, v = _small()
    stand = stand_in(result)
    with op.native.off():
        expected = op.attention(q, k, v, is_causal=True)
    assert torch.equal(op.attention(q, k, v, is_causal=True), expected)
    assert len(stand.calls) == 1
    if not q.is_cuda:
        assert stand.records == []                          # a CPU call is never recorded


@pytest.mark.parametrize("options", [dict(window=True, is_causal=True), dict(scale=1), dict(sink_tokens=True),
                                     dict(layout=b"bhnd"), dict(is_causal=np.True_), dict(enable_gqa=np.False_)],
                         ids=["window bool", "scale int", "sink_tokens bool", "layout bytes", "is_causal numpy",
                              "enable_gqa numpy"])
def test_arguments_python_must_judge_never_reach_the_plans(op, stand_in, options):
    """A plan's key would take True for 1, b"bhnd" for "bhnd" and numpy's True for True: such calls go
    to the Python path, which accepts or refuses them as it always has."""
    q, k, v = _small()
    stand = stand_in(torch.ones(1))
    try:
        op.attention(q, k, v, **options)
    except (TypeError, ValueError):
        pass
    assert stand.calls == []


def test_compiling_or_a_dispatch_mode_never_reaches_the_plans(op, stand_in):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):                           # real tensors, a mode about
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    stand = stand_in(torch.ones(1))
    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in _small())
        op.attention(q, k, v)
    q, k, v = _small()
    with Watch():
        op.attention(q, k, v)
    with op.native.off():
        op.attention(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(op.attention, backend="eager", fullgraph=True)
    assert compiled(q, k, v, is_causal=True).shape == q.shape   # traced: the op, not the stand-in's answer
    assert stand.calls == []


def test_a_key_on_the_python_path_is_not_recorded_again(op, stand_in):
    q, k, v = _small()
    stand = stand_in(False)                                     # the extension's answer for such a key
    with op.native.off():
        expected = op.attention(q, k, v)
    assert torch.equal(op.attention(q, k, v), expected)
    assert len(stand.calls) == 1 and stand.records == []


# ---------------------------------------------------------------------------------------------
# GPU: the C++ path against the Python path, bit for bit.
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built(op):
    if not runtime.ON_GPU:
        pytest.skip("needs a CUDA GPU")
    module = op.native.build(wait=True)
    assert module is not None, f"the C++ path did not build: {op.native.failure()}"
    return module


def _inputs(b, hq, hkv, n, d, *, layout, sinks, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (lambda h: (b, h, n, d)) if layout == "bhnd" else (lambda h: (b, n, h, d))
    q = torch.randn(*shape(hq), device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(*shape(hkv), device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    s = torch.randn(hq, device="cuda", generator=gen) if sinks else None
    return q, k, v, s


CASES = {   # (B, Hq, Hkv, N, D, layout, options)
    "tma bnhd causal window sinks gqa": (1, 8, 2, 256, 64, "bnhd", dict(is_causal=True, window=64, sinks=True)),
    "tma bhnd dense d128": (2, 4, 4, 192, 128, "bhnd", {}),
    "stage 9 d24 causal": (1, 4, 2, 100, 24, "bnhd", dict(is_causal=True, sink_tokens=3, window=16)),
    "d80 bnhd causal sinks gqa": (2, 8, 2, 200, 80, "bnhd", dict(is_causal=True, sinks=True)),
}
# "wgmma": the wgmma forward wherever it can run (a GPU of compute capability 9.0), recorded as a host call.
WGMMA = runtime.ON_GPU and torch.cuda.get_device_capability() == (9, 0)
KERNEL_SETS = ["auto", "stage9", *(["wgmma"] if WGMMA else [])]


def _call(op, q, k, v, s, layout, options):
    options = {key: value for key, value in options.items() if key != "sinks"}
    return op.attention(q, k, v, sinks=s, enable_gqa=q.shape[1 if layout == "bhnd" else 2] != k.shape[
        1 if layout == "bhnd" else 2], layout=layout, **options)


def _fwd_bwd(op, q, k, v, s, layout, options, do):
    leaves = [t.detach().requires_grad_(True) if t is not None else None for t in (q, k, v, s)]
    o = _call(op, *leaves, layout, options)
    grads = torch.autograd.grad(o, [t for t in leaves if t is not None], do)
    return o.detach(), grads


@gpu
@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_cpp_path_gives_the_python_paths_bits(op, built, case, kernel_set, monkeypatch):
    monkeypatch.setattr(op.plans, "KERNELS", kernel_set)
    python_wgmma = []                                       # the wgmma forwards the Python path ran
    real = op.launch._wgmma_forward
    monkeypatch.setattr(op.launch, "_wgmma_forward", lambda *a, **kw: (python_wgmma.append(1), real(*a, **kw))[1])
    b, hq, hkv, n, d, layout, options = CASES[case]
    q, k, v, s = _inputs(b, hq, hkv, n, d, layout=layout, sinks=options.get("sinks", False))
    do = torch.randn_like(q)
    with op.native.off():
        want = _fwd_bwd(op, q, k, v, s, layout, options, do)
        with torch.no_grad():
            want_o = _call(op, q, k, v, s, layout, options)
    assert bool(python_wgmma) == (kernel_set == "wgmma" and d % 8 == 0), "the wgmma forward ran where not planned"
    before, python_before = op.native.counts(), len(python_wgmma)
    for _ in range(3):                                      # the first call records, the others replay
        got = _fwd_bwd(op, q, k, v, s, layout, options, do)
        with torch.no_grad():
            got_o = _call(op, q, k, v, s, layout, options)
    after = op.native.counts()
    assert torch.equal(got_o, want_o) and torch.equal(got[0], want[0])
    assert got_o.stride() == want_o.stride() and got[0].stride() == want[0].stride()
    if kernel_set == "wgmma" and d in (64, 128) and n % 128 == 0:
        # The one-pass backward (NOT_REPLAYED): the key with a gradient stays on the Python path,
        # whose dQ additions have no fixed order; the calls without one replay in C++.
        assert after["backward_runs"] == before["backward_runs"] and after["forward_runs"] > before["forward_runs"]
        for g, w in zip(got[1], want[1]):
            torch.testing.assert_close(g, w, atol=2e-2, rtol=0)
            assert g.stride() == w.stride()
        return
    assert after["forward_runs"] - before["forward_runs"] >= 4 and after["backward_runs"] - before["backward_runs"] >= 2
    assert len(python_wgmma) - python_before <= 2           # the two recording calls; C++ ran the rest
    for g, w in zip(got[1], want[1]):
        assert torch.equal(g, w) and g.stride() == w.stride()


@gpu
def test_sinks_without_a_gradient_and_another_do_layout(op, built):
    b, hq, hkv, n, d, layout, options = CASES["tma bnhd causal window sinks gqa"]
    q, k, v, s = _inputs(b, hq, hkv, n, d, layout=layout, sinks=True, seed=1)
    do = torch.randn_like(q)
    for _ in range(2):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        o = _call(op, *leaves, s, layout, options)
        assert s.grad is None
        torch.autograd.grad(o, leaves, do)
    copies = op.native.counts()["do_copies"]
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    got = torch.autograd.grad(_call(op, *leaves, s, layout, options).sum(), leaves)    # dO of stride 0
    assert op.native.counts()["do_copies"] == copies + 1
    with op.native.off():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        want = torch.autograd.grad(_call(op, *leaves, s, layout, options), leaves, torch.ones_like(q))
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@gpu
@pytest.mark.skipif(not runtime.ON_GPU or torch.cuda.get_device_capability()[0] != 9,
                    reason="the TMA backward (compute capability 9) pads lse when Nq is not a multiple of 4")
def test_a_key_it_cannot_describe_stays_in_python(op, built):
    """Nq = 30: the TMA backward copies lse into padded rows, a buffer the plan does not have.  The
    key is recorded once, as the Python path's, and never again."""
    q, k, v, s = _inputs(1, 4, 4, 30, 64, layout="bhnd", sinks=False, seed=2)
    do = torch.randn_like(q)
    got = _fwd_bwd(op, q, k, v, None, "bhnd", {}, do)
    before = op.native.counts()
    for _ in range(3):
        got = _fwd_bwd(op, q, k, v, None, "bhnd", {}, do)
    after = op.native.counts()
    assert after["backward_runs"] == before["backward_runs"] and after["plans"] == before["plans"]
    with op.native.off():
        want = _fwd_bwd(op, q, k, v, None, "bhnd", {}, do)
    assert torch.equal(got[0], want[0]) and all(torch.equal(g, w) for g, w in zip(got[1], want[1]))


@gpu
def test_saved_tensors_given_back_in_another_layout_are_copied(op, built):
    """A saved-tensor hook (offloading, say) may give q, k, v, o and lse back contiguous: the C++
    backward copies them into the layout its launches were recorded with."""
    b, hq, hkv, n, d, layout, options = CASES["tma bnhd causal window sinks gqa"]
    q, k, v, s = _inputs(b, hq, hkv, n, d, layout=layout, sinks=True, seed=7)
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))   # (B, N, H, D) in bhnd order
    do = torch.randn_like(q)
    for _ in range(2):                                          # recorded, then replayed
        want = _fwd_bwd(op, q, k, v, s, layout, options, do)
    copies = op.native.counts()["saved_copies"]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.contiguous(), lambda t: t):
        got = _fwd_bwd(op, q, k, v, s, layout, options, do)
    assert op.native.counts()["saved_copies"] > copies
    assert torch.equal(got[0], want[0]) and all(torch.equal(g, w) for g, w in zip(got[1], want[1]))


@gpu
@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_cuda_graphs_capture_the_cpp_path(op, built, kernel_set, monkeypatch):
    monkeypatch.setattr(op.plans, "KERNELS", kernel_set)
    q, k, v, s = _inputs(1, 8, 2, 256, 64, layout="bnhd", sinks=True, seed=3)
    options = dict(is_causal=True, window=64, sinks=True)
    with torch.no_grad():
        _call(op, q, k, v, s, "bnhd", options)              # recorded here
        runs = op.native.counts()["forward_runs"]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o = _call(op, q, k, v, s, "bnhd", options)
        assert op.native.counts()["forward_runs"] == runs + 1
        q.copy_(torch.randn_like(q))
        graph.replay()
        with op.native.off():
            want = _call(op, q, k, v, s, "bnhd", options)
    torch.cuda.synchronize()
    assert torch.equal(o, want)


@gpu
def test_a_side_stream_and_a_launch_hook(op, built):
    """A call on a side stream launches there: it finishes while the default stream still sleeps."""
    import triton
    q, k, v, s = _inputs(2, 4, 4, 128, 64, layout="bhnd", sinks=False, seed=4)
    with torch.no_grad():
        want = _call(op, q, k, v, None, "bhnd", {})             # recorded
        torch.cuda.synchronize()
        runs = op.native.counts()["forward_runs"]
        stream = torch.cuda.Stream()
        torch.cuda._sleep(2**30)                                # the default stream: busy for a while
        with torch.cuda.stream(stream):
            got = _call(op, q, k, v, None, "bhnd", {})
            got_host = got.cpu()                                # waits for the side stream only
        assert not torch.cuda.current_stream().query(), "the default stream slept too briefly to tell"
        assert op.native.counts()["forward_runs"] == runs + 1
        assert torch.equal(got_host, want.cpu())
        seen = []
        hooks = triton.knobs.runtime.launch_enter_hook          # a chain of hooks, empty by default
        hook = seen.append
        hooks.add(hook)
        try:
            _call(op, q, k, v, None, "bhnd", {})
        finally:
            hooks.remove(hook)
        assert seen and op.native.counts()["forward_runs"] == runs + 1


@gpu
def test_a_sum_loop_and_aliased_inputs_are_recorded_once_they_can_be(op, built):
    """A key first met with a .sum()'s dO (stride 0) is recorded with that dO copied into o's
    layout; a call whose k is its v is not recorded (whose pointer is whose?), the next one is."""
    q, k, v, s = _inputs(1, 4, 4, 64, 64, layout="bhnd", sinks=False, seed=5)
    before = op.native.counts()
    for _ in range(3):
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        got = torch.autograd.grad(op.attention(*leaves).sum(), leaves)
    after = op.native.counts()
    assert after["backward_runs"] - before["backward_runs"] == 2 and after["do_copies"] - before["do_copies"] == 2
    with op.native.off():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        want = torch.autograd.grad(op.attention(*leaves), leaves, torch.ones_like(q))
    assert all(torch.equal(g, w) for g, w in zip(got, want))

    q, k, _, _ = _inputs(1, 4, 4, 64, 32, layout="bhnd", sinks=False, seed=6)
    with torch.no_grad():
        keys = op.native.counts()["keys"]
        aliased = op.attention(q, k, k)
        assert op.native.counts()["keys"] == keys               # not recorded
        op.attention(q, k, k.clone())                           # the same key, recorded
        assert op.native.counts()["keys"] == keys + 1
        runs = op.native.counts()["forward_runs"]
        again = op.attention(q, k, k)                           # and repeated, k passed twice
        assert op.native.counts()["forward_runs"] == runs + 1 and torch.equal(again, aliased)
