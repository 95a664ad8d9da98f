"""The providers: the ways of computing attention a case is timed with (a stage's solution, SDPA's
backends, FlexAttention, the instructors' fast variants)."""

from __future__ import annotations

import functools
import inspect
from typing import Callable

from kernels import masks

import torch

from grader.bench.cases import PROVIDER_NAMES, Case, Inputs


class NotApplicable(Exception):
    """This provider cannot run this case (a mask it lacks, a head dim it does not take)."""


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
    """``solutions/fast_variable_block_wgmma.py``: stage 4's forward for sm_90 GPUs, and for stage 9
    ``fast_backward_wgmma.py``'s one-pass backward from that forward's o and lse."""
    name = "solution-wgmma"
    FILE = "fast_variable_block_wgmma.py"
    WHAT = "the wgmma variant"
    BACKWARD_FILE = "fast_backward_wgmma.py"

    def attend(self, case, x):
        if not x.q.is_cuda or torch.cuda.get_device_capability(x.q.device) != (9, 0):
            raise NotApplicable("the wgmma variant runs on sm_90 GPUs (H100, H200) only")
        flash_attention = self.module.flash_attention
        opts = {"causal": case.causal, "window": case.window, "sink_tokens": case.sink_tokens}
        return lambda q, k, v, sinks: flash_attention(q, k, v, **opts, **self._with_sinks(sinks))[0]

    def backward(self, case, x):
        from kernels.loader import ROOT, load_file
        if not x.q.is_cuda or torch.cuda.get_device_capability(x.q.device) != (9, 0):
            raise NotApplicable("the wgmma variant runs on sm_90 GPUs (H100, H200) only")
        if case.dtype not in (torch.float16, torch.bfloat16):
            raise NotApplicable("the one-pass backward takes float16 and bfloat16")
        path = ROOT / "solutions" / self.BACKWARD_FILE
        if not path.exists():
            raise NotApplicable(f"the one-pass backward is an instructor's file, solutions/{self.BACKWARD_FILE}")
        module = load_file(path)
        if not module.supports(case.batch, case.hkv, case.n_q, case.n_k, case.head_dim):
            raise NotApplicable(f"the one-pass backward takes head dims {module.HEAD_DIMS} and N a multiple of "
                                f"{module.BLOCK_N}")
        opts = {"causal": case.causal, "window": case.window, "sink_tokens": case.sink_tokens}
        sinks = self._with_sinks(x.sinks)
        o, lse = self.module.flash_attention(x.q, x.k, x.v, **opts, **sinks)
        return (lambda: module.flash_attention_backward(x.q, x.k, x.v, o, lse, x.do, **opts, **sinks)), o


class Op(Provider):
    """``solutions/attention_op``'s ``attention``: the op a model calls, with the kernels it picks
    (on Hopper the TMA kernels, and stage 4's wgmma forward where its plan timed it faster; else stage
    9's), its launch plans and its autograd."""
    name = "op"

    def __init__(self, source: str):
        from kernels.loader import ROOT, load_package, source_dir
        path = ROOT / "solutions" / "attention_op"
        if source_dir(source).resolve() != (ROOT / "solutions").resolve() or not path.exists():
            raise NotApplicable("the op is an instructor's package, solutions/attention_op")
        self.module = load_package(path)

    def attend(self, case, x):
        attention = self.module.attention
        opts = dict(is_causal=case.causal, window=case.window, sink_tokens=case.sink_tokens,
                    enable_gqa=case.hkv != case.heads)
        return lambda q, k, v, sinks: attention(q, k, v, sinks=sinks, **opts)


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
    """One mask_mod per mask kind (causal, window, window with sink tokens), made once per device
    from kernels/masks.py's rules.

    Each reads the causal offset, the window and the sink-token count from 0-d int tensors that
    :meth:`mask_mod` fills for the case at hand.  A mask_mod that closed over Python ints would be
    traced with the first case's numbers, and the compiled kernel could reuse them for a later
    window; tensors are read when the kernel runs, so one compiled kernel serves every window.
    """

    def __init__(self, device):
        offset, window, sink_tokens = (torch.zeros((), dtype=torch.int32, device=device) for _ in range(3))
        self.params = (offset, window, sink_tokens)
        mask = functools.partial(masks.attention_mask, causal=True, offset=offset)
        self.kinds = {"causal": mask(), "window": mask(window=window),
                      "window+sink tokens": mask(window=window, sink_tokens=sink_tokens)}

    def mask_mod(self, case: Case):
        """The mask_mod of ``case``'s kind, its tensors set to ``case``'s numbers (needs causal)."""
        offset, window, sink_tokens = self.params
        offset.fill_(masks.diagonal(case.n_q, case.n_k))
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
    if name == "op":
        return Op(source)
    if name == "sdpa-flash":
        return Sdpa(name, "FLASH_ATTENTION")
    if name == "sdpa-cudnn":
        return Sdpa(name, "CUDNN_ATTENTION")
    if name == "flex":
        return Flex()
    raise ValueError(f"unknown provider {name!r}; the providers are: {', '.join(PROVIDER_NAMES)}")
