"""Grade one stage: run its checks against a copy of the stage file, collect verdicts.

Statuses, as the table shows them:

    pass       the check ran and the code is right
    FAIL       the code gave a wrong answer (the message says where and usually why)
    todo       the code raised NotImplementedError: that part is not written yet
    crash      the worker died (segfault, abort, CUDA error) or the stage file failed to import
    timeout    a call ran past the check's time limit
    not run    the check needs a CUDA GPU and there is none here
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grader import release
from grader.check import CheckFailed, Ctx, session_seed
from grader.stages import Stage
from grader.worker import ImportFailed, LearnerError, Runner, WorkerDied
from kernels import loader, runtime

PASSING = ("pass",)


@dataclass
class CheckResult:
    name: str
    points: int
    earned: int
    status: str
    message: str = ""
    seconds: float = 0.0


@dataclass
class StageResult:
    stage: str
    source: str
    status: str                 # "graded", "not started", "import error"
    results: list[CheckResult] = field(default_factory=list)
    seed: int = 0
    device: str = ""
    seconds: float = 0.0

    @property
    def score(self) -> int:
        return sum(r.earned for r in self.results)

    @property
    def max_score(self) -> int:
        return sum(r.points for r in self.results)

    @property
    def ok(self) -> bool:
        """Everything that ran passed (checks not run here do not count either way)."""
        return self.status == "graded" and all(r.status in PASSING + ("not run",) for r in self.results)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(score=self.score, max_score=self.max_score)
        return d


def _snapshot(stage: Stage, source: str) -> Path:
    """Copy the stage's files to a private folder, so grading never touches (or is touched by) them."""
    src = loader.source_dir(source)
    tmp = Path(tempfile.mkdtemp(prefix=f"workbook-{stage.name}-"))
    for name in stage.files():
        if (src / name).exists():
            shutil.copy2(src / name, tmp / name)
    return tmp


def run_check(check, runner: Runner, seed: int) -> CheckResult:
    """One check, one verdict: exceptions from the learner's side become statuses, never escape."""
    if check.gpu and not runtime.ON_GPU:
        return CheckResult(check.name, check.points, 0, "not run", "needs a CUDA GPU; none is visible here")
    start = time.monotonic()
    ctx = Ctx(runner, seed, timeout=float(os.environ.get("WORKBOOK_CHECK_TIMEOUT", check.timeout)))
    status, message = "pass", ""
    try:
        check.fn(ctx)
    except CheckFailed as exc:
        status, message = "FAIL", str(exc)
    except ImportFailed:
        raise                      # the stage file itself is broken: grade_stage reports it once
    except LearnerError as exc:
        if exc.type_name == "NotImplementedError":
            status, message = "todo", exc.message
        else:
            status = "FAIL"
            where = _last_frame(exc.tb)
            message = f"raised {exc.type_name}: {exc.message}" + (f" ({where})" if where else "")
    except WorkerDied as exc:
        status, message = ("timeout" if exc.timed_out else "crash"), exc.reason
        tail = runner.output_tail(400).strip()
        if tail:
            message += f"; last output: {tail[-400:]}"
    if status not in PASSING and check.hint:
        message += f"\n  hint: {check.hint}"
    earned = check.points if status in PASSING else 0
    return CheckResult(check.name, check.points, earned, status, message, time.monotonic() - start)


def _last_frame(tb: str) -> str:
    lines = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith("File ")]
    return lines[-1] if lines else ""


def grade_stage(stage: Stage, source: str = "stages", *, only: list[str] | None = None,
                on_result=None) -> StageResult:
    """Grade ``stage`` from ``source`` ('stages', 'solutions' or a folder)."""
    started = time.monotonic()
    seed = session_seed()
    checks = [c for c in stage.checks() if only is None or c.name in only]
    folder = loader.source_dir(source)
    path = folder / f"{stage.module}.py"
    result = StageResult(stage.name, str(source), "graded", seed=seed, device=runtime.describe())
    if not path.exists():
        result.status = "not started"
        result.results = [CheckResult(c.name, c.points, 0, "todo", f"{path} does not exist") for c in checks]
        return result
    if str(source) != "solutions" and release.is_untouched(path):
        result.status = "not started"
        result.results = [CheckResult(c.name, c.points, 0, "todo", "not started") for c in checks]
        return result

    snapshot = _snapshot(stage, source)
    try:
        with Runner(stage.module, str(snapshot)) as runner:
            for check in checks:
                try:
                    r = run_check(check, runner, seed)
                except ImportFailed as exc:
                    result.status = "import error"
                    msg = f"{path.name} could not be imported: {exc.type_name}: {exc.message}"
                    where = _last_frame(exc.tb)
                    msg += f" ({where})" if where else ""
                    result.results = [CheckResult(c.name, c.points, 0, "crash", msg) for c in checks]
                    break
                result.results.append(r)
                if on_result:
                    on_result(r)
    finally:
        shutil.rmtree(snapshot, ignore_errors=True)
    for r in result.results:           # name the learner's file, not the private copy, in messages
        r.message = r.message.replace(str(snapshot), str(folder))
    result.seconds = time.monotonic() - started
    return result


# -- presentation -------------------------------------------------------------------------
_MARK = {"pass": "pass", "FAIL": "FAIL", "todo": "todo", "crash": "crash", "timeout": "timeout",
         "not run": "not run"}


def format_result(stage: Stage, result: StageResult, *, width: int = 100) -> str:
    lines = [f"{stage.name}: {stage.title}  [{result.source}]"]
    if result.status == "not started":
        lines.append(f"  not started: stages/{stage.module}.py is as released. Open notebooks/{stage.notebook}, "
                     f"fill in its TODOs, then run: python -m grader {stage.name}")
        return "\n".join(lines)
    name_w = max([len(r.name) for r in result.results] + [5])
    lines.append(f"  {'check':<{name_w}}  points  status   message")
    for r in result.results:
        pts = f"{r.earned}/{r.points}"
        first, *rest = (r.message or "").split("\n") or [""]
        body = textwrap.wrap(first, width=max(30, width - name_w - 22)) or [""]
        lines.append(f"  {r.name:<{name_w}}  {pts:>6}  {_MARK[r.status]:<7}  {body[0]}")
        pad = " " * (name_w + 20)
        lines += [f"  {pad}{b}" for b in body[1:]]
        lines += [f"  {pad}{x.strip()}" for x in rest]
    not_run = sum(r.status == "not run" for r in result.results)
    summary = f"  score {result.score}/{result.max_score}"
    if not_run:
        summary += f"; {not_run} GPU-only check(s) not run here (they need a CUDA GPU)"
    summary += f"; {result.seconds:.1f} s; inputs seed {result.seed} (WORKBOOK_SEED={result.seed} repeats them)"
    lines.append(summary)
    return "\n".join(lines)


def print_result(stage: Stage, result: StageResult) -> None:
    print(format_result(stage, result))
    sys.stdout.flush()
