"""python -m grader bench: time the stages' kernels against PyTorch's attention on a GPU.

    python -m grader bench stage5                  the reference solution of stage 5
    python -m grader bench stage5 --learner        your stages/stage5_causal.py instead
    python -m grader bench all                     every stage with cases, in order (minutes: flex compiles)
    python -m grader bench stage7,stage8           several stages
    python -m grader bench stage9 --providers solution,flex
    python -m grader bench all --json out.json     rows {stage, case, provider, ms, tflops, peak_mib, ...}
    python -m grader bench all --plot out.png      a bar chart of TFLOP/s, one panel per stage
    python -m grader bench stage4 --rep 500        longer measurements (milliseconds of timed runs)

Providers, timed in the same run on the same inputs:

    solution        the stage's own flash_attention (stage 9's backward: flash_attention_backward)
    sdpa-flash      torch's scaled_dot_product_attention, FlashAttention-2 backend only
    sdpa-cudnn      ... cuDNN backend only
    flex            torch.compile(flex_attention) with a BlockMask for causal, windows and sink
                    tokens; learned sinks through flex's lse: o * sigmoid(lse - sink[h])
    stage3-triton   stage 3's Triton kernel, head dims padded to a power of two (stage 4 only)
    solution-tma    solutions/fast_forward_tma.py and fast_backward_tma.py: the forward of
                    stages 5-8 and stage 9's backward through TMA descriptors, the fast variants
                    beside the readable solutions (stages 5-9)
    solution-wgmma  solutions/fast_variable_block_wgmma.py: stage 4's forward with wgmma, TMA and
                    a producer warpgroup, the Hopper variant beside the mma.sync kernel (stage 4)

GQA goes to SDPA and flex through enable_gqa=True.  A provider that cannot express a case (SDPA
has no window, sink tokens or learned sinks, and aligns causal masks top-left) is reported
"n/a: <reason>" and not timed; one that raises is reported "failed: <error>" and the run goes on.

Cases are named by their shape and options, e.g. "B4 Hq32/Hkv8 N8192 D64 W128 sinks bwd": batch,
heads (query/key-value heads when they differ), sequence length (Nq.../Nk... when they differ),
head dim; causal; W128 a causal sliding window of 128 keys; S4 four sink tokens; sinks: learned
sinks (one float32 logit per query head); fwd or bwd: the pass timed.  All in bfloat16.

Backward: the solution is timed on flash_attention_backward(q, k, v, o, lse, do) given its
forward's o and lse.  SDPA and flex run their forward once on inputs that require gradients and
are timed on torch.autograd.grad(o, (q, k, v[, sinks]), do, retain_graph=True).

Throughput is FlashAttention's FLOP count over triton.testing.do_bench's median:

    forward     4 * B * Hq * D * pairs       (two matmuls, Q K^T and P V, of 2 FLOPs per MAC)
    backward    2.5 x the forward            (five matmuls instead of two)

with D the real head dim (padding earns nothing) and pairs the number of visible (query, key)
pairs of one (batch, head), counted exactly for causal masks, windows and sink tokens
(visible_pairs); learned sinks do not change it.

Correctness first: before a provider is timed its output is compared with the float64
reference (kernels.reference) under the workbook's tolerance rule (kernels.tolerance): o on
batch 0 and two query heads; for backward cases also dq, dk and dv on a whole GQA group (the
query heads that share kv head 0, at least two) against float64 autograd through the
reference, within 3x PyTorch's own bfloat16 error.  A provider that fails is reported
"wrong: <why>" and not timed.

Memory: after the check, each provider runs once more (a forward; for backward cases its forward
and then its backward) while torch.cuda tracks the peak of allocated memory; ``peak_mib`` is that
peak less what was allocated before (the case's inputs), in MiB; ``input_mib`` is the inputs' size.  The table prints it beside the
size of the inputs (q, k, v and, for backward cases, dO): FlashAttention's working memory grows
like its inputs, linearly in N, where materialising the N x N scores would grow quadratically.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

from kernels import runtime  # noqa: F401  (before triton: decides TRITON_INTERPRET)

import torch

WARMUP_MS = 25
REP_MS = 100
JSON_KEYS = ("stage", "case", "provider", "ms", "tflops", "peak_mib", "input_mib", "note")
MIB = 2 ** 20


# ---------------------------------------------------------------------------------------------
# Cases and their FLOP count
# ---------------------------------------------------------------------------------------------

def visible_pairs(n_q: int, n_k: int, *, causal: bool = False, window: int | None = None,
                  sink_tokens: int = 0) -> int:
    """Visible (query, key) pairs of one (batch, head), with the workbook's masks.

    Query ``i`` sits at key position ``i' = i + (Nk - Nq)`` (causal masks are aligned
    bottom-right).  Row by row, vectorised over the rows:

        causal          keys 0 .. i'                            i' + 1 of them (none if i' < 0)
        window W        keys max(0, i' - W + 1) .. i'
        sink tokens S   plus keys 0 .. S - 1 that are below the window and not in the future
    """
    if not causal:
        return n_q * n_k
    pos = torch.arange(n_q, dtype=torch.int64) + (n_k - n_q)       # i' for every query row
    end = (pos + 1).clamp(0, n_k)                                   # keys [0, end) are not in the future
    if window is None:
        return int(end.sum())
    start = (pos - window + 1).clamp(0, n_k)                        # the window is keys [start, end)
    in_window = (end - start).clamp(min=0)
    below_window = torch.minimum(end, start).clamp(max=sink_tokens)  # sink tokens in [0, start), visible
    return int((in_window + below_window).sum())


@dataclass(frozen=True)
class Case:
    """One benchmark problem: shapes, mask options, and which pass is timed."""
    batch: int
    heads: int                       # query heads
    n_q: int
    n_k: int
    head_dim: int
    kv_heads: int | None = None      # None: as many as the query heads
    causal: bool = False
    window: int | None = None        # needs causal
    sink_tokens: int = 0
    sinks: bool = False              # learned sinks: randn(heads) float32 logits
    backward: bool = False
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        if (self.window is not None or self.sink_tokens) and not self.causal:
            raise ValueError("a window or sink tokens need causal=True")
        if self.heads % self.hkv:
            raise ValueError(f"{self.heads} query heads are not a multiple of {self.hkv} kv heads")

    @property
    def hkv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def name(self) -> str:
        heads = f"H{self.heads}" if self.hkv == self.heads else f"Hq{self.heads}/Hkv{self.hkv}"
        length = f"N{self.n_q}" if self.n_q == self.n_k else f"Nq{self.n_q}/Nk{self.n_k}"
        parts = [f"B{self.batch}", heads, length, f"D{self.head_dim}"]
        if self.causal and self.window is None:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"W{self.window}")
        if self.sink_tokens:
            parts.append(f"S{self.sink_tokens}")
        if self.sinks:
            parts.append("sinks")
        if self.dtype != torch.bfloat16:
            parts.append(str(self.dtype).replace("torch.", ""))
        parts.append("bwd" if self.backward else "fwd")
        return " ".join(parts)

    @property
    def mask(self) -> dict:
        """The mask options, as ``kernels.reference.attention`` takes them."""
        return dict(causal=self.causal, window=self.window, sink_tokens=self.sink_tokens)

    @property
    def pairs(self) -> int:
        return visible_pairs(self.n_q, self.n_k, **self.mask)

    @property
    def input_bytes(self) -> int:
        """Bytes of q, k, v (and dO for a backward case): what any attention has to hold."""
        q = self.batch * self.heads * self.n_q * self.head_dim
        kv = 2 * self.batch * self.hkv * self.n_k * self.head_dim
        size = torch.tensor([], dtype=self.dtype).element_size()
        return (q * (2 if self.backward else 1) + kv) * size

    @property
    def flops(self) -> int:
        forward = 4 * self.batch * self.heads * self.head_dim * self.pairs
        return forward * 5 // 2 if self.backward else forward


def _both(**shape) -> list[Case]:
    return [Case(**shape), Case(**shape, backward=True)]


_GQA_LONG = dict(batch=4, heads=32, kv_heads=8, n_q=8192, n_k=8192, head_dim=64, causal=True)
CASES: dict[str, list[Case]] = {
    "stage3": [Case(4, 16, 4096, 4096, d) for d in (64, 128)],
    "stage4": [Case(4, 16, 4096, 4096, d) for d in (48, 72, 96, 160)],
    "stage5": [Case(4, 16, 4096, 4096, d, causal=c) for d in (64, 128) for c in (False, True)],
    "stage6": [Case(4, 32, 4096, 4096, d, kv_heads=8, causal=True) for d in (128, 64)],
    "stage7": [Case(**_GQA_LONG, window=w) for w in (128, 1024)],
    "stage8": [Case(**_GQA_LONG, window=w, sinks=True) for w in (128, 1024)] + [Case(**_GQA_LONG, sinks=True)],
    "stage9": ([c for d in (64, 128) for causal in (False, True)
                for c in _both(batch=4, heads=16, n_q=4096, n_k=4096, head_dim=d, causal=causal)]
               + _both(batch=4, heads=32, kv_heads=8, n_q=4096, n_k=4096, head_dim=128, causal=True)
               + [c for sinks in (False, True) for w in (128, 1024)
                  for c in _both(**_GQA_LONG, window=w, sinks=sinks)]),
}

PROVIDER_NAMES = ("solution", "sdpa-flash", "sdpa-cudnn", "flex", "stage3-triton", "solution-tma",
                  "solution-wgmma")
DEFAULT_PROVIDERS = ["solution", "sdpa-flash", "sdpa-cudnn", "flex"]
_WITH_TMA = ["solution", "solution-tma", "sdpa-flash", "sdpa-cudnn", "flex"]
PROVIDERS: dict[str, list[str]] = {
    "stage4": ["solution", "solution-wgmma", "stage3-triton", "sdpa-flash", "sdpa-cudnn"],
    "stage5": _WITH_TMA, "stage6": _WITH_TMA, "stage7": _WITH_TMA, "stage8": _WITH_TMA, "stage9": _WITH_TMA,
}


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------

class NotApplicable(Exception):
    """This provider cannot run this case (a mask it lacks, a head dim it does not take)."""


@dataclass
class Inputs:
    """One case's tensors; ``sinks`` only with learned sinks, ``do`` only for backward cases."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    sinks: torch.Tensor | None
    do: torch.Tensor | None


def make_inputs(case: Case, device, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    q = randn(case.batch, case.heads, case.n_q, case.head_dim)
    k = randn(case.batch, case.hkv, case.n_k, case.head_dim)
    v = randn(case.batch, case.hkv, case.n_k, case.head_dim)
    sinks = randn(case.heads, dtype=torch.float32) if case.sinks else None
    do = randn(case.batch, case.heads, case.n_q, case.head_dim) if case.backward else None
    return Inputs(q, k, v, sinks, do)


class Provider:
    """One way of computing attention.

    ``attend(case, x)`` returns ``f(q, k, v, sinks) -> o``, or raises :class:`NotApplicable`.
    ``backward(case, x)`` returns ``(g, o)``: ``g()`` computes the gradients ``(dq, dk, dv, ...)``
    of the forward output ``o`` for ``x.do``; by default through autograd, so ``f`` must be
    differentiable.
    """
    name = "?"

    def attend(self, case: Case, x: Inputs) -> Callable:
        raise NotImplementedError

    @staticmethod
    def _with_sinks(sinks) -> dict:
        """The learned-sinks keyword of a case that has them."""
        return {"sinks": sinks} if sinks is not None else {}

    def backward(self, case: Case, x: Inputs):
        f = self.attend(case, x)
        leaves = [t.detach().requires_grad_(True) for t in (x.q, x.k, x.v)]
        sinks = x.sinks.detach().requires_grad_(True) if x.sinks is not None else None
        o = f(*leaves, sinks)
        inputs = leaves + ([sinks] if sinks is not None else [])
        return (lambda: torch.autograd.grad(o, inputs, x.do, retain_graph=True)), o


class StageKernel(Provider):
    """A stage file's ``flash_attention`` (and ``flash_attention_backward``), loaded from ``source``."""

    def __init__(self, stage: str, source: str, name: str = "solution"):
        from kernels.loader import load_stage
        self.name, self.stage = name, stage
        self.module = load_stage(stage, source)

    def _options(self, case: Case, fn) -> dict:
        params = inspect.signature(fn).parameters
        wanted = {"causal": case.causal or None, "window": case.window, "sink_tokens": case.sink_tokens or None}
        for option, value in wanted.items():
            if value is not None and option not in params:
                raise NotApplicable(f"{self.stage}'s {fn.__name__} has no {option} option")
        if case.sinks and "sinks" not in params:
            raise NotApplicable(f"{self.stage}'s {fn.__name__} has no learned sinks")
        return {k: v for k, v in wanted.items() if v is not None}

    def attend(self, case, x):
        flash_attention = self.module.flash_attention
        opts = self._options(case, flash_attention)
        return lambda q, k, v, sinks: flash_attention(q, k, v, **opts, **self._with_sinks(sinks))[0]

    def backward(self, case, x):
        backward = getattr(self.module, "flash_attention_backward", None)
        if backward is None:
            raise NotApplicable(f"{self.stage} has no flash_attention_backward")
        opts, sinks = self._options(case, backward), self._with_sinks(x.sinks)
        o, lse = self.module.flash_attention(x.q, x.k, x.v, **opts, **sinks)
        return (lambda: backward(x.q, x.k, x.v, o, lse, x.do, **opts, **sinks)), o


class InstructorVariant(Provider):
    """A fast variant kept beside the solutions in ``solutions/FILE`` (instructors' files only)."""
    FILE = "?"
    WHAT = "?"

    def __init__(self, source: str):
        from kernels.loader import ROOT, load_file, source_dir
        path = ROOT / "solutions" / self.FILE
        if source_dir(source).resolve() != (ROOT / "solutions").resolve() or not path.exists():
            raise NotApplicable(f"{self.WHAT} is an instructor's file, solutions/{self.FILE}")
        self.module = load_file(path)


class TmaVariant(InstructorVariant):
    """``solutions/fast_forward_tma.py`` and ``fast_backward_tma.py``: the TMA variants of the forward and backward."""
    name = "solution-tma"
    FILE = "fast_forward_tma.py"
    WHAT = "the TMA variant"
    BACKWARD_FILE = "fast_backward_tma.py"

    @staticmethod
    def _options(case: Case) -> dict:
        if case.head_dim & (case.head_dim - 1):
            raise NotApplicable("the TMA variant takes head dims that are powers of two")
        return {"causal": case.causal, "window": case.window, "sink_tokens": case.sink_tokens}

    def attend(self, case, x):
        flash_attention, opts = self.module.flash_attention, self._options(case)
        return lambda q, k, v, sinks: flash_attention(q, k, v, **opts, **self._with_sinks(sinks))[0]

    def backward(self, case, x):
        from kernels.loader import ROOT, load_file
        path = ROOT / "solutions" / self.BACKWARD_FILE
        if not path.exists():
            raise NotApplicable(f"the TMA backward is an instructor's file, solutions/{self.BACKWARD_FILE}")
        opts, sinks = self._options(case), self._with_sinks(x.sinks)
        backward = load_file(path).flash_attention_backward
        o, lse = self.module.flash_attention(x.q, x.k, x.v, **opts, **sinks)
        return (lambda: backward(x.q, x.k, x.v, o, lse, x.do, **opts, **sinks)), o


class WgmmaVariant(InstructorVariant):
    """``solutions/fast_variable_block_wgmma.py``: stage 4's forward for sm_90 GPUs."""
    name = "solution-wgmma"
    FILE = "fast_variable_block_wgmma.py"
    WHAT = "the wgmma variant"

    def attend(self, case, x):
        if not x.q.is_cuda or torch.cuda.get_device_capability(x.q.device) != (9, 0):
            raise NotApplicable("the wgmma variant runs on sm_90 GPUs (H100, H200) only")
        if case.heads != case.hkv or case.window is not None or case.sink_tokens or case.sinks:
            raise NotApplicable("the wgmma variant is stage 4's forward: same heads, full or causal masks")
        flash_attention = self.module.flash_attention
        return lambda q, k, v, sinks: flash_attention(q, k, v, causal=case.causal)[0]

    def backward(self, case, x):
        raise NotApplicable("the wgmma variant has no backward")


class Sdpa(Provider):
    """``scaled_dot_product_attention`` restricted to one backend."""

    def __init__(self, name: str, backend: str):
        from torch.nn.attention import SDPBackend
        self.name, self.backend = name, getattr(SDPBackend, backend)

    def attend(self, case, x):
        from torch.nn.attention import sdpa_kernel
        if case.window is not None:
            raise NotApplicable("SDPA has no sliding window")
        if case.sink_tokens:
            raise NotApplicable("SDPA has no sink tokens")
        if case.sinks:
            raise NotApplicable("SDPA has no learned sinks")
        if case.causal and case.n_q != case.n_k:
            raise NotApplicable("SDPA aligns causal masks top-left; the workbook aligns them bottom-right")
        gqa = {"enable_gqa": True} if case.hkv != case.heads else {}
        backend = self.backend

        def f(q, k, v, sinks):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **gqa)
        return f


def _flex_plain(q, k, v, block_mask, gqa: bool):
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


def _flex_with_sinks(q, k, v, sinks, block_mask, gqa: bool):
    """Learned sinks from flex's lse: a virtual key with logit ``sink[h]`` and value zero scales the
    row by exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)."""
    from torch.nn.attention import flex_attention as fa
    if hasattr(fa, "AuxRequest"):
        o, aux = fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa,
                                   return_aux=fa.AuxRequest(lse=True))
        lse = aux.lse
    else:                                            # torch before AuxRequest
        o, lse = fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa, return_lse=True)
    keep = torch.sigmoid(lse - sinks.view(1, -1, 1))                     # (B, Hq, Nq) float32
    return (o.float() * keep.unsqueeze(-1)).to(o.dtype)


