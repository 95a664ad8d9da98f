"""The benchmark's cases: shapes, masks, FLOP counts, the providers each stage is timed with, and
the inputs of a case."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kernels import masks

import torch


@functools.lru_cache(maxsize=None)
def visible_pairs(n_q: int, n_k: int, *, causal: bool = False, window: int | None = None,
                  sink_tokens: int = 0) -> int:
    """Visible (query, key) pairs of one (batch, head), with the workbook's masks (kernels/masks.py)."""
    return masks.count(masks.attention_mask(n_q, n_k, causal=causal, window=window, sink_tokens=sink_tokens),
                       n_q, n_k)


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
                  "solution-wgmma", "op")
DEFAULT_PROVIDERS = ["solution", "sdpa-flash", "sdpa-cudnn", "flex"]
_WITH_TMA = ["solution", "solution-tma", "sdpa-flash", "sdpa-cudnn", "flex"]
PROVIDERS: dict[str, list[str]] = {
    "stage4": ["solution", "solution-wgmma", "stage3-triton", "sdpa-flash", "sdpa-cudnn"],
    "stage5": _WITH_TMA + ["solution-wgmma"], "stage6": _WITH_TMA + ["solution-wgmma"],
    "stage7": _WITH_TMA + ["solution-wgmma"], "stage8": _WITH_TMA + ["solution-wgmma"],
    "stage9": _WITH_TMA + ["solution-wgmma", "op"],
}
#: What a learner's notebook races: their own kernel and PyTorch's attention.  Never the instructors' variants
#: (solution-tma, solution-wgmma) nor another stage's kernel, which compile for minutes at first use and are
#: not the learner's work; ``python -m grader bench`` times those.
LEARNER_PROVIDERS = ("solution", "sdpa-flash", "sdpa-cudnn", "flex")


def learner_providers(stage: str) -> list[str]:
    """The providers of ``stage``'s benchmark that a learner's notebook times (see LEARNER_PROVIDERS)."""
    return [p for p in PROVIDERS.get(stage, DEFAULT_PROVIDERS) if p in LEARNER_PROVIDERS]


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
