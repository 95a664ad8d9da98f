"""python -m grader sweep stage3 --seeds 200: how close the reference comes to failing each check.

Inputs are fresh every run, so a tolerance that the reference meets on one seed may fail it on
another, and a correct learner would then see FAIL.  The sweep grades the reference solution
on many seeds and reports, for every check, its worst *margin*: the largest error / allowed of
all the comparisons the check made (1.0 is the edge of failing).  The reference is trusted
code, so it runs here, in this process, with no worker to start per seed; checks and
tolerances are exactly the grader's.

    python -m grader sweep stage3 --seeds 200               seeds 0..199
    python -m grader sweep stage1,stage2 --seeds 1000 --first-seed 5000
    python -m grader sweep stage3 --seed 1835936174 --only head_dims_padded
    python -m grader sweep stage5 --seeds 1000 --jobs 16    seeds dealt out to 16 processes
    python -m grader.testing.sweep --merge all.json a.json b.json    several sweeps' JSON as one, and its table
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, fields

from kernels import loader, runtime

import torch

from grader import stages
from grader.check import CheckFailed, CheckSkipped, Ctx
from grader.isolation.child import to_cpu, to_device
from grader.isolation.outcomes import LearnerError
from grader.isolation.sandbox import NO_AUTOTUNE


def without_overflow_checks() -> bool:
    """Stop the Triton interpreter checking every integer add and multiply for int32 overflow.

    The interpreter does so unless told otherwise (on a GPU Triton checks only in debug mode),
    by redoing the operation in int64 and asserting on the result: almost half of a sweep's time.
    The checks change no value a kernel computes, only whether it stops, and the reference, the
    one kernel a sweep runs, overflows nowhere at the grader's shapes; a learner's kernel is still
    graded with them.  Returns whether they are off (False on a GPU or with an interpreter laid
    out otherwise).
    """
    if not runtime.INTERPRET or "triton" not in sys.modules:
        return False
    import dataclasses
    try:
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):
        return False
    return True


class InProcess:
    """The reference solution behind the worker's ``call`` interface, run in this process."""

    def __init__(self, stage):
        self.stage, self.source = stage.module, "solutions"
        self._module = loader.load_stage(stage.module, "solutions")
        without_overflow_checks()
        os.environ.update(NO_AUTOTUNE)      # a worker's setting: the tiles a grading uses, never autotuned

    def call(self, fn_name, *args, timeout=None, **kwargs):
        fn = getattr(self._module, fn_name)
        helper = kwargs.pop("_harness", None)        # a grader call around fn, as the worker makes it
        if helper is not None:
            from grader.isolation import harness
            fn = harness.bind(fn, helper)
        args, kwargs = to_device(args, runtime.DEVICE), to_device(kwargs, runtime.DEVICE)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # the checks expect errors as the worker reports them
            raise LearnerError(type(exc).__name__, str(exc), traceback.format_exc(limit=-4)) from None
        if runtime.ON_GPU:
            import torch
            torch.cuda.synchronize()
        return to_cpu(result)

    def output_tail(self, limit: int = 0) -> str:
        return ""