class FlexMasks:
    """One mask_mod per mask kind (causal, window, window with sink tokens), made once per device.

    Each reads the causal offset, the window and the sink-token count from 0-d int tensors that
    :meth:`mask_mod` fills for the case at hand.  A mask_mod that closed over Python ints would be
    traced with the first case's numbers, and the compiled kernel could reuse them for a later
    window; tensors are read when the kernel runs, so one compiled kernel serves every window.
    """

    def __init__(self, device):
        offset, window, sink_tokens = (torch.zeros((), dtype=torch.int32, device=device) for _ in range(3))
        self.params = (offset, window, sink_tokens)

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        def windowed(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + offset) & (kv_idx > q_idx + offset - window)

        def windowed_sink_tokens(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx + offset) & ((kv_idx > q_idx + offset - window) | (kv_idx < sink_tokens))

        self.kinds = {"causal": causal, "window": windowed, "window+sink tokens": windowed_sink_tokens}

    def mask_mod(self, case: Case):
        """The mask_mod of ``case``'s kind, its tensors set to ``case``'s numbers (needs causal)."""
        offset, window, sink_tokens = self.params
        offset.fill_(case.n_k - case.n_q)
        window.fill_(case.window or 0)
        sink_tokens.fill_(case.sink_tokens)
        return self.kinds["causal" if case.window is None else
                          "window+sink tokens" if case.sink_tokens else "window"]


