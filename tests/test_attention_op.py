"""The finished attention as a PyTorch op (solutions/attention_op/).

On the CPU: every validation error, the fake implementations (output metadata, no kernel run),
opcheck's schema, autograd and fake-tensor tests, and the interpreter's numbers against the
float64 reference in both layouts.  On a GPU: the whole of opcheck, torch.compile with
fullgraph=True, CUDA graphs (mode="reduce-overhead"), and bit-for-bit agreement with stage 9.
"""

from kernels import reference, runtime, tolerance, tuning
from kernels.loader import ROOT, load_package

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

PATH = ROOT / "solutions" / "attention_op"
pytestmark = pytest.mark.skipif(not PATH.exists(), reason="this copy of the workbook has no solutions/")
DEVICE = runtime.DEVICE
DTYPE = torch.bfloat16 if runtime.ON_GPU else torch.float32
gpu = pytest.mark.skipif(not runtime.ON_GPU, reason="needs a CUDA GPU: torch.compile and CUDA graphs of Triton kernels")


@pytest.fixture(scope="module")
def op():
    """The op on its Python path: the C++ path (native.py) has tests of its own, and this file's spies
    on the Python path's launches would miss calls it takes."""
    module = load_package(PATH)
    with module.native.off():
        yield module


@pytest.fixture(scope="module", autouse=True)
def fresh_compiles():
    """Inductor's graph cache and AOTAutograd's cache key a compiled graph by what Dynamo traced,
    which holds the op as one call: a test compiling the same function under another kernel set
    (the ``kernels`` fixture) would be handed the graph compiled under the first.  Off here."""
    from grader.bench.train import compile_caches_off
    restore = compile_caches_off()
    yield
    restore()


# Which kernels serve the op: stage 9's, or the TMA kernels ("auto" takes them on a GPU of compute
# capability 9.0; "tma" takes them in Triton's CPU interpreter too), or on such a GPU the wgmma
# forward wherever it can run ("wgmma"; "auto" takes it where its plan timed it faster).
WGMMA = runtime.ON_GPU and torch.cuda.get_device_capability() == (9, 0)
KERNEL_SETS = ["stage9", "tma" if not runtime.ON_GPU else "auto", *(["wgmma"] if WGMMA else [])]
wgmma_gpu = pytest.mark.skipif(not WGMMA, reason="needs a GPU of compute capability 9.0 (H100, H200): wgmma")


@pytest.fixture(params=KERNEL_SETS)
def kernels(op, request):
    op.plans.KERNELS = request.param
    yield request.param
    op.plans.KERNELS = "auto"