@dataclass
class Margin:
    check: str
    runs: int = 0
    failures: list[int] = field(default_factory=list)     # seeds where the reference failed
    first_failure: str = ""                                # the first failure's message
    worst: float = 0.0                                     # largest error / allowed over every seed
    worst_seed: int | None = None
    worst_what: str = ""                                   # the comparison that made it
    margins: list[float] = field(default_factory=list)     # each seed's worst, for the median
    seeds: list[int] = field(default_factory=list)         # the seeds it ran on
    draws_inputs: bool = True                              # False: it drew no random number, so every
                                                           # seed gives the same run, and it ran once
    seconds: list[float] = field(default_factory=list)     # each run's wall time, in seed order

    def add(self, seed: int, margins: list[tuple[str, float]], failed: str = "") -> None:
        self.runs += 1
        self.seeds.append(seed)
        if failed:
            self.failures.append(seed)
            self.first_failure = self.first_failure or failed
        if not margins:
            return
        what, value = max(margins, key=lambda m: m[1])
        self.margins.append(value)
        if value > self.worst or self.worst_seed is None:
            self.worst, self.worst_seed, self.worst_what = value, seed, what

    def absorb(self, m: "Margin") -> None:
        """Add another sweep's runs of the same check (other seeds) to this one."""
        self.runs += m.runs
        self.failures += m.failures
        self.first_failure = self.first_failure or m.first_failure
        self.draws_inputs = self.draws_inputs and m.draws_inputs
        self.margins += m.margins
        self.seeds += m.seeds
        self.seconds += m.seconds
        if m.worst_seed is not None and (self.worst_seed is None or m.worst > self.worst):
            self.worst, self.worst_seed, self.worst_what = m.worst, m.worst_seed, m.worst_what

    @property
    def median(self) -> float:
        return _median(self.margins)

    @property
    def times(self) -> tuple[float, float]:
        """Seconds of its first run (which compiles what it launches) and the median of the others."""
        return (self.seconds[0] if self.seconds else math.nan), _median(self.seconds[1:])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else math.nan


def sweep(stage, seeds, *, only=None, progress=None, deadline: float | None = None) -> dict[str, Margin]:
    """Grade ``stage``'s reference on every seed of ``seeds``; the margin of each check that runs here.
    No seed starts after ``deadline`` (a ``time.time()``)."""
    runner = InProcess(stage)
    checks = [c for c in stage.checks() if (only is None or c.name in only) and (runtime.ON_GPU or not c.gpu)]
    found = {c.name: Margin(c.name) for c in checks}
    try:
        _sweep_seeds(runner, checks, seeds, found, progress, deadline)
    except KeyboardInterrupt:        # Ctrl-C (or SIGTERM, see main): the margins of the seeds done so far
        pass
    return found


def _sweep_seeds(runner, checks, seeds, found, progress, deadline=None) -> None:
    for n, seed in enumerate(seeds):
        if deadline is not None and time.time() >= deadline:
            return
        for c in checks:
            if not found[c.name].draws_inputs:
                continue                    # the same inputs on every seed: its one run says it all
            ctx = Ctx(runner, seed, timeout=c.timeout)
            before = ctx.generator.get_state()
            failed = ""
            began = time.perf_counter()
            try:
                c.fn(ctx)
            except CheckSkipped:
                continue
            except (CheckFailed, LearnerError) as exc:
                failed = f"seed {seed}: {exc}"[:600]
            # A check's only source of randomness is the seed's generator (the checks use no other),
            # so one that left it untouched (plans, nvcc, argument errors) is the same on every seed.
            found[c.name].draws_inputs = not torch.equal(before, ctx.generator.get_state())
            found[c.name].seconds.append(time.perf_counter() - began)
            found[c.name].add(seed, ctx.margins, failed)
        if progress:
            progress(n + 1, seed)


def _sweep_part(stage_name: str, seeds: list[int], only, deadline, threads: int) -> dict[str, Margin]:
    # The references are small float64 problems on the CPU: a process per job, each with all the
    # cores' threads, would spend most of its time waiting for the others'.
    torch.set_num_threads(threads)
    return sweep(stages.find(stage_name), seeds, only=only, deadline=deadline)


