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
                    a producer warpgroup, the Hopper variant beside the mma.sync kernel (stage 4;
                    stages 5-8: it takes their masks too)
    op              solutions/attention_op's attention(): the op a model calls, with the kernels
                    it picks (the TMA kernels where the GPU has TMA), its plans and its autograd
                    (stage 9)

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
peak less what was allocated before (the case's inputs), in MiB; ``input_mib`` is the inputs' size.
The table prints it beside the size of the inputs (q, k, v and, for backward cases, dO):
FlashAttention's working memory grows like its inputs, linearly in N, where materialising the
N x N scores would grow quadratically.
"""

from __future__ import annotations

import gc
import sys
import time
import warnings
from typing import Callable

from kernels import runtime  # before triton: decides TRITON_INTERPRET

import torch

from grader.bench import chart
from grader.bench.cases import CASES, DEFAULT_PROVIDERS, PROVIDER_NAMES, PROVIDERS, Case, Inputs, make_inputs
from grader.bench.providers import NotApplicable, Provider, provider
from grader.bench.tables import format_row, table, write_json
from grader.bench.verify import references, verify

WARMUP_MS = 25
REP_MS = 100
MIB = 2 ** 20


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
        problem = verify(outputs, refs, case)
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
    except Exception as exc:  # one provider failing must not stop the run
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
        refs = references(case, x)
    except Exception as exc:  # e.g. out of memory: report the case, go on
        x = refs = None
        for row in rows:
            row["note"] = f"failed: reference: {type(exc).__name__}: {str(exc).strip()[:200]}"
            log(format_row(row), flush=True)
        _free(device, collect=True)
        return rows
    for row, prov in zip(rows, providers.values()):
        row["ms"], row["note"], row["peak_mib"] = _measure(prov, case, x, refs, timer, memory)
        if row["ms"] is not None:
            row["tflops"] = case.flops / row["ms"] * 1e-9
        _free(device)
        log(format_row(row), flush=True)
    del x, refs
    _free(device, collect=True)
    return rows


def run(stage: str, *, source: str = "solutions", providers: list | None = None, cases: list[Case] | None = None,
        warmup: int = WARMUP_MS, rep: int = REP_MS, log=print, device="cuda", timer: Callable | None = None,
        memory: Callable | None = None, each_case: Callable | None = None) -> list[dict]:
    """Time every provider on every case of ``stage``; rows {stage, case, provider, ms, tflops, peak_mib,
    input_mib, note}.  ``each_case(rows)``, where given, is called with a case's rows once it is timed.

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
        except Exception as exc:  # a provider that cannot load is reported on every row
            made[p] = exc
    rows = []
    for seed, case in enumerate(cases):
        rows += bench_case(stage, case, made, timer=timer, device=device, seed=seed, log=log, memory=memory)
        if each_case is not None:
            each_case(rows[-len(made):])
    return rows


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


def main(stage_names: str, *, learner: bool = False, providers: str | None = None,
         json_path: str | None = None, plot_path: str | None = None, rep: int | None = None) -> int:
    """``python -m grader bench STAGES``: check and time ``stage_names`` (``stage5``, ``stage5,stage7`` or
    ``all``) on a GPU, the solutions or the ``learner``'s files, with these ``providers`` (``a,b``), and
    print the table; ``json_path`` and ``plot_path`` are where to write the rows and the chart; ``rep`` the
    milliseconds of timed runs per measurement (default ``REP_MS``)."""
    rep = rep or REP_MS
    try:
        stages = _stages(stage_names)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    chosen = [p.strip() for p in providers.split(",") if p.strip()] if providers else None
    unknown = [p for p in chosen or [] if p not in PROVIDER_NAMES]
    if chosen is not None and (unknown or not chosen):
        print(f"argument --providers: unknown provider {', '.join(map(repr, unknown)) or '(none given)'}; "
              f"the providers are: {', '.join(PROVIDER_NAMES)}", file=sys.stderr)
        return 2
    if not runtime.ON_GPU:
        print(f"python -m grader bench times kernels on a CUDA GPU, and none is visible here "
              f"({runtime.describe()}); run it on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 2
    from kernels.loader import ROOT
    source = "stages" if learner else "solutions"
    if source == "solutions" and not (ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/: timing your stages/ files (--learner)")
        source = "stages"
    print(f"benchmarking {', '.join(stages)} ({source}/) on {runtime.describe()}; bfloat16, do_bench median of "
          f"{rep} ms after {WARMUP_MS} ms of warm-up", flush=True)
    rows, start = [], time.perf_counter()

    def keep(case_rows):                    # the JSON holds every case timed so far: a run cut short keeps them
        rows.extend(case_rows)
        if json_path:
            write_json(rows, json_path)
    for stage in stages:
        began = time.perf_counter()
        print(f"{stage}:", flush=True)
        run(stage, source=source, providers=chosen, rep=rep, each_case=keep)
        print(f"  ({time.perf_counter() - began:.0f} s)", flush=True)
    print()
    print(table(rows))
    print(f"\n{len(rows)} rows in {time.perf_counter() - start:.0f} s")
    if json_path:                           # written after each case (keep); the last write holds every row
        print(f"wrote {json_path}")
    if plot_path:
        chart.plot(rows, plot_path, title=f"{runtime.describe()}, bfloat16 ({source}/)")
        print(f"wrote {plot_path}")
    return 0