def _qkv(b, hq, hkv, nq, nk, d, layout="bhnd", dtype=DTYPE, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    shape = (lambda h, n: (b, h, n, d)) if layout == "bhnd" else (lambda h, n: (b, n, h, d))
    q = torch.randn(*shape(hq, nq), generator=gen)
    k, v = (torch.randn(*shape(hkv, nk), generator=gen) for _ in range(2))
    return [t.to(DEVICE, dtype).requires_grad_(grad) for t in (q, k, v)]


# ---------------------------------------------------------------------------------------------
# Validation: a tensor that does not fit the stated layout is an error that names it.
# ---------------------------------------------------------------------------------------------

BAD = [  # (description, shapes q, k, v in the stated layout, options, error, words the message must hold)
    ("layout unknown", ((1, 2, 8, 16),) * 3, dict(layout="nbhd"), ValueError, "layout"),
    ("q of rank 3", ((2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {}, ValueError, "q:"),
    ("v with other keys", ((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 9, 16)), {}, ValueError, "v:"),
    ("k with other batch", ((1, 2, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)), {}, ValueError, "k:"),
    ("v with other head dim", ((1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 32)), {}, ValueError, "v:"),
    ("heads that do not divide", ((1, 6, 8, 16), (1, 4, 8, 16), (1, 4, 8, 16)), dict(enable_gqa=True),
     ValueError, "k:"),
    ("GQA without enable_gqa", ((1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)), {}, ValueError, "enable_gqa"),
    ("bnhd heads that do not divide", ((1, 8, 6, 16), (1, 8, 4, 16), (1, 8, 4, 16)),
     dict(layout="bnhd", enable_gqa=True), ValueError, "layout='bnhd'"),
    ("head dim too large", ((1, 2, 8, 512),) * 3, {}, ValueError, "head dim"),
    ("window without causal", ((1, 2, 8, 16),) * 3, dict(window=4), ValueError, "window"),
    ("window 0", ((1, 2, 8, 16),) * 3, dict(window=0, is_causal=True), ValueError, "window"),
    ("window a float", ((1, 2, 8, 16),) * 3, dict(window=4.0, is_causal=True), TypeError, "window"),
    ("sink_tokens negative", ((1, 2, 8, 16),) * 3, dict(sink_tokens=-1), ValueError, "sink_tokens"),
    ("scale negative", ((1, 2, 8, 16),) * 3, dict(scale=-0.1), ValueError, "scale"),
    ("scale a list", ((1, 2, 8, 16),) * 3, dict(scale=[0.1]), ValueError, "scale"),
    ("is_causal a string", ((1, 2, 8, 16),) * 3, dict(is_causal="yes"), TypeError, "is_causal"),
]


@pytest.mark.parametrize("what, shapes, options, error, words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(op, what, shapes, options, error, words):
    q, k, v = (torch.randn(*s, device=DEVICE, dtype=DTYPE) for s in shapes)
    with pytest.raises(error, match=words.replace("(", r"\(")):
        op.attention(q, k, v, **options)


def test_bad_sinks(op):
    q, k, v = _qkv(1, 4, 2, 8, 8, 16)
    with pytest.raises(ValueError, match="sinks"):
        op.attention(q, k, v, enable_gqa=True, sinks=torch.zeros(2, device=DEVICE))
    with pytest.raises(TypeError, match="sinks.dtype"):
        op.attention(q, k, v, enable_gqa=True, sinks=torch.zeros(4, device=DEVICE, dtype=torch.float64))
    with pytest.raises(TypeError, match="sinks"):
        op.attention(q, k, v, enable_gqa=True, sinks=[0.0] * 4)


def test_mixed_dtypes_and_non_tensors(op):
    q, k, v = _qkv(1, 2, 2, 8, 8, 16)
    with pytest.raises(TypeError, match="share a dtype"):
        op.attention(q, k.half(), v)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        op.attention(q.tolist(), k, v)


@pytest.mark.skipif(runtime.ON_GPU, reason="bfloat16 is refused only by the CPU interpreter")
def test_bfloat16_refused_on_cpu(op):
    q, k, v = (t.bfloat16() for t in _qkv(1, 2, 2, 8, 8, 16))
    with pytest.raises(TypeError, match="bfloat16"):
        op.attention(q, k, v)


def test_misread_layout_is_caught_by_the_sinks(op):
    """(B, N, H, D) tensors passed as "bhnd" look like (B, H=N, N=H, D): the shapes alone fit,
    but the learned sinks (one per query head) do not, and the error says so."""
    q, k, v = _qkv(1, 4, 4, 12, 12, 16, layout="bnhd")
    sinks = torch.zeros(4, device=DEVICE)
    assert op.attention(q, k, v, sinks=sinks, layout="bnhd").shape == q.shape
    with pytest.raises(ValueError, match=r"sinks: got shape \(4,\), expected \(12,\)"):
        op.attention(q, k, v, sinks=sinks, layout="bhnd")


def test_cached_validation_still_refuses(op):
    """A shape seen before skips the checks; a new bad one still meets them."""
    q, k, v = _qkv(1, 2, 2, 8, 8, 16)
    op.attention(q, k, v)
    op.attention(q, k, v)
    with pytest.raises(ValueError, match="window"):
        op.attention(q, k, v, window=4)


# ---------------------------------------------------------------------------------------------
# Fake implementations: output metadata without a kernel (on the CPU, the interpreter would
# fail on fake tensors, so reaching the end proves no kernel ran).
# ---------------------------------------------------------------------------------------------

def test_fake_forward_and_backward_metadata(op):
    with FakeTensorMode():
        q = torch.empty(2, 64, 8, 32, dtype=torch.float16)           # (B, N, H, D)
        k = torch.empty(2, 48, 2, 32, dtype=torch.float16)
        qt, kt = q.transpose(1, 2), k.transpose(1, 2)                   # (B, H, N, D) views
        o, lse = torch.ops.workbook.attention_forward(qt, kt, kt, None, True, 0, 0, 0.125)
        assert o.shape == (2, 8, 64, 32) and o.dtype == torch.float16 and o.stride() == qt.stride()
        assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32 and lse.is_contiguous()
        dq, dk, dv, dsinks = torch.ops.workbook.attention_backward(qt, kt, kt, o, lse, o, None, True, 0, 0, 0.125)
        assert dq.shape == qt.shape and dq.stride() == qt.stride() and dk.shape == kt.shape
        assert dv.dtype == torch.float16 and dsinks.shape == (8,) and dsinks.dtype == torch.float32
        out = op.attention(q, k, k, is_causal=True, enable_gqa=True, layout="bnhd",
                           sinks=torch.empty(8))
        assert out.shape == q.shape and out.stride() == q.stride()


def test_opcheck_cpu(op, kernels):
    """opcheck's tests that run the op eagerly (the interpreter runs the kernels)."""
    q, k, v = _qkv(1, 2, 1, 20, 20, 16, grad=True)
    sinks = torch.randn(2, device=DEVICE, requires_grad=True)
    for test in ("test_schema", "test_autograd_registration", "test_faketensor"):
        result = torch.library.opcheck(torch.ops.workbook.attention_forward, (q, k, v, sinks, True, 5, 1, 0.3),
                                       test_utils=test)
        assert result[test] == "SUCCESS", result


# ---------------------------------------------------------------------------------------------
# Numbers: the interpreter (CPU) or the GPU against the float64 reference, both layouts.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_forward_and_gradients_match_reference(op, kernels, layout):
    q, k, v = _qkv(2, 4, 2, 37, 45, 16, layout=layout, grad=True, seed=3)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    mask = dict(causal=True, window=9, sink_tokens=2)
    o = op.attention(q, k, v, is_causal=True, window=9, sink_tokens=2, sinks=sinks, enable_gqa=True, layout=layout)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v, sinks), do)
    bhnd = (lambda t: t.transpose(1, 2)) if layout == "bnhd" else (lambda t: t)
    q, k, v, do = (bhnd(t).detach() for t in (q, k, v, do))
    sinks = sinks.detach()
    ref = reference.attention_grads(q, k, v, do, sinks=sinks, **mask)
    base = reference.attention_grads(q, k, v, do, sinks=sinks, compute_dtype=tolerance.baseline_dtype(q.dtype), **mask)
    report = tolerance.compare(bhnd(o), ref[0], base[0], name="o")
    assert report.ok, report.message
    floors = reference.gradient_floors(q, k, v, do, ref, sinks=sinks, **mask)
    for name, g, r, b in zip(("dq", "dk", "dv", "dsinks"), grads, ref[1:], base[1:]):
        g = bhnd(g) if name != "dsinks" else g
        report = tolerance.compare(g, r, b, name=name, factor=tolerance.GRADIENT_FACTOR, floor=floors[name])
        assert report.ok, report.message


def test_op_path_matches_eager_path(op, kernels):
    """Under a dispatch mode (as under a tracer) attention() takes the registered op, not the
    eager autograd.Function: both give the same bits, forward and backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = set()

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv(1, 4, 2, 40, 40, 16, layout="bnhd", grad=True, seed=5)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    results = []
    for mode in (None, PassThrough()):
        with mode if mode is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            o = op.attention(q, k, v, is_causal=True, window=7, sinks=sinks, enable_gqa=True, layout="bnhd")
            grads = torch.autograd.grad(o.sum(), (q, k, v, sinks))
        results.append((o.detach(), *grads))
    assert {"workbook.attention_forward.default", "workbook.attention_backward.default"} <= seen, sorted(seen)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), *results):
        assert torch.equal(a, b), f"{name}: op path and eager path differ"


def test_launch_plan_is_cached(op):
    args = (1, 4, 2, 100, 100, 64, DTYPE, DEVICE, True, 0, 0, False)
    assert op.launch_plan(*args) is op.launch_plan(*args)
    assert set(op.launch_plan(*args)) == {"tma", "wgmma", "forward", "dkdv", "dq"}
    assert op.launch_plan(*args)["wgmma"] is None                      # no sm_90 GPU here, or a short call
    assert op.launch_plan(*args, tma=False)["tma"] is False


def test_a_call_with_much_work_in_all_has_its_triton_tiles_timed(op, monkeypatch):
    """From ``TUNE_WORK`` pairs over the call the plan times the Triton tiles even where each head is
    short; the wgmma kernels wait for long heads; the grader's workers time nothing."""
    plans = op.plans
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(plans, "_plans", {})              # plans made here stay here
    timed = []
    monkeypatch.setattr(plans, "_tuned", lambda key, tma: timed.append(key[0]) or {
        "tma": tma, "forward": (64, 64, 4, 1), "dkdv": (64, 64, 4, 1), "dq": (64, 64, 4, 1)})
    cpu = torch.device("cpu")
    much = (8, 8, 2, 1024, 1024, 64)                       # bench train's b8n1024 layers: TUNE_WORK pairs
    assert 8 * 8 * 1024 * 1024 >= plans.TUNE_WORK and 1024 * 1024 < tuning.TUNE_FROM
    assert plans.timed(8, 8, 1024, 1024) and not plans.long_heads(1024, 1024)
    assert not plans.timed(1, 4, 1024, 1024) and plans.long_heads(2048, 2048)
    plans.launch_plan(*much, torch.float16, cpu, True, 0, 0, False)
    plans.launch_plan(1, 4, 2, 1024, 1024, 64, torch.float16, cpu, True, 0, 0, False)
    assert timed == [much]
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "0")
    assert not plans.timed(8, 8, 1024, 1024) and not plans.long_heads(4096, 4096)
    plans.launch_plan(8, 8, 2, 1024, 1024, 64, torch.float16, cpu, False, 0, 0, False)
    assert timed == [much]


def test_the_wgmma_kernels_are_timed_only_for_long_heads(op, monkeypatch):
    """Much work in all, in short heads, times the Triton tiles only: the wgmma forward and the one
    pass are planned and timed from ``tuning.TUNE_FROM`` pairs a head."""
    plans = op.plans
    monkeypatch.setattr(runtime, "ON_GPU", True)
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    monkeypatch.setattr(plans, "KERNELS", "auto")
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(plans, "_backward_plans", {})
    monkeypatch.setattr(plans, "_tuned", lambda key, tma: {
        "tma": tma, "forward": (64, 64, 4, 1), "dkdv": (64, 64, 4, 1), "dq": (64, 64, 4, 1)})
    monkeypatch.setattr(plans, "_wgmma_shape", lambda *args: True)
    monkeypatch.setattr(plans, "_wgmma_backward_shape", lambda *args: True)
    monkeypatch.setattr(plans.wgmma_backward, "library", lambda d: None)
    forwards, backwards = [], []
    monkeypatch.setattr(plans, "_wgmma_plan", lambda key, plan, timed: forwards.append((key[0], timed)) or plan)
    monkeypatch.setattr(plans, "_timed_backward", lambda key: backwards.append(key[0]) or {"wgmma_backward": True})
    cpu = torch.device("cpu")
    short, long = (8, 8, 2, 1024, 1024, 64), (1, 4, 2, 2048, 2048, 64)
    for shape in (short, long):
        plans.launch_plan(*shape, torch.float16, cpu, True, 0, 0, False)
        plans.backward_plan(*shape, torch.float16, cpu, True, 0, 0, False)
    assert forwards == [(long, True)] and backwards == [long]
    assert plans.backward_plan(*short, torch.float16, cpu, True, 0, 0, False) == {"wgmma_backward": False}


def test_which_kernels_a_call_takes(op, monkeypatch):
    """The TMA kernels take a call when its shape, dtype and device allow them and the strides of
    q, k and v suit a descriptor; anything else goes to stage 9's kernels, with no copy.  A dO
    that no descriptor can read (a .sum()'s, of stride 0) is copied, and gives the gradients of
    the same dO laid out in rows, bit for bit (a compiled graph's dO is laid out so)."""
    monkeypatch.setattr(op.plans, "KERNELS", "tma")

    def kernels_of(q, k, v, do=None, **options):
        seen = []
        real = op.launch._direct

        def spy(kernel):
            seen.append(kernel.__name__)
            return real(kernel)
        monkeypatch.setattr(op.api, "_launcher", lambda key, record=None: spy)
        o = op.attention(q, k, v, **options)
        torch.autograd.grad(o, (q, k, v), torch.randn_like(o) if do is None else do)
        return seen

    q, k, v = _qkv(1, 4, 2, 24, 24, 16, layout="bnhd", grad=True)
    assert kernels_of(q, k, v, is_causal=True, enable_gqa=True, layout="bnhd") == [
        "_tma_forward_kernel", "_bwd_preprocess_kernel", "_tma_dkdv_kernel", "_tma_dq_kernel"]
    monkeypatch.setattr(op.plans, "KERNELS", "stage9")           # the same call, the choice kept per setting
    assert kernels_of(q, k, v, is_causal=True, enable_gqa=True, layout="bnhd") == [
        "_flash_forward_kernel", "_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]
    monkeypatch.setattr(op.plans, "KERNELS", "tma")
    ones = torch.ones(1, device=DEVICE, dtype=q.dtype).expand(q.shape)          # dO of stride 0: .sum()'s
    assert kernels_of(q, k, v, ones, is_causal=True, enable_gqa=True, layout="bnhd") == [
        "_tma_forward_kernel", "_bwd_preprocess_kernel", "_tma_dkdv_kernel", "_tma_dq_kernel"]
    monkeypatch.undo()
    monkeypatch.setattr(op.plans, "KERNELS", "tma")
    grads = [torch.autograd.grad(op.attention(q, k, v, is_causal=True, enable_gqa=True, layout="bnhd"), (q, k, v),
                                 do) for do in (ones, ones.contiguous())]
    for name, expanded, rows in zip("qkv", *grads):
        assert torch.equal(expanded, rows), f"d{name} of a dO of stride 0 differs from that of its copy"
    q, k, v = _qkv(1, 4, 2, 24, 24, 24, layout="bnhd", grad=True)          # D 24: no TMA tile
    assert kernels_of(q, k, v, is_causal=True, enable_gqa=True, layout="bnhd") == [
        "_flash_forward_kernel", "_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]
    q, k, v = (t.detach()[..., :16].requires_grad_(True) for t in _qkv(1, 4, 2, 24, 24, 18, grad=True))
    assert kernels_of(q, k, v, is_causal=True, enable_gqa=True) == [   # rows 72 bytes apart
        "_flash_forward_kernel", "_bwd_preprocess_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel"]


def test_an_lse_off_16_bytes_reaches_the_tma_backward_in_aligned_rows(op, monkeypatch):
    """The TMA dK/dV kernel reads lse through a descriptor, whose base must start on 16 bytes; the
    backward op called with an lse sliced off 16 bytes gets it copied into aligned rows (the TMA
    backward's _stat_rows), and gives the same gradients as with the aligned lse."""
    monkeypatch.setattr(op.plans, "KERNELS", "tma")
    q, k, v = _qkv(1, 4, 2, 24, 24, 16, seed=4)
    o, lse = op.launch._forward(q, k, v, None, True, 0, 0, 0.25)
    shifted = torch.empty(lse.numel() + 1, device=DEVICE)[1:].view(lse.shape)
    shifted.copy_(lse)
    assert shifted.data_ptr() % 16
    do = torch.randn_like(q)
    seen, lse_starts = [], []

    class Spy:                                  # records what the dK/dV kernel is handed as lse
        def __init__(self, kernel):
            self.kernel = kernel
            seen.append(kernel.__name__)

        def __getitem__(self, grid):
            def run(*args, **meta):
                if self.kernel.__name__ == "_tma_dkdv_kernel":
                    lse_starts.append(args[2].data_ptr() % 16)
                return self.kernel[grid](*args, **meta)
            return run
    aligned = op.launch._backward(q, k, v, o, lse, do, None, True, 0, 0, 0.25, launch=Spy)
    off = op.launch._backward(q, k, v, o, shifted, do, None, True, 0, 0, 0.25, launch=Spy)
    assert seen == ["_bwd_preprocess_kernel", "_tma_dkdv_kernel", "_tma_dq_kernel"] * 2
    assert lse_starts == [0, 0], "the dK/dV kernel's lse must start on 16 bytes"
    for name, a, b in zip(("dq", "dk", "dv"), aligned[:3], off[:3]):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------
# GPU: opcheck, torch.compile, CUDA graphs.
# ---------------------------------------------------------------------------------------------

class TinyModel(torch.nn.Module):
    """Two attention layers (window 16, then full causal), GQA 4/2, learned sinks, (B, N, H, D)."""

    def __init__(self, op, d=64):
        super().__init__()
        self.op = op
        self.proj = torch.nn.ModuleList(torch.nn.Linear(4 * d, 8 * d, bias=False) for _ in range(2))
        self.sinks = torch.nn.Parameter(torch.randn(2, 4))
        self.d = d

    def to_bf16(self):
        """bfloat16 weights; the sink logits stay float32, as the op wants them."""
        self.proj.to(torch.bfloat16)
        return self

    def forward(self, x):                                      # (B, N, 4 * d)
        B, N, _ = x.shape
        for i, proj in enumerate(self.proj):
            q, k, v = proj(x).split([4 * self.d, 2 * self.d, 2 * self.d], dim=-1)
            q, k, v = q.view(B, N, 4, self.d), k.view(B, N, 2, self.d), v.view(B, N, 2, self.d)
            o = self.op.attention(q, k, v, is_causal=True, window=16 if i == 0 else None, sinks=self.sinks[i],
                                  enable_gqa=True, layout="bnhd")
            x = x + o.reshape(B, N, 4 * self.d)
        return x


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.float().square().mean().backward()
    return [out.detach()] + [p.grad.clone() for p in model.parameters()]


@gpu
def test_opcheck_gpu(op, kernels):
    q, k, v = _qkv(2, 4, 2, 70, 90, 64, grad=True)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    for args in ((q, k, v, sinks, True, 16, 2, 0.2), (q, k, v, None, False, 0, 0, 0.125)):
        torch.library.opcheck(torch.ops.workbook.attention_forward, args)
    # The backward op has no backward of its own (no double backward): its inputs need no gradient.
    q, k, v, sinks = (t.detach() for t in (q, k, v, sinks))
    o, lse = torch.ops.workbook.attention_forward(q, k, v, sinks, True, 16, 2, 0.2)
    torch.library.opcheck(torch.ops.workbook.attention_backward,
                          (q, k, v, o, lse, torch.randn_like(o), sinks, True, 16, 2, 0.2))


@gpu
def test_same_bits_as_the_kernels_it_launches(op, kernels):
    """The op's forward and gradients are those of the kernels it launches, called directly:
    stage 9's ``attention``, or (on a GPU with TMA) the TMA forward and backward."""
    q, k, v = _qkv(2, 8, 2, 300, 300, 64, grad=True)
    sinks = torch.randn(8, device=DEVICE, requires_grad=True)
    do = torch.randn_like(q)
    o = op.attention(q, k, v, is_causal=True, window=64, sinks=sinks, enable_gqa=True)
    ours = (o, *torch.autograd.grad(o, (q, k, v, sinks), do))
    plan = op.launch_plan(2, 8, 2, 300, 300, 64, DTYPE, q.device, True, 64, 0, True)
    assert (plan["wgmma"] is not None) == (kernels == "wgmma")
    if plan["tma"]:
        opts = dict(causal=True, window=64, sinks=sinks.detach())
        q, k, v = (t.detach() for t in (q, k, v))
        forward = op.plans.wgmma if plan["wgmma"] else op.plans.tma_forward
        o_tma, lse = forward.flash_attention(q, k, v, **opts)
        theirs = (o_tma, *op.plans.tma_backward.flash_attention_backward(q, k, v, o_tma, lse, do, **opts))
    else:
        assert kernels == "stage9" or torch.cuda.get_device_capability()[0] < 9
        o9 = op.s9.attention(q, k, v, causal=True, window=64, sinks=sinks)
        theirs = (o9, *torch.autograd.grad(o9, (q, k, v, sinks), do))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), ours, theirs):
        assert torch.equal(a, b), f"{name} differs from the kernels' own by {(a.float() - b.float()).abs().max()}"


@gpu
def test_kept_kernels_give_tritons_results(op, kernels):
    """The eager path's second call of a shape launches the compiled kernels it kept; a
    (B, N, H, D) view, a misaligned view and another shape each get their own."""
    base = torch.randn(2, 301 * 8 * 64 + 4, device=DEVICE, dtype=DTYPE)
    cases = [_qkv(2, 8, 2, 300, 300, 64, grad=True), _qkv(1, 4, 4, 77, 150, 80, layout="bnhd", grad=True),
             [base[:, 4:].reshape(2, 301, 8, 64)[:, :300].requires_grad_(True)] * 3]      # 8-byte aligned
    layouts = ["bhnd", "bnhd", "bnhd"]
    sinks = torch.randn(8, device=DEVICE, requires_grad=True)
    runs = {}
    for direct in (False, True):
        op.launch.DIRECT_LAUNCH = direct
        try:
            for i, ((q, k, v), layout) in enumerate(zip(cases, layouts)):
                s = sinks[:q.shape[1 if layout == "bhnd" else 2]].detach().requires_grad_(True)
                for call in range(2):
                    o = op.attention(q, k, v, is_causal=True, window=64, sinks=s, enable_gqa=True, layout=layout)
                    runs[direct, i, call] = (o, *torch.autograd.grad(o, (q, k, v, s), torch.ones_like(o)))
        finally:
            op.launch.DIRECT_LAUNCH = True
    assert op.launch._compiled, "the eager path kept no compiled kernel"
    for i in range(len(cases)):
        for call in range(2):
            for name, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), runs[True, i, call], runs[False, i, 0]):
                assert torch.equal(a, b), f"case {i}, call {call}: {name} differs from Triton's own launch"