def sweep_parallel(stage, seeds, *, jobs: int, only=None, progress=None, deadline=None) -> dict[str, Margin]:
    """``sweep`` with the seeds dealt out to ``jobs`` processes (spawned: each imports torch afresh)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed
    seeds = list(seeds)
    parts = [seeds[i::jobs] for i in range(jobs) if seeds[i::jobs]]
    found: dict[str, Margin] = {}
    with ProcessPoolExecutor(len(parts), mp_context=mp.get_context("spawn")) as pool:
        asked = os.environ.get("OMP_NUM_THREADS", "").strip()       # the caller's choice, when it made one
        threads = int(asked) if asked.isdigit() and int(asked) > 0 else max(1, (os.cpu_count() or 1) // len(parts))
        futures = [pool.submit(_sweep_part, stage.name, part, only, deadline, threads) for part in parts]
        done = 0
        for future in as_completed(futures):
            for name, m in future.result().items():
                found.setdefault(name, Margin(name)).absorb(m)
            done += 1
            if progress:
                progress(sum(len(p) for p in parts[:done]), "")
    order = [c.name for c in stage.checks()]
    return {name: found[name] for name in order if name in found}


def format_table(stage, found: dict[str, Margin], seconds: float) -> str:
    seeds = max((m.runs for m in found.values()), default=0)   # fewer than asked when stopped early
    width = max([len(name) for name in found] + [5])
    lines = [f"{stage.name}: the reference on {seeds} seed(s), {runtime.describe()}, {seconds:.0f} s",
             f"  {'check':<{width}}  worst margin  median   seed of worst  failed  first s  then s  "
             "(margin = error / allowed)"]
    for m in found.values():
        first, then = m.times
        times = f"{first:>7.1f}  {then:>6.2f}".replace("nan", "  -")
        if not m.margins:
            what = "exact checks" if m.draws_inputs else "fixed inputs, the same on every seed: run once"
            lines.append(f"  {m.check:<{width}}  {'-':>12}  {'-':>6}   {'':>13}  {len(m.failures):>6}  {times}  "
                         f"(no tolerance comparison: {what})")
            continue
        lines.append(f"  {m.check:<{width}}  {m.worst:>12.3f}  {m.median:>6.3f}   {m.worst_seed:>13}  "
                     f"{len(m.failures):>6}  {times}  {m.worst_what[:70]}")
    failing = {name: m.failures[:5] for name, m in found.items() if m.failures}
    if failing:
        lines.append("  FAILED on: " + "; ".join(f"{n} seeds {s}" for n, s in failing.items()))
        lines += [f"  {name}, {m.first_failure}" for name, m in found.items() if m.failures]
    return "\n".join(lines)


def main(stage_names: str, *, seeds: int = 20, first_seed: int = 0, exact_seeds: list[int] | None = None,
         only: list[str] | None = None, json_path: str | None = None, jobs: int = 1,
         time_limit: int | None = None) -> int:
    """``python -m grader sweep STAGES``: grade the reference of ``stage_names`` (``stage3`` or
    ``stage1,stage2``) on ``seeds`` seeds from ``first_seed`` (or exactly ``exact_seeds``), ``only`` these
    checks, in ``jobs`` processes, starting no seed of a stage after ``time_limit`` seconds on it; print each
    check's worst margin, and write them all to ``json_path``."""
    import signal
    signal.signal(signal.SIGTERM, signal.default_int_handler)   # stopped (a time limit): report what was done
    if not (loader.ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/: there is no reference to sweep", file=sys.stderr)
        return 2
    try:
        chosen = [stages.find(name) for name in stage_names.split(",")]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    seeds = exact_seeds or list(range(first_seed, first_seed + seeds))
    ok, record, done = True, {}, {}
    for stage in chosen:
        names = {c.name for c in stage.checks()}
        unknown = [n for n in only or [] if n not in names]
        if unknown:
            print(f"no check named {', '.join(map(repr, unknown))} in {stage.name}; the checks are: "
                  f"{', '.join(sorted(names))}", file=sys.stderr)
            return 2
        start = time.monotonic()

        def progress(done, seed, stage=stage):
            print(f"\r{stage.name}: seed {done}/{len(seeds)} ({seed}), {time.monotonic() - start:.0f} s",
                  end="", file=sys.stderr, flush=True)

        deadline = time.time() + time_limit if time_limit else None
        if jobs > 1:
            found = sweep_parallel(stage, seeds, jobs=jobs, only=only, progress=progress, deadline=deadline)
        else:
            found = sweep(stage, seeds, only=only, progress=progress, deadline=deadline)
        print(file=sys.stderr)
        print(format_table(stage, found, time.monotonic() - start))
        ok = ok and not any(m.failures for m in found.values())
        record[stage.name] = {n: {k: v for k, v in asdict(m).items() if k not in ("margins", "seeds", "seconds")}
                              | {"median": m.median, "first_seconds": m.times[0], "then_seconds": m.times[1]}
                              for n, m in found.items()}
        drawn = [set(m.seeds) for m in found.values() if m.draws_inputs and m.runs]    # every such check ran them
        done[stage.name] = sorted(set.intersection(*drawn) if drawn else {s for m in found.values() for s in m.seeds})
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": runtime.describe(), "seeds": [seeds[0], seeds[-1], len(seeds)],
                       "seeds_done": done, "stages": record},
                      f, indent=1)
    return 0 if ok else 1


