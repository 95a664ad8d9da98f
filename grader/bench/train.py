"""``python -m grader bench train``: a gpt-oss-style training step with each attention provider.

    python -m grader bench train                          the two small sizes (minutes: three compiles each)
    python -m grader bench train --sizes large --json docs/bench-train-h100.json

The model is a small decoder in gpt-oss's shape: RMSNorm, rotary embeddings, grouped-query
attention with a learned sink logit per query head, layers alternating a 128-token sliding
window and full causal attention, a SwiGLU MLP, bfloat16 autocast and AdamW.  Every provider
trains the same initial weights on the same batches:

    workbook            solutions/attention_op's op in an eager model
    workbook-compiled   the same model under torch.compile(fullgraph=True)
    flex-compiled       FlexAttention with block masks, sinks through its lse, model compiled
    sdpa-floor          SDPA (is_causal on every layer: no window, no sinks), model compiled;
                        not the same model, a floor for what a fused kernel costs
    cudnn-compiled      SDPA's cuDNN backend, called as its aten op (is_causal on every layer: no
                        window, no sinks; K/V heads repeated to the query heads), model compiled:
                        what a Hopper user would pick where sinks are not needed; not the same model
    attention-free      attention's output replaced by its query (o = q), model compiled: the
                        step without attention (and without the key/value projection that only
                        attention reads), so its speed over flex-compiled bounds what any
                        attention kernel could gain in this model

It reports the step time (median of CUDA-event timings of single steps after the compile and
warm-up steps), tokens per second, peak memory, and whether the loss curves of the three
providers that train the same model agree.  Two more numbers say what paces a step: the host
time to issue one step while the GPU is kept busy, so that no launch waits on it (Python, the
dispatcher, kernel launches), and the GPU time
of the step's kernels, all of them and those of attention alone, from a profile of a few more
steps.  Where the host time is near the step time and the kernels take less, the step waits on
the host, and a faster kernel cannot shorten it.  The batches repeat a random 64-token phrase, so
the loss falls quickly once attention learns to copy, and a wrong attention shows in the curve.

A size's providers are built, compiled and warmed up one after another, and then take turns: the
timed steps run in rounds (``ROUNDS``), each provider taking its share of a round's steps in turn,
so that a change in the host's pace during the run falls on every provider alike.  A small model's
step mostly waits on the host, and that pace moves from one minute to the next.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass

from kernels import runtime

import torch
import torch.nn.functional as F
from torch import nn

PROVIDERS = ("workbook", "workbook-compiled", "flex-compiled", "cudnn-compiled", "sdpa-floor", "attention-free")
SAME_MODEL = ("workbook", "workbook-compiled", "flex-compiled")     # their loss curves must agree
LOSS_RTOL = 0.02                 # bfloat16 training drifts; 2% of the loss at each step is agreement


@dataclass(frozen=True)
class Size:
    name: str
    batch: int
    seq: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 64
    window: int = 128
    vocab: int = 16384
    lr: float = 3e-3             # AdamW's.  The large model takes 1e-4: at 3e-3 it diverges, and at a few
    #                              times 1e-4 its providers' curves drift apart by more than LOSS_RTOL: AdamW's
    #                              first steps move every weight by about lr whatever the gradient's size, so
    #                              bfloat16 rounding differences grow with lr.


SIZES = {
    "b8n1024": Size("b8n1024", 8, 1024, 512, 4, 8, 2),
    "b2n4096": Size("b2n4096", 2, 4096, 512, 4, 8, 2),
    "large": Size("large", 1, 4096, 2048, 8, 32, 4, lr=1e-4),
}
SMALL = ["b8n1024", "b2n4096"]


# =============================================================================================
# The model.
# =============================================================================================

class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, eps=1e-5)


def rotary(x, cos, sin):
    """Rotate pairs of x's last dim (B, N, H, D) by position-dependent angles (cos, sin: (N, D/2))."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]                              # (N, 1, D/2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, size: Size, window: int | None):
        super().__init__()
        self.size, self.window = size, window
        hd = size.head_dim
        self.q = nn.Linear(size.d_model, size.heads * hd, bias=False)
        self.kv = nn.Linear(size.d_model, 2 * size.kv_heads * hd, bias=False)
        self.out = nn.Linear(size.heads * hd, size.d_model, bias=False)
        self.sinks = nn.Parameter(torch.zeros(size.heads))                  # float32 logits, one per head

    def forward(self, x, cos, sin, attend):
        B, N, _ = x.shape
        s = self.size
        q = self.q(x).view(B, N, s.heads, s.head_dim)                        # (B, N, Hq, D)
        k, v = self.kv(x).view(B, N, 2, s.kv_heads, s.head_dim).unbind(2)    # (B, N, Hkv, D) each
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        o = attend(q, k, v, self)                                            # (B, N, Hq, D)
        return self.out(o.reshape(B, N, s.heads * s.head_dim))