@gpu
@pytest.mark.parametrize("n", [200, 2048])       # 2048: a shape whose tiles the autotuner picks
def test_compile_fullgraph_matches_eager(op, kernels, n):
    torch.manual_seed(0)
    model = TinyModel(op).to(DEVICE).to_bf16()
    x = torch.randn(2, n, 256, device=DEVICE, dtype=torch.bfloat16)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = _grads(model, x)
    compiled = _grads(torch.compile(model, fullgraph=True, dynamic=False), x)
    for i, (a, b) in enumerate(zip(compiled, eager)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m: f"tensor {i}: {m}")


def _spy(op, monkeypatch, name: str) -> list:
    """A list that gets an entry each time launch.py's ``name`` (a wgmma kernel's call) runs."""
    ran, real = [], getattr(op.launch, name)
    monkeypatch.setattr(op.launch, name, lambda *a, **kw: (ran.append(1), real(*a, **kw))[1])
    return ran


@wgmma_gpu
@pytest.mark.parametrize("d, layout, options", [
    (72, "bnhd", dict(is_causal=True, window=40, sink_tokens=3, sinks=True)),
    (128, "bnhd", dict(is_causal=True)),
    (96, "bhnd", dict(sinks=True)),
    (256, "bnhd", dict(is_causal=True, sinks=True)),
], ids=["d72 window", "d128 causal", "d96 sinks", "d256 causal sinks"])
def test_the_wgmma_forward_behind_the_op_matches_the_reference(op, monkeypatch, d, layout, options):
    """The op with the wgmma forward (eager and compiled), (B, N, H, D) read through its strides,
    GQA 4:1, against the float64 reference; the backward (the TMA kernels' or stage 9's) takes its
    o and lse.  The compiled graph calls workbook::wgmma_forward, no copy of q, k or v around it."""
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(op.plans, "KERNELS", "wgmma")
    ran = _spy(op, monkeypatch, "_wgmma_forward")
    q, k, v = _qkv(2, 8, 2, 150, 190, d, layout=layout, grad=True, seed=d)
    sinks = torch.randn(8, device=DEVICE, requires_grad=True) if options.get("sinks") else None
    mask = {key: value for key, value in options.items() if key != "sinks"}

    def f(q, k, v, sinks):
        return op.attention(q, k, v, sinks=sinks, enable_gqa=True, layout=layout, **mask)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    (o_compiled,), code = run_and_get_code(lambda *a: (compiled(*a),), q, k, v, sinks)
    assert any("workbook.wgmma_forward" in c for c in code), "the compiled graph does not call the wgmma op"
    assert not any("aten.copy_" in c for c in code), "the compiled graph copies an input"
    o = f(q, k, v, sinks)
    assert ran, "the eager call did not run the wgmma forward"
    assert torch.equal(o, o_compiled), "compiled and eager forwards differ"
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, leaves, do)
    bhnd = (lambda t: t.transpose(1, 2)) if layout == "bnhd" else (lambda t: t)
    q, k, v, do = (bhnd(t).detach() for t in (q, k, v, do))
    ref_opts = dict(causal=mask.get("is_causal", False), window=mask.get("window"),
                    sink_tokens=mask.get("sink_tokens", 0), sinks=None if sinks is None else sinks.detach())
    ref = reference.attention_grads(q, k, v, do, **ref_opts)
    base = reference.attention_grads(q, k, v, do, compute_dtype=tolerance.baseline_dtype(q.dtype), **ref_opts)
    report = tolerance.compare(bhnd(o), ref[0], base[0], name="o")
    assert report.ok, report.message
    floors = reference.gradient_floors(q, k, v, do, ref, **ref_opts)
    for name, g, r, b in zip(("dq", "dk", "dv", "dsinks"), grads, ref[1:], base[1:]):
        g = bhnd(g) if name != "dsinks" else g
        report = tolerance.compare(g, r, b, name=name, factor=tolerance.GRADIENT_FACTOR, floor=floors[name])
        assert report.ok, report.message