# -- several sweeps' JSON as one record, and the table docs/verdicts.md shows --------------------
def merge(records: list[dict]) -> dict:
    """One record from the JSON of several sweeps (``--json``) on the same device: per stage, the seeds
    every sweep did and per check its runs, failures and worst margin over all of them."""
    devices = {r["device"] for r in records}
    if len(devices) != 1:
        raise ValueError(f"records must come from one device; got {sorted(devices)}")
    done: dict[str, set[int]] = {}
    found: dict[str, dict[str, Margin]] = {}
    kept = {f.name for f in fields(Margin)} - {"margins", "seeds", "seconds"}     # what --json writes of one
    for record in records:
        for stage, seeds in record["seeds_done"].items():
            overlap = done.setdefault(stage, set()) & set(seeds)
            if overlap:
                raise ValueError(f"{stage}: seeds {sorted(overlap)[:5]} are in two records; merge each seed once")
            done[stage] |= set(seeds)
        for stage, checks in record["stages"].items():
            into = found.setdefault(stage, {})
            for name, m in checks.items():
                into.setdefault(name, Margin(name)).absorb(Margin(**{k: v for k, v in m.items() if k in kept}))
    stages_ = {stage: {name: {k: v for k, v in asdict(m).items() if k in kept} for name, m in checks.items()}
               for stage, checks in found.items()}
    return {"device": devices.pop(), "seeds_done": {s: sorted(v) for s, v in done.items()}, "stages": stages_}


def _ranges(seeds: list[int]) -> str:
    parts, start = [], None
    for i, s in enumerate(seeds):
        start = s if start is None else start
        if i + 1 == len(seeds) or seeds[i + 1] != s + 1:
            parts.append(f"{start}-{s}" if s != start else f"{s}")
            start = None
    return ", ".join(parts)


def markdown(record: dict) -> str:
    """A stage-per-row table of a (merged) record: seeds, the worst margin with its check and seed (of
    all checks, and of the GPU-only ones where they ran), failures."""
    gpu = record["device"].startswith("GPU")
    lines = [f"Device: {record['device']}", "",
             "| stage | seeds | worst margin (check, seed) | worst of the GPU-only checks | failures |"
             if gpu else "| stage | seeds | worst margin (check, seed) | failures |",
             "| --- | --- | --- | --- | --- |" if gpu else "| --- | --- | --- | --- |"]

    def worst(ms):
        judged = [m for m in ms if m["worst_seed"] is not None]
        if not judged:
            return "-"
        m = max(judged, key=lambda m: m["worst"])
        return f"{m['worst']:.2f} ({m['check']}, {m['worst_seed']})"

    for stage in sorted(record["stages"], key=lambda s: int(s.removeprefix("stage"))):
        checks = record["stages"][stage]
        seeds = record["seeds_done"].get(stage, [])
        failures = sum(len(m["failures"]) for m in checks.values())
        row = [stage.removeprefix("stage"), f"{len(seeds)} ({_ranges(seeds)})", worst(checks.values())]
        if gpu:
            only_gpu = {c.name for c in stages.find(stage).checks() if c.gpu}
            row.append(worst([m for name, m in checks.items() if name in only_gpu]))
        lines.append("| " + " | ".join(row + [str(failures)]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    # python -m grader.testing.sweep --merge OUT.json IN.json ...: merge sweeps' JSON, print the table
    if len(sys.argv) < 4 or sys.argv[1] != "--merge":
        sys.exit("usage: python -m grader.testing.sweep --merge OUT.json IN.json [IN.json ...]")
    merged = merge([json.loads(open(p).read()) for p in sys.argv[3:]])
    with open(sys.argv[2], "w") as f:
        json.dump(merged, f, indent=1)
    print(markdown(merged))