class Block(nn.Module):
    def __init__(self, size: Size, window: int | None):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(size.d_model), RMSNorm(size.d_model)
        self.attn = Attention(size, window)
        hidden = 3 * size.d_model                                            # dense, where gpt-oss has experts
        self.up = nn.Linear(size.d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, size.d_model, bias=False)

    def forward(self, x, cos, sin, attend):
        x = x + self.attn(self.norm1(x), cos, sin, attend)
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Decoder(nn.Module):
    """gpt-oss's layout in small: even layers see a sliding window, odd layers everything before them."""

    def __init__(self, size: Size, attend):
        super().__init__()
        self.size, self.attend = size, attend
        self.embed = nn.Embedding(size.vocab, size.d_model)
        self.blocks = nn.ModuleList(Block(size, size.window if i % 2 == 0 else None) for i in range(size.layers))
        self.norm = RMSNorm(size.d_model)
        self.head = nn.Linear(size.d_model, size.vocab, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, size.head_dim, 2, dtype=torch.float32) / size.head_dim))
        angles = torch.outer(torch.arange(size.seq, dtype=torch.float32), inv)   # (N, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos, self.sin, self.attend)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# =============================================================================================
# The providers: each is an ``attend(q, k, v, layer)`` on (B, N, H, D) tensors.
# =============================================================================================

def _workbook_attend():
    from kernels.loader import ROOT, load_package
    op = load_package(ROOT / "solutions" / "attention_op")

    def attend(q, k, v, layer):
        return op.attention(q, k, v, is_causal=True, window=layer.window, sinks=layer.sinks, enable_gqa=True,
                            layout="bnhd")
    return attend


def _flex_attend(size: Size, device):
    from kernels import masks

    from torch.nn.attention.flex_attention import create_block_mask

    from grader.bench.providers import _flex_with_sinks

    block_masks = {w: create_block_mask(masks.attention_mask(size.seq, size.seq, causal=True, window=w), None, None,
                                        size.seq, size.seq, device=device) for w in (None, size.window)}

    def attend(q, k, v, layer):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))                     # (B, H, N, D)
        return _flex_with_sinks(q, k, v, layer.sinks, block_masks[layer.window], True).transpose(1, 2)
    return attend


def _sdpa_attend(q, k, v, layer):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