@wgmma_gpu
def test_the_plan_times_the_two_forwards_and_keeps_the_faster(op, monkeypatch):
    """Where a plan is tuned on an sm_90 GPU, both forwards are timed and the faster kept."""
    monkeypatch.setattr(op.plans, "KERNELS", "auto")
    plan = op.launch_plan(1, 4, 4, 2048, 2048, 128, torch.bfloat16, torch.device(DEVICE), True, 0, 0, False)
    times = plan["forward_ms"]
    assert set(times) == {"wgmma", "tma"} and all(t > 0 for t in times.values()), plan
    assert (plan["wgmma"] is not None) == (times["wgmma"] < times["tma"]), plan
    assert op.launch_plan(1, 4, 4, 100, 100, 128, torch.bfloat16, torch.device(DEVICE), True, 0, 0, False)[
        "wgmma"] is None, "a short call was planned the wgmma forward untimed"


@wgmma_gpu
@pytest.mark.parametrize("d, layout, options", [
    (64, "bnhd", dict(is_causal=True, window=100, sink_tokens=3, sinks=True)),
    (128, "bnhd", dict(is_causal=True)),
    (64, "bhnd", dict(sinks=True)),
], ids=["d64 window", "d128 causal", "d64 sinks"])
def test_the_one_pass_backward_behind_the_op_matches_the_reference(op, monkeypatch, d, layout, options):
    """The op with the one-pass wgmma backward, eager and compiled, (B, N, H, D) read and written
    where it lies, GQA 4:1, against the float64 reference.  The compiled graph calls
    workbook::wgmma_backward, no copy of q, k or v around it."""
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(op.plans, "KERNELS", "wgmma")
    ran = _spy(op, monkeypatch, "_wgmma_backward")
    q, k, v = _qkv(2, 8, 2, 256, 384, d, layout=layout, grad=True, seed=d)
    sinks = torch.randn(8, device=DEVICE, requires_grad=True) if options.get("sinks") else None
    mask = {key: value for key, value in options.items() if key != "sinks"}
    leaves = [t for t in (q, k, v, sinks) if t is not None]

    def f(q, k, v, sinks, do):
        o = op.attention(q, k, v, sinks=sinks, enable_gqa=True, layout=layout, **mask)
        return o, *torch.autograd.grad(o, leaves, do)

    do = torch.randn_like(q)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=False, dynamic=False)
    compiled_out, code = run_and_get_code(lambda *a: compiled(*a), q, k, v, sinks, do)
    assert any("workbook.wgmma_backward" in c for c in code), "the compiled graph does not call the one pass"
    assert not any("aten.copy_" in c for c in code), "the compiled graph copies an input"
    ran.clear()
    eager = f(q, k, v, sinks, do)
    assert ran, "the eager call did not run the one-pass backward"
    bhnd = (lambda t: t.transpose(1, 2)) if layout == "bnhd" else (lambda t: t)
    for g, like in zip(eager[1:4], (q, k, v)):
        assert g.stride() == like.stride()
    qr, kr, vr, dor = (bhnd(t).detach() for t in (q, k, v, do))
    ref_opts = dict(causal=mask.get("is_causal", False), window=mask.get("window"),
                    sink_tokens=mask.get("sink_tokens", 0), sinks=None if sinks is None else sinks.detach())
    ref = reference.attention_grads(qr, kr, vr, dor, **ref_opts)
    base = reference.attention_grads(qr, kr, vr, dor, compute_dtype=tolerance.baseline_dtype(qr.dtype), **ref_opts)
    floors = reference.gradient_floors(qr, kr, vr, dor, ref, **ref_opts)
    for got in (eager, compiled_out):
        for name, g, r, b in zip(("dq", "dk", "dv", "dsinks"), got[1:], ref[1:], base[1:]):
            g = bhnd(g) if name != "dsinks" else g
            report = tolerance.compare(g, r, b, name=name, factor=tolerance.GRADIENT_FACTOR, floor=floors[name])
            assert report.ok, report.message