class _FlexKernels:
    """The compiled flex functions and the mask_mods, made once per process and shared by every case.

    torch.compile recompiles for each new shape (``dynamic=False``: kernels for fixed shapes) and
    mask kind, not for each window; the recompile limit is raised to hold them all.
    """

    def __init__(self):
        import torch._dynamo
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # The backward is timed by calling autograd.grad repeatedly on one graph (retain_graph=True);
        # compiled graphs that donate their saved buffers to the backward refuse that.
        import torch._functorch.config
        torch._functorch.config.donated_buffer = False
        self.plain = torch.compile(_flex_plain, dynamic=False)
        self.with_sinks = torch.compile(_flex_with_sinks, dynamic=False)
        self.masks: dict[str, FlexMasks] = {}

    def mask_mod(self, case: Case, device):
        if str(device) not in self.masks:
            self.masks[str(device)] = FlexMasks(device)
        return self.masks[str(device)].mask_mod(case)


_FLEX: _FlexKernels | None = None


class Flex(Provider):
    name = "flex"

    def attend(self, case, x):
        global _FLEX
        from torch.nn.attention.flex_attention import create_block_mask
        _FLEX = _FLEX or _FlexKernels()
        block_mask = None                                     # None: every key visible
        if case.causal:
            block_mask = create_block_mask(_FLEX.mask_mod(case, x.q.device), None, None, case.n_q, case.n_k,
                                           device=x.q.device)
        gqa = case.hkv != case.heads
        if case.sinks:
            return lambda q, k, v, sinks: _FLEX.with_sinks(q, k, v, sinks, block_mask, gqa)
        return lambda q, k, v, sinks: _FLEX.plain(q, k, v, block_mask, gqa)