def _cudnn_attend(q, k, v, layer):
    """SDPA's cuDNN kernels by their aten op, so no backend choice can fall back to another kernel
    unseen; cuDNN takes as many K/V heads as query heads, so each K/V head is repeated."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))                         # (B, H, N, D)
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))               # (B, Hq, N, D)
    o = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[0]
    return o.transpose(1, 2)


def _free_attend(q, k, v, layer):
    return q


def _model(size: Size, provider: str, device):
    attend = (_workbook_attend() if provider.startswith("workbook") else
              _flex_attend(size, device) if provider == "flex-compiled" else
              _cudnn_attend if provider == "cudnn-compiled" else
              _free_attend if provider == "attention-free" else _sdpa_attend)
    torch.manual_seed(0)                                                     # the same weights for every provider
    model = Decoder(size, attend).to(device)
    step_model = torch.compile(model, fullgraph=True, dynamic=False) if provider != "workbook" else model
    return model, step_model


def batches(size: Size, steps: int, device, phrase: int = 64):
    """``steps`` batches of (tokens, targets): each row a random ``phrase``-token sequence repeated."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        base = torch.randint(size.vocab, (size.batch, phrase), generator=gen)
        row = base.repeat(1, (size.seq + 1) // phrase + 1)[:, : size.seq + 1]
        out.append((row[:, :-1].to(device), row[:, 1:].to(device)))
    return out


# =============================================================================================
# The run.
# =============================================================================================

ROUNDS = 4                       # the timed steps run in this many rounds, the providers taking turns


def rounds(steps: int, count: int = ROUNDS) -> list[range]:
    """The timed steps' indices ``0 .. steps - 1`` in ``count`` rounds of consecutive steps, as even
    as they divide (fewer rounds when there are fewer steps)."""
    count = max(1, min(count, steps))
    bounds = [steps * i // count for i in range(count + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def take_turns(runs: list, steps: int, count: int = ROUNDS, synchronize=None) -> None:
    """Run every timed step of each of ``runs`` (``run.timed(indices)``), round by round, each run
    taking its share of a round in turn; ``synchronize`` (the GPU's) before each share, so that no
    share starts with the previous run's kernels still queued."""
    for share in rounds(steps, count):
        for run in runs:
            if synchronize is not None:
                synchronize()
            run.timed(share)


class _Provider:
    """One provider's model and optimizer at one size: built, compiled and warmed up on creation,
    then timed step by step (``timed``), then profiled (``row``)."""

    def __init__(self, size: Size, provider: str, data: list, warmup: int):
        self.size, self.provider, self.data, self.warmup = size, provider, data, warmup
        resident = torch.cuda.memory_allocated()            # the providers built before this one
        torch.cuda.reset_peak_memory_stats()
        self.model, self.step_model = _model(size, provider, runtime.DEVICE)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=size.lr, weight_decay=0.01)
        began = time.perf_counter()
        self.losses = [_train_step(self.step_model, self.opt, *batch).detach() for batch in data[:warmup]]
        torch.cuda.synchronize()
        self.first_s = time.perf_counter() - began
        self.peak = torch.cuda.max_memory_allocated() - resident
        self.times: list = []

    def timed(self, indices) -> None:
        for i in indices:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = _train_step(self.step_model, self.opt, *self.data[self.warmup + i])
            end.record()
            self.losses.append(loss.detach())
            self.times.append((start, end))

    def row(self) -> dict:
        torch.cuda.synchronize()
        size, steps = self.size, len(self.times)
        ms = statistics.median(s.elapsed_time(e) for s, e in self.times)
        host_ms, kernel_ms, attention_ms = _what_paces(self.step_model, self.opt,
                                                       self.data[self.warmup:self.warmup + min(PACE_STEPS, steps)])
        return dict(size=size.name, provider=self.provider, batch=size.batch, seq=size.seq, d_model=size.d_model,
                    layers=size.layers, heads=size.heads, kv_heads=size.kv_heads, head_dim=size.head_dim,
                    window=size.window, lr=size.lr, step_ms=round(ms, 3),
                    tokens_per_s=round(size.batch * size.seq / ms * 1e3), peak_mib=round(self.peak / 2 ** 20),
                    warmup_s=round(self.first_s, 1),
                    host_ms=round(host_ms, 3), host_while=HOST_WHILE, kernel_ms=round(kernel_ms, 3),
                    attention_ms=round(attention_ms, 3),
                    losses=[round(x.item(), 4) for x in self.losses])


def run_size(size: Size, providers: list[str], *, warmup: int, steps: int, say=None) -> list[dict]:
    """One row per provider at ``size``: each built and warmed up in turn, then the timed steps
    taken in rounds (``take_turns``), then each profiled.  ``say(text)`` hears of each provider ready."""
    data = batches(size, warmup + steps, runtime.DEVICE)
    runs = []
    for provider in providers:
        runs.append(_Provider(size, provider, data, warmup))
        if say is not None:
            say(f"  {size.name} {provider}: compiled and warmed up in {runs[-1].first_s:.0f} s, "
                f"{runs[-1].peak / 2 ** 20:.0f} MiB")
    take_turns(runs, steps, synchronize=torch.cuda.synchronize)
    return [{**run.row(), "rounds": len(rounds(steps))} for run in runs]


def run_one(size: Size, provider: str, *, warmup: int, steps: int) -> dict:
    """One provider's row at ``size``, run alone."""
    return run_size(size, [provider], warmup=warmup, steps=steps)[0]


PACE_STEPS = 3                   # steps of each kind that _what_paces times (on the first timed steps' batches again)
SPIN_CYCLES = 400_000_000        # the GPU's spin before each host-timed step: about 0.2 s at Hopper's clock
HOST_WHILE = "gpu busy"          # a row's host_while: how its host_ms was taken (rows without it: an idle GPU)
ATTENTION_KERNELS = ("flash", "_bwd_", "_tma_forward", "_tma_dkdv", "_tma_dq", "flex_attention", "attention",
                     "sdpa")     # in a GPU kernel's name


def is_attention_kernel(name: str) -> bool:
    """Whether a GPU kernel of a step is attention's: the workbook's (stage 9's forward and backward,
    the TMA kernels the op runs on Hopper), FlexAttention's generated ones, SDPA's FlashAttention
    kernels and cuDNN's fused attention (``cudnn_generated_fort_native_sdpa_...``) all carry one of
    these words."""
    return any(word in name for word in ATTENTION_KERNELS)


def _train_step(step_model, opt, tokens, targets) -> torch.Tensor:
    """One training step (bfloat16 autocast, backward, AdamW); returns the loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = step_model(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _what_paces(step_model, opt, data) -> tuple[float, float, float]:
    """``(host ms, kernel ms, attention kernel ms)`` per step: the host's a median, the kernels' a mean over ``data``.

    Host: the time to issue one step while the GPU works through a spin queued just before it, so
    that no launch waits on the GPU (``HOST_WHILE``); a step that waited for the GPU would take the
    spin's length.  Kernels: the GPU time of every kernel of the step, from a profile; and of
    the attention kernels among them.  The steps train on: these are extra steps of the same run,
    after the timed ones.
    """
    from torch.profiler import ProfilerActivity, profile

    host = []
    for tokens, targets in data:
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        began = time.perf_counter()
        _train_step(step_model, opt, tokens, targets)
        host.append((time.perf_counter() - began) * 1e3)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for tokens, targets in data:
            _train_step(step_model, opt, tokens, targets)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)          # a named range, not a kernel
               and not e.name.startswith(("Memcpy", "Memset"))]

    def per_step(events):
        return sum(e.device_time_total for e in events) / len(data) / 1e3    # µs -> ms

    return (statistics.median(host), per_step(kernels),
            per_step([e for e in kernels if is_attention_kernel(e.name)]))


def agreement(rows: list[dict]) -> dict[str, float]:
    """Per size: the largest relative gap between the loss curves of the providers that train one model."""
    gaps = {}
    for size in {r["size"] for r in rows}:
        curves = [r["losses"] for r in rows if r["size"] == size and r["provider"] in SAME_MODEL]
        if len(curves) >= 2:
            gaps[size] = max(abs(a - b) / abs(b) for c in curves[1:] for a, b in zip(c, curves[0]))
    return gaps


def _same_model(rows: list[dict], size: str) -> list[str]:
    """The providers of ``SAME_MODEL`` that ran at ``size``: those whose loss curves were compared."""
    ran = {r["provider"] for r in rows if r["size"] == size}
    return [p for p in SAME_MODEL if p in ran]


def _vs_flex(rows: list[dict], r: dict, key: str = "step_ms") -> str:
    """Row ``r``'s speed relative to FlexAttention's compiled model at its size ("1.05x"), or "-";
    by its step time, or by another time ``key`` (``kernel_ms``) where both rows have it."""
    flex = next((x for x in rows if x["size"] == r["size"] and x["provider"] == "flex-compiled"), None)
    if flex is None or flex.get(key) is None or not r.get(key):
        return "-"
    return f"{flex[key] / r[key]:.2f}x"


def _ms(r: dict, key: str) -> str:
    """A row's ``host_ms``, ``kernel_ms`` or ``attention_ms`` as text; "-" in a file written before it was measured."""
    return f"{r[key]:.2f}" if r.get(key) is not None else "-"


def table(rows: list[dict], gaps: dict[str, float]) -> str:
    lines = [f"{'size':<9} {'provider':<18} {'step ms':>8} {'host ms':>8} {'kernels':>8} {'attn':>6} {'tokens/s':>10} "
             f"{'peak MiB':>9} {'vs flex':>8} {'first loss':>10} {'last loss':>9}"]
    for r in rows:
        ratio = _vs_flex(rows, r)
        lines.append(f"{r['size']:<9} {r['provider']:<18} {r['step_ms']:>8.2f} {_ms(r, 'host_ms'):>8} "
                     f"{_ms(r, 'kernel_ms'):>8} {_ms(r, 'attention_ms'):>6} {r['tokens_per_s']:>10} "
                     f"{r['peak_mib']:>9} {ratio:>8} {r['losses'][0]:>10.3f} {r['losses'][-1]:>9.3f}")
    for size, gap in sorted(gaps.items()):
        verdict = "agree" if gap <= LOSS_RTOL else "DISAGREE"
        lines.append(f"{size}: loss curves of {', '.join(_same_model(rows, size))} {verdict} "
                     f"(largest relative gap {gap:.2%}, limit {LOSS_RTOL:.0%})")
    return "\n".join(lines)


def markdown(doc: dict, source: str) -> str:
    """The page ``python -m grader bench report`` makes of a file ``write_json`` wrote (docs/training.md)."""
    rows, gaps = doc["rows"], doc.get("loss_gap", {})
    software = ", ".join(f"{k} {doc[k]}" for k in ("python", "torch", "triton") if doc.get(k))
    out = ["# A training step", "",
           f"Generated by `python -m grader bench report {source}` from what `python -m grader bench train "
           "--json FILE` wrote; edit the JSON's run, not this page. Each size's providers ran in the same run on "
           "the same batches (grader/bench/train.py describes the model and the providers)." + _turns(rows), "",
           f"- machine: {doc.get('gpu', 'not recorded')}", f"- software: {software or 'not recorded'}", "",
           "| size | provider | step ms | host ms | kernels ms | attention kernels ms | tokens/s | peak MiB | "
           "speed vs flex-compiled | first loss | last loss |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['size']} | {r['provider']} | {r['step_ms']:.2f} | {_ms(r, 'host_ms')} | "
                   f"{_ms(r, 'kernel_ms')} | {_ms(r, 'attention_ms')} | {r['tokens_per_s']} | {r['peak_mib']} | "
                   f"{_vs_flex(rows, r)} | {r['losses'][0]:.3f} | {r['losses'][-1]:.3f} |")
    if any(r.get("host_ms") is not None for r in rows):
        out += ["", "Step ms is the median CUDA-event time of a step. Host ms is " + _host_while(rows)
                + " (Python, the dispatcher, kernel launches); kernels ms is the GPU time of the step's kernels, "
                    "and attention kernels ms that of attention's alone, from a profile of a few more steps. Where "
                    "host ms is near step ms and kernels ms is below it, the step waits on the host: a faster kernel "
                    "does not shorten it." + _host_above(rows)]
    free = [(r, _vs_flex(rows, r), _vs_flex(rows, r, "kernel_ms")) for r in rows if r["provider"] == "attention-free"]
    if free:
        out += ["", "The most any attention kernel could gain in this model: the attention-free step (attention's "
                    "output replaced by its query, so attention and the key/value projection drop out) against "
                    "flex-compiled's, measured in the same run, in step time and, where measured, in the GPU time "
                    "of the step's kernels (which the host's pace does not change):", ""]
        out += [f"- {r['size']}: {ratio}" + (f" in step time, {kernels} in kernel time" if kernels != "-" else "")
                for r, ratio, kernels in free]
    limit = doc.get("loss_rtol", LOSS_RTOL)
    out += ["", f"Loss curves of the providers that train one model ({', '.join(SAME_MODEL)}) agree when no "
                f"step's losses differ by more than {limit:.0%}:", ""]
    for size, gap in sorted(gaps.items()):
        out.append(f"- {size}: {', '.join(_same_model(rows, size))} {'agree' if gap <= limit else 'DISAGREE'} "
                   f"(largest relative gap {gap:.2%})")
    return "\n".join(out) + "\n"


def _host_while(rows: list[dict]) -> str:
    """What the page says host ms is, from how the rows that have it say it was taken."""
    busy = {r.get("host_while") == HOST_WHILE for r in rows if r.get("host_ms") is not None}
    idle = "the time to issue one step to an idle GPU"
    while_busy = ("the time to issue one step while the GPU works through a spin queued before it, so that no "
                  "launch waits on the GPU")
    if busy == {True}:
        return while_busy
    if busy == {False}:
        return idle
    return (f"{while_busy} in rows of sizes {', '.join(dict.fromkeys(r['size'] for r in rows if r.get('host_while')))}"
            f", else {idle}")


def _host_above(rows: list[dict]) -> str:
    """The page's sentence on rows whose host ms is above their step ms, where there are any."""
    timed = [r for r in rows if r.get("host_ms") is not None]
    above = [r for r in timed if r["host_ms"] > r["step_ms"]]
    if not above:
        return ""
    return (f" In {len(above)} of {len(timed)} rows host ms is above step ms: one step issued alone took the host "
            "longer than a step among the timed ones took in all, so there host ms is not the pace of the timed steps.")


def _turns(rows: list[dict]) -> str:
    """The page's sentence on how the timed steps of each size were taken, where the rows say (and
    more than one provider ran at the size: one alone takes no turns)."""
    taken = {}
    for r in rows:
        if r.get("rounds") and sum(x["size"] == r["size"] for x in rows) > 1:
            taken.setdefault(r["rounds"], []).append(r["size"])
    return "".join(f" At {', '.join(dict.fromkeys(sizes))} the providers took turns: the timed steps ran in {n} "
                   f"rounds, each provider taking its share of a round in turn; peak memory is the most the "
                   f"provider held during its build and warm-up steps."
                   for n, sizes in sorted(taken.items()))


def write_json(rows: list[dict], gaps: dict[str, float], path: str) -> None:
    """Write the rows, merged over an earlier file's rows of other sizes (one size per run fits a lease)."""
    import triton
    try:
        with open(path) as f:
            old = json.load(f)
        kept = [r for r in old.get("rows", []) if r["size"] not in {x["size"] for x in rows}]
        old_gaps = {k: v for k, v in old.get("loss_gap", {}).items() if k not in gaps}
    except (OSError, ValueError):
        kept, old_gaps = [], {}
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), loss_rtol=LOSS_RTOL,
               loss_gap={k: round(v, 5) for k, v in {**old_gaps, **gaps}.items()}, rows=kept + rows)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def compile_cache_flags() -> list[tuple]:
    """``(config module, flag)`` of Inductor's graph cache and AOTAutograd's cache, those this torch has."""
    import torch._functorch.config
    import torch._inductor.config
    return [(config, flag) for config, flag in ((torch._inductor.config, "fx_graph_cache"),
                                                (torch._functorch.config, "enable_autograd_cache"))
            if hasattr(config, flag)]