@wgmma_gpu
def test_deterministic_algorithms_keep_the_triton_backward(op, monkeypatch):
    """dQ's additions in the one pass have no fixed order; asked for deterministic algorithms, the
    op runs the TMA backward, whose gradients repeat bit for bit."""
    monkeypatch.setattr(op.plans, "KERNELS", "wgmma")
    ran = _spy(op, monkeypatch, "_wgmma_backward")
    q, k, v = _qkv(1, 4, 2, 256, 256, 64, grad=True, seed=5)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        runs = []
        for _ in range(2):
            o = op.attention(q, k, v, is_causal=True, enable_gqa=True)
            runs.append(torch.autograd.grad(o, (q, k, v), torch.ones_like(o)))
    finally:
        torch.use_deterministic_algorithms(before)
    assert not ran, "the one pass ran under deterministic algorithms"
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    o = op.attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    assert ran, "without deterministic algorithms the one pass did not run"


@wgmma_gpu
def test_an_lse_off_16_bytes_reaches_the_one_pass_as_a_copy(op, monkeypatch):
    """The kernel's bulk copies read lse in 256-byte rows from 16-byte boundaries; a saved lse that
    starts elsewhere (a view a caller made) is copied, and the gradients stay right."""
    monkeypatch.setattr(op.plans, "KERNELS", "wgmma")
    q, k, v = _qkv(1, 2, 2, 256, 256, 64, seed=6)
    o, lse = torch.ops.workbook.attention_forward(q, k, v, None, True, 0, 0, 0.125)
    shifted = torch.empty(lse.numel() + 1, device=DEVICE)[1:].view(lse.shape).copy_(lse)
    do = torch.randn_like(o)
    want = torch.ops.workbook.attention_backward(q, k, v, o, lse, do, None, True, 0, 0, 0.125)
    got = torch.ops.workbook.attention_backward(q, k, v, o, shifted, do, None, True, 0, 0, 0.125)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