def provider(name: str, stage: str, source: str) -> Provider:
    """The provider called ``name`` for a stage's cases (``solution`` loads the stage from ``source``)."""
    if name == "solution":
        return StageKernel(stage, source)
    if name == "stage3-triton":
        return StageKernel("stage3", source, name="stage3-triton")
    if name == "solution-tma":
        return TmaVariant(source)
    if name == "solution-wgmma":
        return WgmmaVariant(source)
    if name == "sdpa-flash":
        return Sdpa(name, "FLASH_ATTENTION")
    if name == "sdpa-cudnn":
        return Sdpa(name, "CUDNN_ATTENTION")
    if name == "flex":
        return Flex()
    raise ValueError(f"unknown provider {name!r}; the providers are: {', '.join(PROVIDER_NAMES)}")


# ---------------------------------------------------------------------------------------------
# Correctness against float64
# ---------------------------------------------------------------------------------------------

Q_DIMS = ("b", "h", "i", "d")
KV_DIMS = ("b", "h_kv", "j", "d")


def checked_heads(case: Case) -> tuple[int, int]:
    """(query heads, kv heads) re-checked on batch 0: heads 0.. of each.

    Forward: two query heads (and the kv heads they read).  Backward: the whole group of query
    heads that share kv head 0 (at least two heads), since dk and dv sum over the group.
    """
    group = case.heads // case.hkv
    if case.backward:
        n_kv = min(case.hkv, -(-2 // group))
        return n_kv * group, n_kv
    n_q = min(2, case.heads)
    return n_q, -(-n_q // group)


def _reference(case: Case, x: Inputs) -> dict:
    """{name: (float64 reference, PyTorch-in-bf16 baseline, dims, factor, floor)} on the checked heads.

    The slice (batch 0, the checked heads) is a whole attention problem of its own, so the float64
    reference costs a few (heads x Nq x Nk) matrices: at most 2 GB each for 4 heads at N8192.
    """
    from kernels import reference, tolerance
    n_q, n_kv = checked_heads(case)
    q, k, v = x.q[:1, :n_q], x.k[:1, :n_kv], x.v[:1, :n_kv]
    sinks = x.sinks[:n_q] if x.sinks is not None else None
    base_dtype = tolerance.baseline_dtype(case.dtype)
    if not case.backward:
        ref, _ = reference.attention(q, k, v, sinks=sinks, **case.mask)
        base, _ = reference.attention(q, k, v, sinks=sinks, compute_dtype=base_dtype, **case.mask)
        return {"o": (ref, base, Q_DIMS, tolerance.OUTPUT_FACTOR, None)}

    do = x.do[:1, :n_q]
    ref = reference.attention_grads(q, k, v, do, sinks=sinks, **case.mask)
    base = reference.attention_grads(q, k, v, do, sinks=sinks, compute_dtype=base_dtype, **case.mask)
    floor, factor = tolerance.gradient_floor(*ref[1:4]), tolerance.GRADIENT_FACTOR
    return {"o": (ref[0], base[0], Q_DIMS, tolerance.OUTPUT_FACTOR, None),
            "dq": (ref[1], base[1], Q_DIMS, factor, floor),
            "dk": (ref[2], base[2], KV_DIMS, factor, floor),
            "dv": (ref[3], base[3], KV_DIMS, factor, floor)}


def _verify(outputs: dict, refs: dict, case: Case) -> str | None:
    """None if every output passes the tolerance rule on the checked heads, else why not."""
    from kernels import tolerance
    n_q, n_kv = checked_heads(case)
    for name, (ref, base, dims, factor, floor) in refs.items():
        out = outputs[name]
        full = (case.batch, case.heads if dims is Q_DIMS else case.hkv, case.n_q if dims is Q_DIMS else case.n_k,
                case.head_dim)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != full:
            return f"{name}: returned {type(out).__name__} of shape {tuple(getattr(out, 'shape', ()))}; expected {full}"
        heads = n_q if dims is Q_DIMS else n_kv
        report = tolerance.compare(out[:1, :heads], ref, base, name=name, factor=factor, floor=floor, dims=dims)
        if not report.ok:
            return report.message
    return None


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def _failure(exc: BaseException, caught: list) -> str:
    text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
    if isinstance(exc, RuntimeError) and ("No available kernel" in str(exc) or "No viable backend" in str(exc)):
        # sdpa_kernel with one backend that refuses the case; its warnings say why.
        why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught
                                      if "not used because" not in str(w.message)))
        return f"n/a: this backend refuses the case ({why[:300] or text})"
    return f"failed: {type(exc).__name__}: {text}"


def _free(device, *, collect: bool = False) -> None:
    """Give the memory of dropped tensors back to the GPU (and, with ``collect``, of reference cycles)."""
    if collect:
        gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def peak_memory(make: Callable, device) -> float | None:
    """MiB allocated at the peak of ``make()`` beyond what was allocated before it (None off CUDA)."""
    if torch.device(device).type != "cuda":
        return None
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    made = make()                                    # held until the peak is read
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del made
    return peak / MIB


def _measure(prov, case: Case, x: Inputs, refs: dict, timer: Callable, memory: Callable
             ) -> tuple[float | None, str, float | None]:
    """(milliseconds, "", peak MiB) if the provider's output passes the check, else (None, why not, None).

    The peak is taken on a run of its own after the check: the first call may compile, or time
    tiles, with buffers of its own.
    """
    caught = []
    try:
        if isinstance(prov, Exception):              # the provider could not be made (a stage file that
            raise prov                               # does not import): reported on each of its rows
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if case.backward:
                fn, o = prov.backward(case, x)
                dq, dk, dv = fn()[:3]
                outputs = {"o": o, "dq": dq, "dk": dk, "dv": dv}
            else:
                f = prov.attend(case, x)

                def fn():
                    return f(x.q, x.k, x.v, x.sinks)
                outputs = {"o": fn()}
        problem = _verify(outputs, refs, case)
        if problem:
            return None, f"wrong: {problem}", None
        del outputs
        if case.backward:
            fresh = {}

            def forward_and_backward():
                fresh["g"], o = prov.backward(case, x)
                return o, fresh["g"]()
            peak = memory(forward_and_backward)
            # Time the graph just made: making it may have refilled tensors the first one saved
            # (flex's mask parameters), which autograd would refuse to reuse.
            fn = fresh.get("g", fn)
        else:
            peak = memory(fn)
        return timer(fn), "", peak
    except NotApplicable as exc:
        return None, f"n/a: {exc}", None
    except Exception as exc:  # noqa: BLE001 - one provider failing must not stop the run
        return None, _failure(exc, caught), None


def bench_case(stage: str, case: Case, providers: dict, *, timer: Callable, device="cuda", seed: int = 0,
               log=print, memory: Callable | None = None) -> list[dict]:
    """Check, then time, every provider on one case; one row per provider, never raising.

    ``memory(make)`` runs ``make()`` and returns its peak MiB (default :func:`peak_memory`)."""
    memory = memory or (lambda make: peak_memory(make, device))
    rows = [{"stage": stage, "case": case.name, "provider": name, "ms": None, "tflops": None, "peak_mib": None,
             "input_mib": case.input_bytes / MIB, "note": ""} for name in providers]
    try:
        x = make_inputs(case, device, seed)
        refs = _reference(case, x)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory: report the case, go on
        x = refs = None
        for row in rows:
            row["note"] = f"failed: reference: {type(exc).__name__}: {str(exc).strip()[:200]}"
            log(_format_row(row), flush=True)
        _free(device, collect=True)
        return rows
    for row, prov in zip(rows, providers.values()):
        row["ms"], row["note"], row["peak_mib"] = _measure(prov, case, x, refs, timer, memory)
        if row["ms"] is not None:
            row["tflops"] = case.flops / row["ms"] * 1e-9
        _free(device)
        log(_format_row(row), flush=True)
    del x, refs
    _free(device, collect=True)
    return rows


def run(stage: str, *, source: str = "solutions", providers: list | None = None, cases: list[Case] | None = None,
        warmup: int = WARMUP_MS, rep: int = REP_MS, log=print, device="cuda", timer: Callable | None = None,
        memory: Callable | None = None) -> list[dict]:
    """Time every provider on every case of ``stage``; rows {stage, case, provider, ms, tflops, peak_mib,
    input_mib, note}.

    ``providers``: names (default: the stage's list) or :class:`Provider` objects.  ``timer(fn)``
    returns milliseconds (default: ``do_bench``'s median of ``rep`` ms after ``warmup`` ms);
    ``memory(make)`` the peak MiB of ``make()`` (default: :func:`peak_memory` on ``device``).
    """
    cases = cases if cases is not None else CASES.get(stage)
    if not cases:
        raise ValueError(f"no benchmark cases for {stage}; the stages with cases are: {', '.join(CASES)}")
    if timer is None:
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    made = {}
    for p in providers or PROVIDERS.get(stage, DEFAULT_PROVIDERS):
        if isinstance(p, Provider):
            made[p.name] = p
            continue
        try:
            made[p] = provider(p, stage, source)
        except Exception as exc:  # noqa: BLE001 - a provider that cannot load is reported on every row
            made[p] = exc
    rows = []
    for seed, case in enumerate(cases):
        rows += bench_case(stage, case, made, timer=timer, device=device, seed=seed, log=log, memory=memory)
    return rows


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------

def _format_row(row: dict) -> str:
    head = f"  {row['case']:<42} {row['provider']:<14}"
    if row["ms"] is None:
        return f"{head} {row['note']}"
    peak = f" {row['peak_mib']:8.0f} MiB peak" if row.get("peak_mib") is not None else ""
    return f"{head} {row['ms']:8.3f} ms {row['tflops']:7.1f} TFLOP/s{peak}"


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["tflops"] is not None:
        return f"{row['tflops']:.1f}"
    return row["note"].split(":")[0] or "-"           # n/a, wrong, failed


def table(rows: list[dict]) -> str:
    """TFLOP/s of each provider per case and the solution's speed relative to each other provider
    (solution TFLOP/s / theirs: above 1 the solution is faster); one block per stage, then notes."""
    lines = ["useful TFLOP/s (FlashAttention's FLOP count of the visible pairs; median of do_bench);",
             "'vs X': the solution's TFLOP/s over X's (above 1.00x the solution is faster)"]
    for stage in dict.fromkeys(r["stage"] for r in rows):
        mine = [r for r in rows if r["stage"] == stage]
        names = list(dict.fromkeys(r["provider"] for r in mine))
        cases = list(dict.fromkeys(r["case"] for r in mine))
        get = {(r["case"], r["provider"]): r for r in mine}
        others = [n for n in names if n != "solution"] if "solution" in names else []
        width = max(len(c) for c in cases) + 2
        cols = [max(len(n), 6) + 2 for n in names]
        ratio_cols = [len(f"vs {n}") + 2 for n in others]
        lines += ["", f"{stage}:", f"{'case':<{width}}" + "".join(f"{n:>{w}}" for n, w in zip(names, cols))
                  + "".join(f"{'vs ' + n:>{w}}" for n, w in zip(others, ratio_cols))]
        for c in cases:
            line = f"{c:<{width}}" + "".join(f"{_cell(get.get((c, n))):>{w}}" for n, w in zip(names, cols))
            sol = get.get((c, "solution"))
            for n, w in zip(others, ratio_cols):
                r = get.get((c, n))
                ok = sol and sol["tflops"] and r and r["tflops"]
                line += f"{sol['tflops'] / r['tflops']:>{w - 1}.2f}x" if ok else f"{'-':>{w}}"
            lines.append(line)
        if any(r.get("peak_mib") is not None for r in mine):
            lines += ["", f"{stage} peak memory, MiB beyond the inputs (bwd: the forward, then the backward):",
                      f"{'case':<{width}}{'inputs':>10}" + "".join(f"{n:>{w}}" for n, w in zip(names, cols))]
            for c in cases:
                size = next((r["input_mib"] for r in mine if r["case"] == c and r.get("input_mib")), None)
                line = f"{c:<{width}}" + (f"{size:>10.0f}" if size else f"{'-':>10}")
                for n, w in zip(names, cols):
                    peak = (get.get((c, n)) or {}).get("peak_mib")
                    line += f"{peak:>{w}.0f}" if peak is not None else f"{'-':>{w}}"
                lines.append(line)
    notes: dict[tuple, list[str]] = {}               # the same note for several cases is said once
    for r in rows:
        if r["note"]:
            notes.setdefault((r["stage"], r["provider"], r["note"]), []).append(r["case"])
    if notes:
        lines += ["", "notes:"]
        for (stage, name, note), cases in notes.items():
            where = cases[0] if len(cases) == 1 else f"{len(cases)} cases"
            lines.append(f"  {stage} {where} / {name}: {note}")
    return "\n".join(lines)


def machine() -> dict:
    """What the rows were measured on: the GPU and the versions (docs/performance.md says them)."""
    import platform
    import torch
    import triton
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no CUDA GPU)"
    return {"device": device, "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__}


def write_json(rows: list[dict], path) -> None:
    """{device, python, torch, triton, rows}: rows of {stage, case, provider, ms, tflops, peak_mib,
    input_mib, note}, and the machine they were measured on."""
    with open(path, "w") as f:
        json.dump(dict(machine(), rows=[{k: r.get(k) for k in JSON_KEYS} for r in rows]), f, indent=1)
        f.write("\n")


_COLORS = {"solution": "#d62728", "sdpa-flash": "#1f77b4", "sdpa-cudnn": "#17becf", "flex": "#2ca02c",
           "stage3-triton": "#ff7f0e", "solution-tma": "#9467bd",
           "solution-wgmma": "#8c564b"}


def plot(rows: list[dict], path, *, title: str | None = None) -> None:
    """A PNG of TFLOP/s per case (grouped horizontal bars, one per provider), one panel per stage."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    stages = list(dict.fromkeys(r["stage"] for r in rows))
    if not stages:
        raise ValueError("no rows to plot")
    layout = []
    for stage in stages:
        mine = [r for r in rows if r["stage"] == stage]
        layout.append((stage, list(dict.fromkeys(r["case"] for r in mine)),
                       list(dict.fromkeys(r["provider"] for r in mine)), {(r["case"], r["provider"]): r for r in mine}))
    heights = [0.16 * len(cases) * len(names) + 0.25 * len(cases) + 0.9 for _, cases, names, _ in layout]
    height = sum(heights) + (0.5 if title else 0)
    fig = Figure(figsize=(12, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(layout), 1, gridspec_kw={"height_ratios": heights}, squeeze=False)[:, 0]
    for ax, (stage, cases, names, get) in zip(axes, layout):
        bar = 0.8 / len(names)
        top = max([r["tflops"] for r in get.values() if r["tflops"]] or [1.0])
        for j, name in enumerate(names):
            for i, case in enumerate(cases):
                row = get.get((case, name))
                y = i - 0.4 + (j + 0.5) * bar
                value = row["tflops"] if row and row["tflops"] else 0.0
                ax.barh(y, value, height=bar * 0.9, color=_COLORS.get(name, f"C{j}"),
                        label=name if i == 0 else None)
                text = f" {value:.0f}" if value else f" {_cell(row)}"
                ax.text(value, y, text, va="center", fontsize=6.5, color="black" if value else "gray")
        ax.set_yticks(range(len(cases)), cases, fontsize=8)
        ax.set_ylim(len(cases) - 0.5, -0.5)
        ax.set_xlim(0, top * 1.12)
        ax.set_title(stage, fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    axes[-1].set_xlabel("useful TFLOP/s (higher is better)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - (0.5 / height if title else 0)))
    fig.savefig(path)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of milliseconds, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m grader bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", help=f"what to benchmark: {', '.join(CASES)}, several (stage5,stage7), or all")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--learner", action="store_true",
                     help="time your stages/ files instead of the reference solutions/")
    who.add_argument("--solutions", action="store_true", help=argparse.SUPPRESS)   # the default; kept for old commands
    p.add_argument("--providers", metavar="A,B",
                   help=f"comma-separated providers (default: the stage's list); of {', '.join(PROVIDER_NAMES)}")
    p.add_argument("--json", metavar="PATH", help="write the rows {stage, case, provider, ms, tflops, peak_mib, input_mib, note} here")
    p.add_argument("--plot", metavar="PATH", help="save a bar chart (PNG) of TFLOP/s per case and provider here")
    p.add_argument("--rep", metavar="MS", type=_positive_int, default=REP_MS,
                   help=f"milliseconds of timed runs per measurement (default {REP_MS})")
    return p


def _stages(text: str) -> list[str]:
    """'all', 'stage5', '5' or 'stage5,stage7' as stage names; ValueError naming those that exist."""
    if text.strip().lower() == "all":
        return list(CASES)
    names = []
    for part in text.split(","):
        name = part.strip().lower()
        name = name if name.startswith("stage") else f"stage{name}"
        if name not in CASES:
            raise ValueError(f"argument stage: no benchmark cases for {part.strip()!r}; the stages with cases "
                             f"are: {', '.join(CASES)} (or all)")
        names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:                      # a training step, not a stage (grader/bench/train.py)
        from grader.bench import train as bench_train
        return bench_train.main(argv[1:])
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:                      # argparse has printed the usage and the error (or --help)
        return int(exc.code or 0)
    try:
        stages = _stages(args.stage)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    providers = [p.strip() for p in args.providers.split(",") if p.strip()] if args.providers else None
    unknown = [p for p in providers or [] if p not in PROVIDER_NAMES]
    if providers is not None and (unknown or not providers):
        print(f"argument --providers: unknown provider {', '.join(map(repr, unknown)) or '(none given)'}; "
              f"the providers are: {', '.join(PROVIDER_NAMES)}", file=sys.stderr)
        return 2
    if not runtime.ON_GPU:
        print(f"python -m grader bench times kernels on a CUDA GPU, and none is visible here "
              f"({runtime.describe()}); run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    from kernels.loader import ROOT
    source = "stages" if args.learner else "solutions"
    if source == "solutions" and not (ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/: timing your stages/ files (--learner)")
        source = "stages"
    print(f"benchmarking {', '.join(stages)} ({source}/) on {runtime.describe()}; bfloat16, do_bench median of "
          f"{args.rep} ms after {WARMUP_MS} ms of warm-up", flush=True)
    rows, start = [], time.perf_counter()
    for stage in stages:
        began = time.perf_counter()
        print(f"{stage}:", flush=True)
        rows += run(stage, source=source, providers=providers, rep=args.rep)
        print(f"  ({time.perf_counter() - began:.0f} s)", flush=True)
    print()
    print(table(rows))
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s")
    if args.json:
        write_json(rows, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, title=f"{runtime.describe()}, bfloat16 ({source}/)")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