def compile_caches_off():
    """Turn off Inductor's graph cache and AOTAutograd's cache in this process.  They key a compiled
    graph by what Dynamo traced, which holds the workbook's op as one call, so a run that compiles the
    same model under other plans, or after the op's code changed, would take the graph compiled
    before.  Called by bench train's and the probes' ``main``, never at import, so that importing a
    probe (as the tests do) changes nothing.  Returns a function that puts the flags back as they were
    (by assignment)."""
    flags = compile_cache_flags()
    saved = [getattr(config, flag) for config, flag in flags]
    for config, flag in flags:
        setattr(config, flag, False)

    def restore() -> None:
        for (config, flag), value in zip(flags, saved):
            setattr(config, flag, value)
    return restore


def probe_start(argv: list[str] | None, description: str, command: str, json_name: str):
    """The command line of a probe that trains bench train's model (grader/bench/probes/): its
    ``--sizes`` (checked against ``SIZES``) and ``--json``, then ``(sizes, json path, doc)`` with the
    doc's GPU, versions and command; None, said on stderr, where no CUDA GPU is visible."""
    import argparse

    import triton
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--sizes", default=",".join(SMALL), help="bench train's sizes, comma-separated")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), json_name))
    args = parser.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown or not sizes:
        parser.error(f"--sizes: unknown {', '.join(map(repr, unknown)) or '(none given)'}; known: {', '.join(SIZES)}")
    if not runtime.ON_GPU:
        print(f"this probe trains on a CUDA GPU, and none is visible here ({runtime.describe()})", file=sys.stderr)
        return None
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command=command, rows=[])
    return sizes, args.json, doc