@wgmma_gpu
def test_the_plan_times_the_two_backwards_and_keeps_the_faster(op, monkeypatch):
    """Where a plan is tuned on an sm_90 GPU and the shape suits the one pass, both backwards are
    timed and the one pass kept where a call with it, GPU or host time whichever is longer, is
    faster; shapes it does not take are not timed."""
    monkeypatch.setattr(op.plans, "KERNELS", "auto")
    plan = op.plans.backward_plan(1, 8, 2, 2048, 2048, 64, torch.bfloat16, torch.device(DEVICE), True, 0, 0, True)
    times = plan["backward_ms"]
    assert set(times) == {"wgmma", "tma"} and all(t > 0 for t in times.values()), plan
    assert plan["wgmma_backward"] == op.plans.keeps_one_pass(times), plan
    other = op.plans.backward_plan(1, 8, 2, 2000, 2000, 64, torch.bfloat16, torch.device(DEVICE), True, 0, 0, True)
    assert not other["wgmma_backward"] and "backward_ms" not in other, other


@wgmma_gpu
def test_opcheck_the_one_pass_backward(op, monkeypatch):
    monkeypatch.setattr(op.plans, "KERNELS", "wgmma")
    q, k, v = _qkv(1, 4, 2, 256, 256, 64, seed=7)
    sinks = torch.randn(4, device=DEVICE)
    o, lse = torch.ops.workbook.attention_forward(q, k, v, sinks, True, 100, 2, 0.125)
    do = torch.randn_like(o)
    for backward in (torch.ops.workbook.attention_backward, torch.ops.workbook.wgmma_backward):
        torch.library.opcheck(backward, (q, k, v, o, lse, do, sinks, True, 100, 2, 0.125))


def test_the_one_pass_is_kept_where_a_call_with_it_is_faster(op):
    """A call takes the longer of its GPU time and its host time: the one pass adds host time, so
    it is kept only where, both counted, it wins."""
    keeps = op.plans.keeps_one_pass
    host, tma_host = op.plans.ONE_PASS_HOST_MS, op.plans.TMA_HOST_MS
    assert keeps({"wgmma": 1.6, "tma": 1.9}) and not keeps({"wgmma": 1.0, "tma": 0.99})
    assert keeps({"wgmma": 0.3, "tma": host + 0.1})         # its host time, not its GPU time, decides
    assert not keeps({"wgmma": 0.2, "tma": host - 0.05})    # GPU-faster, but the host would wait longer
    assert not keeps({"wgmma": 0.05, "tma": tma_host})
    assert keeps({"wgmma": 1.0, "stage9": 2.0})


def test_the_one_pass_backward_is_planned_at_the_first_backward_only(op, monkeypatch):
    """A forward's plan builds and times nothing of the backward (an inference caller never
    compiles the one pass); the backward's plan builds it once, is kept, and a failed build
    leaves the Triton backward."""
    built = []
    monkeypatch.setattr(op.plans, "_wgmma_backward_shape", lambda *a: True)
    monkeypatch.setattr(op.plans.wgmma_backward, "library", built.append)
    monkeypatch.setattr(op.plans, "KERNELS", "wgmma")
    monkeypatch.setattr(op.plans, "_backward_plans", {})
    args = (1, 4, 2, 256, 256, 64, DTYPE, torch.device(DEVICE), True, 0, 0, False)
    op.launch_plan(*args)
    assert not built and not op.plans._backward_plans
    plan = op.plans.backward_plan(*args)
    assert plan == {"wgmma_backward": True} and built == [64]
    assert op.plans.backward_plan(*args) is plan and built == [64]

    def fails(d):
        raise RuntimeError("nvcc failed")
    monkeypatch.setattr(op.plans.wgmma_backward, "library", fails)
    failed = op.plans.backward_plan(1, 4, 2, 512, 512, 64, DTYPE, torch.device(DEVICE), True, 0, 0, False)
    assert failed["wgmma_backward"] is False and "nvcc failed" in failed["wgmma_backward_error"]


