"""Probe: the host time that one attention call adds to a compiled training graph.

Bench train's compiled steps wait on the host (docs/hopper-notes.md, section 15), so what each
attention call costs the host inside a compiled graph decides the step as much as its kernels.
Inductor launches its own kernels through a static launcher; the op's Triton kernels are
user-defined kernels, launched through Triton's launcher unless
``static_launch_user_defined_triton_kernels`` is set (and never statically while a kernel needs
a scratch buffer, as kernels that make TMA descriptors do).

This compiles (``fullgraph=True``) a chain of LAYERS attention calls, each on the output of the one
before, at bench train's attention (bfloat16, (B, N, H, D) views, GQA, causal, learned sinks), for
each provider, and times the host's part of a forward plus backward of the chain: the GPU kept busy
by a spin first, so the host never waits on it.  The chain's fixed costs (Dynamo's guards,
AOTAutograd, the autograd engine) are the same at every length, so the time per attention call is
the difference between two lengths over the difference in calls.

    python grader/bench/probes/compiled_host.py [--json PATH]                 (a CUDA GPU)

Providers: ``op`` (solutions/attention_op as committed), ``op-stage9`` (its plans with stage 9's
kernels, which need no scratch), the latter also with the static launcher asked for (``-static``), and
``flex`` (FlexAttention with its block mask, sinks through its lse, as bench train has it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels import masks, runtime  # noqa: E402  (runtime decides TRITON_INTERPRET first)
from kernels.loader import ROOT, load_package  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

B, N, HQ, HKV, D = 2, 1024, 8, 2, 64
LAYERS = (1, 5)                                  # chain lengths: the difference is what one call costs
CALLS, REPEATS = 10, 5                           # timed calls a repeat, repeats (the median is kept)
STATIC = {"static_launch_user_defined_triton_kernels": True}
#: (provider, the op's plans.KERNELS or None for FlexAttention, torch.compile options)
PROVIDERS = (("op", "auto", {}), ("op-stage9", "stage9", {}),
             ("op-stage9-static", "stage9", STATIC), ("flex", None, {}))


def attend_of(provider_kernels):
    """``attend(q, k, v, sinks) -> o`` on (B, N, H, D) tensors for a provider."""
    if provider_kernels is None:
        from torch.nn.attention.flex_attention import create_block_mask

        from grader.bench.providers import _flex_with_sinks
        mask = create_block_mask(masks.attention_mask(N, N, causal=True), None, None, N, N, device="cuda")

        def flex(q, k, v, sinks):
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return _flex_with_sinks(q, k, v, sinks, mask, True).transpose(1, 2)
        return flex
    op = load_package(ROOT / "solutions" / "attention_op")
    op.plans.KERNELS = provider_kernels
    for cache in (op.plans._plans, op.plans._backward_plans, op.launch._chosen):
        cache.clear()

    def workbook(q, k, v, sinks):
        return op.attention(q, k, v, is_causal=True, sinks=sinks, enable_gqa=True, layout="bnhd")
    return workbook


def host_ms(attend, layers: int, options: dict) -> float:
    """Host milliseconds to issue one forward plus backward of a compiled chain of ``layers`` calls."""
    torch._dynamo.reset()

    def chain(x, k, v, sinks):
        for _ in range(layers):
            x = attend(x, k, v, sinks)
        return x
    step = torch.compile(chain, fullgraph=True, dynamic=False, options=options)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
    k, v = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)
            for _ in range(2))
    sinks = torch.zeros(HQ, device="cuda", requires_grad=True)
    do = torch.randn_like(x)

    def call():
        torch.autograd.grad(step(x, k, v, sinks), (x, k, v, sinks), do)
    for _ in range(3):                             # compile, plan, warm up
        call()
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)             # the GPU busy: the calls queue behind it
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        times.append((time.perf_counter() - start) / CALLS * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def summary(rows: list[dict]) -> list[str]:
    """A markdown table: a row a provider, the chain's host ms at the shortest and the longest length
    the rows hold, and one call's µs (the difference over the difference in calls), then
    FlexAttention's over it."""
    lengths = sorted({r["layers"] for r in rows})
    lo, hi = (lengths[0], lengths[-1]) if len(lengths) > 1 else LAYERS
    per = {}
    for provider in dict.fromkeys(r["provider"] for r in rows):
        of = {r["layers"]: r["host_ms"] for r in rows if r["provider"] == provider}
        if lo in of and hi in of:
            per[provider] = (of[lo], of[hi], (of[hi] - of[lo]) / (hi - lo) * 1e3)
    lines = [f"| provider | host ms, chain of {lo} | host ms, chain of {hi} | µs a call | FlexAttention's over it |",
             "| --- | --- | --- | --- | --- |"]
    for provider, (a, b, us) in per.items():
        ratio = f"{per['flex'][2] / us:.2f}x" if "flex" in per and us > 0 else "-"
        lines.append(f"| {provider} | {a:.3f} | {b:.3f} | {us:.0f} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "compiled-host.json"))
    args = parser.parse_args(argv)
    if not runtime.ON_GPU:
        print(f"this probe compiles for a CUDA GPU, and none is visible here ({runtime.describe()})", file=sys.stderr)
        return 2
    from grader.bench.train import compile_caches_off
    compile_caches_off()
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python grader/bench/probes/compiled_host.py", shape=[B, N, HQ, HKV, D], rows=[])
    for provider, kernels, options in PROVIDERS:
        attend = attend_of(kernels)
        for layers in LAYERS:
            try:
                ms = host_ms(attend, layers, options)
            except Exception as error:             # noqa: BLE001 - an option this torch lacks, say
                print(f"{provider} {layers}: failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
                continue
            doc["rows"].append(dict(provider=provider, layers=layers, host_ms=round(ms, 4)))
            print(f"{provider:18s} {layers} calls: host {ms:.3f} ms", flush=True)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
    load_package(ROOT / "solutions" / "attention_op").plans.KERNELS = "auto"
    print("\n".join(summary(doc["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