def probe_model(size: Size, provider: str, warmup: int, steps: int):
    """A probe's model: ``provider``'s at ``size``, compiled afresh (Dynamo reset first), its AdamW,
    and ``warmup`` steps taken; returns ``(step_model, optimizer, batches)`` with ``steps`` batches
    left to time."""
    torch._dynamo.reset()
    model, step_model = _model(size, provider, runtime.DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=size.lr, weight_decay=0.01)
    data = batches(size, warmup + steps, runtime.DEVICE)
    for tokens, targets in data[:warmup]:
        _train_step(step_model, opt, tokens, targets)
    return step_model, opt, data[warmup:]


def probe_record(doc: dict, json_path: str, row: dict) -> dict:
    """``row`` added to a probe's ``doc`` and the doc written to ``json_path`` at once, so that a run
    cut short keeps its rows; returns the row."""
    doc["rows"].append(row)
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    return row


def main(*, sizes: str | None = None, providers: str | None = None, steps: int = 20, warmup: int = 3,
         json_path: str | None = None) -> int:
    """``python -m grader bench train``: time training steps of these ``sizes`` (``a,b``; default the small
    ones) with these ``providers`` (default all), ``warmup`` steps then ``steps`` timed ones; ``json_path`` is
    a file to merge the rows into."""
    sizes = [s.strip() for s in (sizes or ",".join(SMALL)).split(",") if s.strip()]
    providers = [p.strip() for p in (providers or ",".join(PROVIDERS)).split(",") if p.strip()]
    bad = [s for s in sizes if s not in SIZES] + [p for p in providers if p not in PROVIDERS]
    if bad or not sizes or not providers:
        print(f"unknown size or provider {', '.join(map(repr, bad)) or '(none given)'}; sizes: "
              f"{', '.join(SIZES)}; providers: {', '.join(PROVIDERS)}", file=sys.stderr)
        return 2
    if steps < 1 or warmup < 1:
        print(f"--steps and --warmup must be at least 1, got {steps} and {warmup}", file=sys.stderr)
        return 2
    if not runtime.ON_GPU:
        print(f"python -m grader bench train times training steps on a CUDA GPU, and none is visible here "
              f"({runtime.describe()}).", file=sys.stderr)
        return 2
    import torch._dynamo
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compile_caches_off()                   # the op's step as its code is now, not a cached graph of before
    print(f"bench train on {runtime.describe()}: {', '.join(sizes)}; {', '.join(providers)}; "
          f"{warmup} warm-up and {steps} timed steps each", flush=True)
    rows = []
    for name in sizes:
        began = time.perf_counter()
        rows += run_size(SIZES[name], providers, warmup=warmup, steps=steps, say=lambda text: print(text, flush=True))
        print(f"  {name}: {len(providers)} providers in {time.perf_counter() - began:.0f} s, the timed steps in "
              f"{len(rounds(steps))} rounds", flush=True)
        torch.cuda.empty_cache()
    gaps = agreement(rows)
    print()
    print(table(rows, gaps))
    if json_path:
        write_json(rows, gaps, json_path)
        print(f"wrote {json_path}")
    return 0