def test_inductor_takes_each_kernel_to_write_only_its_outputs():
    """torch.compile decides from each kernel's Triton IR which tensors it writes, and clones (and
    copies back) every tensor it takes for written.  The forward was once taken to write q, k and v
    (the query rows it stores through came out of the helper that loads Q and takes K and V), which
    cost three copies each way per call and kept CUDA graphs off when q, k, v were graph inputs.
    The analysis runs on the CPU, in a process of its own (tests/tools/kernel_writes.py)."""
    import json
    import subprocess
    import sys
    script = ROOT / "tests" / "tools" / "kernel_writes.py"
    done = subprocess.run([sys.executable, str(script), str(PATH.parent)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "forward": ["LSE", "O"], "preprocess": ["DELTA", "DSINKS_PART"], "dkdv": ["DK", "DV"], "dq": ["DQ"],
        "tma_forward": ["LSE", "O"], "tma_dkdv": ["DK", "DV"], "tma_dq": ["DQ"]}


def _traced_launches(*env: str) -> list:
    import json
    import os
    import subprocess
    import sys
    script = ROOT / "tests" / "tools" / "traced_launches.py"
    done = subprocess.run([sys.executable, str(script), str(PATH.parent)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **dict(e.split("=", 1) for e in env)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_traced_graph_makes_the_tma_kernels_descriptors_when_it_runs():
    """Under torch.compile the TMA kernels take descriptors made on the host, as eager calls do.
    Each must reach the graph as the tensor it describes (a graph value) plus its tile, never as
    a descriptor kept with the traced call's addresses; and Inductor must still find what each
    kernel writes, or it would drop the kernel.  Traced on the CPU as far as AOTAutograd's
    graphs (tests/tools/traced_launches.py), as torch finds things on an H100."""
    def tile(*shape):
        return ["stable", list(shape)]
    rows, keys = tile(1, 1, 32, 64), tile(1, 32)
    traced = _traced_launches()
    assert traced["as_strided"] == [], "a descriptor's tensor reached the graph through a view"
    assert traced["launches"] == [
        {"kernel": "_tma_forward_kernel", "descriptors": {"K": rows, "V": rows}, "in_graph": ["K", "V"],
         "written": ["LSE", "O"]},
        {"kernel": "_bwd_preprocess_kernel", "descriptors": {}, "in_graph": [], "written": ["DELTA", "DSINKS_PART"]},
        {"kernel": "_tma_dkdv_kernel", "descriptors": {"DELTA": keys, "DO": rows, "LSE": keys, "Q": rows},
         "in_graph": ["DELTA", "DO", "LSE", "Q"], "written": ["DK", "DV"]},
        {"kernel": "_tma_dq_kernel", "descriptors": {"K": rows, "V": rows}, "in_graph": ["K", "V"], "written": ["DQ"]}]


#: Each traced launch where the kernels make their own descriptors: (kernel, descriptors, written).
KERNEL_MADE = [("_tma_forward_kernel", {}, ["LSE", "O"]), ("_bwd_preprocess_kernel", {}, ["DELTA", "DSINKS_PART"]),
               ("_tma_dkdv_kernel", {}, ["DK", "DV"]), ("_tma_dq_kernel", {}, ["DQ"])]


def test_without_torchs_host_descriptor_support_the_kernels_make_their_own():
    """Where torch does not take the device for one with host descriptors, its write analysis
    would misread a descriptor's arguments (launch.py, ``_graph_descriptors``): there the traced
    kernels make their own descriptors, and every kernel is still found to write its outputs."""
    launches = _traced_launches("WORKBOOK_TRACE_AS_FOUND=1")["launches"]
    assert [(r["kernel"], r["descriptors"], r["written"]) for r in launches] == KERNEL_MADE


def test_workbook_graph_descriptors_0_has_the_kernels_make_their_own():
    """``WORKBOOK_GRAPH_DESCRIPTORS=0`` keeps descriptors out of traced graphs where torch could
    carry them (as torch finds things on an H100): the kernels make their own, and every kernel is
    still found to write its outputs."""
    launches = _traced_launches("WORKBOOK_GRAPH_DESCRIPTORS=0")["launches"]
    assert [(r["kernel"], r["descriptors"], r["written"]) for r in launches] == KERNEL_MADE


@gpu
def test_a_compiled_windowed_call_gives_the_eager_bits_on_every_buffer(op, monkeypatch):
    """The compiled graph makes the TMA kernels' descriptors from the buffers it is handed each
    time: called on other buffers than it was traced with, and through CUDA graphs, it gives the
    bits of the eager call (host-made descriptors too), forward and backward (dsinks to rounding)."""
    from torch._inductor.utils import run_and_get_code
    monkeypatch.setattr(op.plans, "KERNELS", "tma")
    sinks = torch.zeros(8, device=DEVICE, requires_grad=True)

    def f(q, k, v, sinks):
        return op.attention(q, k, v, is_causal=True, window=64, sinks=sinks, enable_gqa=True, layout="bnhd")

    def run(fn, seed):
        q, k, v = _qkv(2, 8, 2, 512, 512, 64, layout="bnhd", grad=True, seed=seed)
        o = fn(q, k, v, sinks)
        return (o.detach(), *torch.autograd.grad(o, (q, k, v, sinks), torch.ones_like(o) * 0.01))

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    _, code = run_and_get_code(run, compiled, 0)
    assert any("TensorDescriptor.from_tensor" in c for c in code), "the graph makes no descriptor when it runs"
    torch._dynamo.reset()
    graphed = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for seed in (1, 2, 3):
        want = run(f, seed)
        for name, fn in (("compiled", compiled), ("CUDA graphs", graphed)):
            got = run(fn, seed)
            for label, a, b in zip(("o", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), f"{name}, inputs {seed}: {label} differs from the eager call's"
            # dsinks is a sum of the kernel's partial sums, which Inductor may add in another order
            torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-6)


@gpu
def test_cuda_graphs_when_q_k_v_are_the_inputs(op, kernels):
    """q, k and v as the compiled function's own inputs (in TinyModel they are made inside): the op
    only reads them, so the compiled forward copies none of them and CUDA graphs are kept."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code
    q, k, v = _qkv(1, 8, 2, 256, 256, 64, layout="bnhd", grad=True)
    sinks = torch.zeros(8, device=DEVICE, requires_grad=True)

    def f(q, k, v, sinks):
        return op.attention(q, k, v, is_causal=True, window=64, sinks=sinks, enable_gqa=True, layout="bnhd")

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(f, fullgraph=True, dynamic=False), q, k, v, sinks)
    assert code and not any("aten.copy_" in c for c in code), "the compiled forward copies an input back"
    torch._dynamo.reset()
    counters.clear()
    graphed = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for _ in range(3):                                        # warm-up, record, replay
        torch.autograd.grad(graphed(q, k, v, sinks).sum(), (q, k, v, sinks))   # no .grad kept across replays
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@gpu
def test_cuda_graphs(op, kernels):
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = TinyModel(op).to(DEVICE).to_bf16()
    x = torch.randn(2, 256, 256, device=DEVICE, dtype=torch.bfloat16)
    eager = _grads(model, x)
    counters.clear()
    graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    for _ in range(3):                                        # warm-up, record, replay
        got = _grads(graphed, x)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    for i, (a, b) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2, msg=lambda m: f"tensor {i}: {m}")


def test_host_integer_helpers_agree_with_triton(op):
    import triton
    for a in range(1, 300, 7):
        for b in (16, 32, 64, 128):
            assert op.plans._cdiv(a, b) == triton.cdiv(a, b)
    for d in range(1, 257):
        assert op.plans._pow2(d) == triton.next_power_of_2(d)


def test_a_call_with_nothing_to_differentiate_makes_no_autograd_node(op, monkeypatch):
    """Under no_grad, or with no input that requires grad, attention() launches the forward directly:
    the same bits as the differentiable call, and the autograd.Function is never entered."""
    q, k, v = _qkv(1, 4, 2, 33, 40, 16, layout="bnhd", grad=True, seed=11)
    sinks = torch.randn(4, device=DEVICE, requires_grad=True)
    opts = dict(is_causal=True, window=9, sinks=sinks, enable_gqa=True, layout="bnhd")
    with_grad = op.attention(q, k, v, **opts)

    def entered(*args):
        raise AssertionError("a call with nothing to differentiate went through the autograd.Function")
    monkeypatch.setattr(op.api._EagerAttention, "apply", entered)
    with torch.no_grad():
        plain = op.attention(q, k, v, **opts)
    detached = op.attention(q.detach(), k.detach(), v.detach(), **{**opts, "sinks": sinks.detach()})
    assert with_grad.grad_fn is not None and plain.grad_fn is None and detached.grad_fn is None
    assert torch.equal(with_grad.detach(), plain) and torch.equal(plain, detached)
    assert plain.shape == q.shape and plain.stride() == q.stride()


def test_gradients_without_the_sinks_gradient_are_the_same(op):
    """Learned sinks that need no gradient skip d(sinks)'s reduction; dq, dk and dv are unchanged."""
    q, k, v = _qkv(1, 4, 2, 40, 40, 16, layout="bhnd", grad=True, seed=12)
    sinks = torch.randn(4, device=DEVICE)
    do = torch.randn_like(q)
    frozen = torch.autograd.grad(op.attention(q, k, v, is_causal=True, sinks=sinks, enable_gqa=True), (q, k, v), do)
    learned = sinks.clone().requires_grad_(True)
    full = torch.autograd.grad(op.attention(q, k, v, is_causal=True, sinks=learned, enable_gqa=True),
                               (q, k, v, learned), do)
    for name, a, b in zip(("dq", "dk", "dv"), frozen, full):
        assert torch.equal(a, b), name
    assert full[3].shape == (4,) and torch.isfinite(full[3]).all()


@pytest.mark.skipif(runtime.ON_GPU, reason="checks the message given where no GPU is visible")
def test_bench_host_without_a_gpu_says_so(capsys):
    """``python -m grader bench host`` (grader/bench/host.py) times the op's host overhead on a GPU only."""
    from grader.__main__ import main as cli
    assert cli(["bench", "host"]) == 2
    assert "times host overhead on a CUDA GPU" in capsys.readouterr().err


def test_the_bench_times_the_op_after_checking_it():
    """``python -m grader bench stage9`` times the op (provider ``op``) beside the kernels, forward
    and backward, once its outputs and gradients pass the reference."""
    from grader.bench import measure
    from grader.bench.cases import PROVIDERS, Case
    assert "op" in PROVIDERS["stage9"]
    small = dict(batch=1, heads=4, kv_heads=2, n_q=40, n_k=40, head_dim=16, causal=True, window=8, sink_tokens=2,
                 sinks=True, dtype=torch.float32)
    rows = measure.run("stage9", cases=[Case(**small), Case(**small, backward=True)], providers=["op"],
                       device=DEVICE, timer=lambda fn: 1.0, memory=lambda make: None, log=lambda *a, **k: None)
    assert [(r["note"], r["ms"]) for r in rows] == [("", 1.0), ("", 1.0)]
    learner = measure.run("stage9", source="stages", cases=[Case(**small)], providers=["op"], device=DEVICE,
                          timer=lambda fn: 1.0, memory=lambda make: None, log=lambda *a, **k: None)
    assert learner[0]["note"] == "n/a: the op is an instructor's package, solutions/attention_op"


@pytest.mark.parametrize("capability, tma", [((9, 0), True), ((8, 0), False), ((8, 9), False), ((12, 0), False),
                                             ((10, 0), False)])
def test_the_tma_kernels_are_planned_for_hopper_only(op, monkeypatch, capability, tma):
    """Their tile tables were compiled and timed for sm_90; every other GPU keeps stage 9's kernels, as do
    float32, head dims that are not powers of two, and plans.KERNELS = "stage9"."""
    monkeypatch.setattr(op.plans.runtime, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    cuda = torch.device("cuda")
    assert op.plans._tma_shape(64, torch.bfloat16, cuda) is tma
    assert not op.plans._tma_shape(64, torch.float32, cuda) and not op.plans._tma_shape(80, torch.bfloat16, cuda)
    monkeypatch.setattr(op.plans, "KERNELS", "stage9")
    assert not op.plans._tma_shape(64, torch.bfloat16, cuda)


@pytest.mark.parametrize("capability, dtype, d, kernels, allowed", [
    ((9, 0), torch.bfloat16, 64, "auto", True), ((9, 0), torch.float16, 72, "wgmma", True),
    ((9, 0), torch.bfloat16, 68, "auto", False),          # not a multiple of 8
    ((9, 0), torch.float32, 64, "auto", False), ((8, 0), torch.bfloat16, 64, "auto", False),
    ((10, 0), torch.bfloat16, 64, "auto", False), ((9, 0), torch.bfloat16, 64, "tma", False),
    ((9, 0), torch.bfloat16, 64, "stage9", False)])
def test_where_the_wgmma_forward_may_serve(op, monkeypatch, capability, dtype, d, kernels, allowed):
    """sm_90 only (wgmma exists on sm_90a), float16 or bfloat16, head dims that are multiples of 8,
    and not when the kernel set is pinned to the TMA kernels or stage 9's."""
    monkeypatch.setattr(op.plans.runtime, "ON_GPU", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(op.plans, "KERNELS", kernels)
    assert op.plans._wgmma_shape(4, 16, d, dtype, torch.device("cuda")) is allowed
    assert not op.plans._wgmma_shape(4, 65536 // 4, d, dtype, torch.device("cuda"))    # the grid's limit


def test_a_wgmma_build_that_fails_leaves_the_triton_forward(op, monkeypatch):
    """No nvcc, or a compile error: the plan keeps its Triton forward, says why, and times nothing."""
    def no_build(*args):
        raise RuntimeError("nvcc not found")
    monkeypatch.setattr(op.plans.wgmma, "library", no_build)
    monkeypatch.setattr(op.plans, "_gpu_ms", lambda fn, reps=10: pytest.fail("timed without a kernel"))
    key = ((4, 16, 16, 4096, 4096, 64), torch.bfloat16, torch.device("cuda"), True, 0, 0, False)
    plan = op.plans._wgmma_plan(key, {"tma": True, "forward": {}}, timed=True)
    assert plan["wgmma"] is None and plan["forward"] == {} and "nvcc not found" in plan["wgmma_error"]


@pytest.mark.parametrize("times, kept", [((0.5, 0.8), True), ((0.9, 0.8), False)])
def test_the_plan_keeps_the_faster_forward_timed_on_the_inputs_gpu(op, monkeypatch, times, kept):
    """_wgmma_plan times the wgmma forward, then the plan set's Triton forward, with q's GPU current
    (its spin and events must be on the GPU that runs the kernels), and keeps the faster."""
    import contextlib
    entered, timed = [], iter(times)
    monkeypatch.setattr(op.plans.wgmma, "library", lambda *args: None)
    monkeypatch.setattr(op.plans, "_random_inputs", lambda key: (None, None, None, {}))
    monkeypatch.setattr(op.plans, "_gpu_ms", lambda fn, reps=10: (entered[-1], next(timed))[1])
    monkeypatch.setattr(torch.cuda, "device", lambda device: (entered.append(device), contextlib.nullcontext())[1])
    second = torch.device("cuda", 1)
    key = ((4, 16, 16, 4096, 4096, 64), torch.bfloat16, second, True, 0, 0, False)
    plan = op.plans._wgmma_plan(key, {"tma": True, "forward": {}}, timed=True)
    assert entered == [second]
    assert plan["forward_ms"] == {"wgmma": times[0], "tma": times[1]}
    assert (plan["wgmma"] == op.plans.wgmma.plan(64, True, False)) if kept else plan["wgmma"] is None
