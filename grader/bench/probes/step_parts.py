"""Probe: where does a compiled training step of ``python -m grader bench train`` spend the host's time?

Bench train's host column times one step issued alone, and it reads above the step time (docs/
hopper-notes.md, section 15).  This probe times the host two other ways, the GPU kept busy by a
spin queued first so that no launch waits on it:

* by part: the forward (under autocast), ``loss.backward()``, the optimizer's step and
  ``zero_grad``, each step issued alone (the median over ``STEPS`` steps); "a step alone" is the
  sum of those four medians;
* pipelined: ``PIPELINED`` steps issued back to back behind one spin, the host's time per step.
  Where the spin ended before the host had issued them all, a launch may have waited on the GPU
  and the row says so (``spin_outlasted`` false).

beside the step time (CUDA events over ``STEPS`` steps back to back) and the GPU time of the
step's kernels, for the compiled model with the op, with FlexAttention and without attention.

    python grader/bench/probes/step_parts.py [--sizes b8n1024,b2n4096] [--json PATH]     (a CUDA GPU)
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels import runtime  # noqa: E402, F401  (imported first: it decides TRITON_INTERPRET)

import torch  # noqa: E402

from grader.bench import train as bench_train  # noqa: E402

PROVIDERS = ("flex-compiled", "workbook-compiled", "attention-free")
WARMUP, STEPS, PIPELINED = 3, 8, 3
PARTS = ("forward", "backward", "optimizer", "zero_grad")


def _spin() -> torch.cuda.Event:
    """Queue the GPU's spin (about 0.2 s on Hopper) and return an event recorded after it."""
    torch.cuda.synchronize()
    torch.cuda._sleep(bench_train.SPIN_CYCLES)
    done = torch.cuda.Event()
    done.record()
    return done


def parts(step_model, opt, tokens, targets) -> dict[str, float]:
    """Host milliseconds of each part of one step issued behind a spin."""
    marks = [time.perf_counter()]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = step_model(tokens, targets)
    marks.append(time.perf_counter())
    loss.backward()
    marks.append(time.perf_counter())
    opt.step()
    marks.append(time.perf_counter())
    opt.zero_grad(set_to_none=True)
    marks.append(time.perf_counter())
    return {name: (b - a) * 1e3 for name, a, b in zip(PARTS, marks, marks[1:])}


def run(size: bench_train.Size, provider: str) -> dict:
    """One row: ``provider``'s compiled step at ``size``, its host time by part and pipelined."""
    step_model, opt, timed = bench_train.probe_model(size, provider, WARMUP, STEPS)
    by_part: dict[str, list[float]] = {name: [] for name in PARTS}
    for tokens, targets in timed:
        _spin()
        for name, ms in parts(step_model, opt, tokens, targets).items():
            by_part[name].append(ms)
    pipelined, outlasted = [], []
    for first in range(0, len(timed) - PIPELINED + 1, PIPELINED):
        done = _spin()
        began = time.perf_counter()
        for tokens, targets in timed[first:first + PIPELINED]:
            bench_train._train_step(step_model, opt, tokens, targets)
        pipelined.append((time.perf_counter() - began) * 1e3 / PIPELINED)
        outlasted.append(not done.query())
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for tokens, targets in timed:
        bench_train._train_step(step_model, opt, tokens, targets)
    end.record()
    torch.cuda.synchronize()
    step_ms = start.elapsed_time(end) / len(timed)
    _, kernel_ms, attention_ms = bench_train._what_paces(step_model, opt, timed[:3])
    parts_ms = {name: round(statistics.median(v), 3) for name, v in by_part.items()}
    return dict(size=size.name, provider=provider, step_ms=round(step_ms, 3), kernel_ms=round(kernel_ms, 3),
                attention_ms=round(attention_ms, 3), parts_ms=parts_ms,
                alone_ms=round(sum(parts_ms.values()), 3), pipelined_ms=round(statistics.median(pipelined), 3),
                spin_outlasted=all(outlasted))


def summary(rows: list[dict]) -> list[str]:
    """The table the probe prints last: each row's host time by part and pipelined, beside its step."""
    lines = ["| size | provider | step ms | kernels ms | " + " | ".join(f"{p} ms" for p in PARTS)
             + " | a step alone ms | pipelined ms a step | spin outlasted |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in PARTS) + " | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['provider']} | {r['step_ms']:.2f} | {r['kernel_ms']:.2f} | "
                     + " | ".join(f"{r['parts_ms'][p]:.2f}" for p in PARTS)
                     + f" | {r['alone_ms']:.2f} | {r['pipelined_ms']:.2f} | {'yes' if r['spin_outlasted'] else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    start = bench_train.probe_start(argv, __doc__.split("\n\n")[0], "python grader/bench/probes/step_parts.py",
                                    "step-parts.json")
    if start is None:
        return 2
    sizes, json_path, doc = start
    for size in sizes:
        for provider in PROVIDERS:
            print(summary([bench_train.probe_record(doc, json_path, run(bench_train.SIZES[size], provider))])[-1],
                  flush=True)
    print("\n".join(summary(doc["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
