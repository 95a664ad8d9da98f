"""Probe: what the host does in a compiled training step of ``python -m grader bench train``, by function.

At the small sizes the compiled step is paced by the host (docs/hopper-notes.md, section 18), and
there the op's step trails FlexAttention's while its attention kernels are faster (section 23).
This probe profiles the host's part of a step's forward and backward with cProfile, the GPU kept
busy by a spin queued first so that no launch waits on it, for the compiled model with
FlexAttention, with the op as it runs (its TMA kernels' descriptors made by the graph), and with
the op's kernels making their own descriptors (``op-kernel-descriptors``).  Each row has the
host's time a step unprofiled (the median over ``STEPS`` steps) and profiled, the Python calls a
step, and the profiled time of what launches kernels:

* ``Triton launcher``: Triton's own launcher, which runs the user-defined kernels (the op's);
* ``descriptors``: ``TensorDescriptor.from_tensor``, the graph making the TMA descriptors;
* ``Inductor launcher``: Inductor's static launcher, which runs the kernels it generated;

each the cumulative time of those functions, divided by the steps.  cProfile slows Python code
more than the C++ it calls, so the profiled times weigh the parts, and the unprofiled time is the
host's.

    python grader/bench/probes/step_host_profile.py [--sizes b8n1024] [--json PATH]     (a CUDA GPU)
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
from kernels import runtime  # noqa: E402, F401  (imported first: it decides TRITON_INTERPRET)

import torch  # noqa: E402

from grader.bench import train as bench_train  # noqa: E402

#: (row name, bench train's provider, whether the op's graphs make its descriptors: None as the op finds
#: this torch, which is yes on an H100 or H200 with torch 2.11)
PROVIDERS = (("flex", "flex-compiled", None), ("op", "workbook-compiled", None),
             ("op-kernel-descriptors", "workbook-compiled", False))
WARMUP, STEPS, TOP = 3, 10, 12
#: Each group: (what its file's path ends with, the function's name), summed by cumulative time.
GROUPS = {"Triton launcher": [("triton/backends/nvidia/driver.py", "__call__")],
          "descriptors": [("triton/tools/tensor_descriptor.py", "from_tensor")],
          "Inductor launcher": [("torch/_inductor/runtime/static_triton_launcher.py", "run")]}


def grouped(stats: dict, steps: int) -> dict[str, float]:
    """Per group of ``GROUPS``, the cumulative milliseconds a step of the functions it names, from a
    ``pstats.Stats(...).stats`` dict ({(file, line, function): (calls, primitive calls, own s,
    cumulative s, callers)})."""
    out = {}
    for name, where in GROUPS.items():
        seconds = sum(ct for (path, _, func), (_, _, _, ct, _) in stats.items()
                      if any(path.replace(os.sep, "/").endswith(end) and func == f for end, f in where))
        out[name] = round(seconds * 1e3 / steps, 3)
    return out


def top(stats: dict, steps: int, n: int = TOP) -> list[list]:
    """The ``n`` functions with the most time of their own: [file's last two parts:function, ms a
    step, calls a step]."""
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:n]
    return [[f"{'/'.join(path.replace(os.sep, '/').split('/')[-2:])}:{func}", round(tt * 1e3 / steps, 3),
             round(nc / steps, 1)] for (path, _, func), (_, nc, tt, _, _) in rows]


def _host_ms(step_model, opt, timed, profile: cProfile.Profile | None = None) -> list[float]:
    """The host's milliseconds for each step's forward plus backward, each step issued behind a spin
    of the GPU, under ``profile`` where one is given; the optimizer's step follows, unmeasured."""
    host = []
    for tokens, targets in timed:
        torch.cuda.synchronize()
        torch.cuda._sleep(bench_train.SPIN_CYCLES)
        began = time.perf_counter()
        if profile is not None:
            profile.enable()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_model(tokens, targets)
        loss.backward()
        if profile is not None:
            profile.disable()
        host.append((time.perf_counter() - began) * 1e3)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return host


def run(size: bench_train.Size, name: str, provider: str, graph_descriptors: bool | None) -> dict:
    """One row: the host's forward plus backward of ``provider``'s compiled step at ``size``."""
    from kernels.loader import ROOT, load_package
    op = load_package(ROOT / "solutions" / "attention_op")
    op.launch._GRAPH_DESCRIPTORS = graph_descriptors          # None: as the op finds this torch
    try:
        step_model, opt, timed = bench_train.probe_model(size, provider, WARMUP, STEPS)
        host = _host_ms(step_model, opt, timed)
        profile = cProfile.Profile()
        profiled = _host_ms(step_model, opt, timed, profile)
        torch.cuda.synchronize()
    finally:
        op.launch._GRAPH_DESCRIPTORS = None
    stats = pstats.Stats(profile).stats
    return dict(size=size.name, provider=name, host_ms=round(statistics.median(host), 3),
                profiled_ms=round(statistics.median(profiled), 3),
                calls=round(sum(nc for _, nc, _, _, _ in stats.values()) / len(timed)),
                groups=grouped(stats, len(timed)), top=top(stats, len(timed)))


def summary(rows: list[dict]) -> list[str]:
    """The table the probe prints last: each row's host time a step, profiled and not, its Python
    calls, and the profiled time of each group."""
    lines = ["| size | provider | host ms a step | profiled ms | Python calls a step | "
             + " | ".join(f"{g} ms" for g in GROUPS) + " |",
             "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in GROUPS) + " |"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['provider']} | {r['host_ms']:.2f} | {r['profiled_ms']:.2f} | {r['calls']} | "
                     + " | ".join(f"{r['groups'][g]:.2f}" for g in GROUPS) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    start = bench_train.probe_start(argv, __doc__.split("\n\n")[0],
                                    "python grader/bench/probes/step_host_profile.py", "step-host-profile.json")
    if start is None:
        return 2
    sizes, json_path, doc = start
    bench_train.compile_caches_off()          # the op's two forms differ inside it, where the caches' keys do not look
    for size in sizes:
        for name, provider, graph_descriptors in PROVIDERS:
            row = bench_train.probe_record(doc, json_path, run(bench_train.SIZES[size], name, provider,
                                                                graph_descriptors))
            print(summary([row])[-1], flush=True)
    print("\n".join(summary(doc["rows"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
