"""Probe: would the attention kernels of ``python -m grader bench train`` be faster with timed plans?

Below ``kernels.tuning.TUNE_FROM`` (query, key) pairs a head (2048 x 2048) the op's plans never
consider the wgmma forward or the one-pass backward, and below ``plans.TUNE_WORK`` pairs a call
as well they take each table's first tile untimed (``plans.timed``; the committed JSON was made
before ``TUNE_WORK``, when b8n1024's plans were untimed).  Bench train's b8n1024 layers (1024 x
1024 pairs a head) are below ``TUNE_FROM``, its b2n4096 layers above.  This
trains bench train's model, compiled, with the op as committed (``workbook-compiled``), with
``TUNE_FROM`` lowered to 1 so that every plan is timed (``workbook-compiled-timed``), with the
op's Triton kernels alone (``workbook-compiled-tma``: in a compiled graph the wgmma forward is an
opaque op whose Python runs every call), and with FlexAttention (``flex-compiled``), one after
another in one process on the same batches; for each, the host time to issue a step, the GPU
time of the step's attention kernels from a profile of a few steps, and each attention kernel's
share, by name.

    python grader/bench/probes/train_tiles.py [--sizes b8n1024,b2n4096] [--json PATH]     (a CUDA GPU)
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels import runtime, tuning  # noqa: E402, F401  (runtime first: it decides TRITON_INTERPRET)
from kernels.loader import ROOT, load_package  # noqa: E402

import torch  # noqa: E402

from grader.bench import train as bench_train  # noqa: E402

WARMUP, PROFILED = 3, 5                   # steps before the profile (the compile among them), and in it
#: (row name, bench train's provider, TUNE_FROM for the run: None keeps the committed one, the op's
#: kernel set: plans.KERNELS, "tma" for the Triton kernels alone, no wgmma forward or one pass)
RUNS = (("flex-compiled", "flex-compiled", None, "auto"), ("workbook-compiled", "workbook-compiled", None, "auto"),
        ("workbook-compiled-timed", "workbook-compiled", 1, "auto"),
        ("workbook-compiled-tma", "workbook-compiled", None, "tma"))


def attention_kernels(step_model, opt, data) -> dict[str, float]:
    """Milliseconds a step of each attention kernel (bench train's ``is_attention_kernel``), from a
    profile of training steps on ``data``."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for tokens, targets in data:
            bench_train._train_step(step_model, opt, tokens, targets)
        torch.cuda.synchronize()
    ms: dict[str, float] = {}
    for e in prof.events():
        if (e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
                and bench_train.is_attention_kernel(e.name)):
            ms[e.name] = ms.get(e.name, 0.0) + e.device_time_total / len(data) / 1e3
    return ms


def run(size: bench_train.Size, name: str, provider: str, tune_from: int | None, kernel_set: str = "auto") -> dict:
    """One row: ``provider`` trained at ``size`` with ``TUNE_FROM`` set to ``tune_from`` (None: as
    committed) and the op's ``plans.KERNELS`` to ``kernel_set``: the attention kernels' GPU time
    and the host time to issue a step (a median over steps, the GPU idle at each
    step's start)."""
    op = load_package(ROOT / "solutions" / "attention_op")
    committed = tuning.TUNE_FROM
    tuning.TUNE_FROM = committed if tune_from is None else tune_from
    op.plans.KERNELS = kernel_set
    for cache in (op.plans._plans, op.plans._backward_plans, op.launch._chosen):
        cache.clear()                                   # plans made under another TUNE_FROM
    try:                                                # probe_model compiles afresh: no graph traced with them
        step_model, opt, timed = bench_train.probe_model(size, provider, WARMUP, PROFILED)
        host = []
        for tokens, targets in timed:
            torch.cuda.synchronize()
            began = time.perf_counter()
            bench_train._train_step(step_model, opt, tokens, targets)
            host.append((time.perf_counter() - began) * 1e3)
        torch.cuda.synchronize()
        kernels = attention_kernels(step_model, opt, timed)
    finally:
        tuning.TUNE_FROM = committed
        op.plans.KERNELS = "auto"
    return dict(size=size.name, run=name, provider=provider, tune_from=tuning.TUNE_FROM if tune_from is None
                else tune_from, kernel_set=kernel_set, host_ms=round(statistics.median(host), 3),
                attention_ms=round(sum(kernels.values()), 4),
                kernels={k: round(v, 4) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1])})


def summary(rows: list[dict]) -> list[str]:
    """The table the probe prints last: each row's attention kernels against FlexAttention's of its size."""
    lines = ["| size | run | TUNE_FROM | host ms a step | attention kernels ms | FlexAttention's over it |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        flex = next((x for x in rows if x["size"] == r["size"] and x["run"] == "flex-compiled"), None)
        ratio = f"{flex['attention_ms'] / r['attention_ms']:.2f}x" if flex and r["attention_ms"] else "-"
        lines.append(f"| {r['size']} | {r['run']} | {r['tune_from']} | {r['host_ms']:.2f} | "
                     f"{r['attention_ms']:.3f} | {ratio} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    start = bench_train.probe_start(argv, __doc__.split("\n\n")[0], "python grader/bench/probes/train_tiles.py",
                                    "train-tiles.json")
    if start is None:
        return 2
    sizes, json_path, doc = start
    bench_train.compile_caches_off()
    for size in sizes:
        for name, provider, tune_from, kernel_set in RUNS:
            r = bench_train.probe_record(doc, json_path, run(bench_train.SIZES[size], name, provider, tune_from,
                                                             kernel_set))
            print(f"{size} {name}: attention kernels {r['attention_ms']:.3f} ms a step", flush=True)
            for kernel, ms in r["kernels"].items():
                print(f"    {ms:7.3f} ms  {kernel[:110]}", flush=True)
    print("\n".join(summary(doc["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
