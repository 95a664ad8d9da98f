"""Grade one stage: run its checks against a copy of the stage file, collect verdicts.

Statuses, as the table shows them:

    pass       the check ran and the code is right
    FAIL       the code gave a wrong answer (its most likely cause first, grader/diagnose/, then
               where), or raised an error (at the learner-file line it came from)
    todo       the code the check ran still has a TODO hole as released (grader/holes.py), wherever
               it is, or raised NotImplementedError: that part is not written yet
    crash      the worker died (segfault, abort, CUDA error, over its memory or output limit)
               or the stage file failed to import
    timeout    a call ran past the check's time limit, or the stage's time ran out before the check
    not run    the check needs a CUDA GPU and there is none here, or a tool it needs (nvcc) is missing

Hidden checks (grader/checks/hidden/) count in the score like any other; what a learner sees of
them is one line, "k hidden checks: x/y points", with neither names nor messages.

Max scores follow one rule wherever they are shown (this table, ``--format json``, Gradescope's
results.json, a batch's gradebook): a check that cannot run on this machine (``not run``) carries
no points here, for every learner, one who has not started included.  So on a CPU a stage's
max_score is the points of its CPU checks; the GPU-only points count on a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

from kernels import loader, runtime, solution_file

from grader import holes, locate, stages
from grader.check import CheckFailed, CheckSkipped, Ctx, session_seed
from grader.isolation import caches, choice, files
from grader.isolation.answer_keys import AnswerKeys
from grader.isolation.limits import Limits
from grader.isolation.mechanism import IsolationError
from grader.isolation.outcomes import ImportFailed, LearnerError, Misbehaved, WorkerDied
from grader.isolation.private import private_dir
from grader.isolation.runner import Runner
from grader.results import PASSING, CheckResult, StageResult
from grader.stages import Stage


def submission_folder(path: str | Path, stage: Stage) -> Path:
    """Where a submission keeps ``stage``'s files: the folder itself, or its ``stages/`` (a whole
    repository), or either of those in the one folder it holds (a zip of a project folder, as an
    upload unpacks).  A link is never followed: a linked folder is reported when its files are read."""
    path = Path(path)
    inner = []
    if files.plain_folder(path) and not os.path.lexists(path / f"{stage.module}.py"):
        try:
            inner = [p for p in path.iterdir() if not p.name.startswith((".", "__MACOSX")) and files.plain_folder(p)]
        except OSError:
            inner = []
    one_down = [inner[0], inner[0] / "stages"] if len(inner) == 1 else []
    for folder in (path, path / "stages", *one_down):
        if os.path.islink(folder):
            return folder   # refused, with the reason, when it is read
        if files.plain_folder(folder) and os.path.lexists(folder / f"{stage.module}.py"):
            return folder
    return path


def snapshot_stage(stage: Stage, source: str) -> Path:
    """Copy the stage's files to a private folder, so grading never touches (or is touched by) them.

    Only plain files are copied, never through a link (files.read_plain); the copy lives in the
    grader's own folder under a name no other worker can list (private_dir), readable by
    the grader alone (a folder of mode 0700, files of 0600): a worker under a uid of its own is
    given a copy only that uid may read (sandbox.Sandbox).  A file that takes given code from an
    earlier stage is copied expanded (kernels/solution_file.py): the worker sees nothing but this folder.
    """
    src = loader.source_dir(source)
    if os.path.islink(src) or (str(source) not in ("stages", "solutions") and os.path.islink(Path(source))):
        raise files.UnsafeFile(f"{source} is a symbolic link: the grader reads only plain files and folders")
    if str(source) == "stages" and os.path.islink(loader.ROOT / "stages"):
        raise files.UnsafeFile("stages/ is a symbolic link: the grader reads only plain files and folders")
    tmp = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-{stage.name}-", dir=private_dir()))
    try:
        os.chmod(tmp, 0o700)
        for name in stage.files():
            data = files.read_plain(src / name)
            text = data.decode(errors="replace") if data is not None and name.endswith(".py") else ""
            if solution_file.has_given_code(text):
                data = solution_file.expand(data.decode(), name, lambda m: _plain_text(src / f"{m}.py")).encode()
            if data is not None:
                fd = os.open(tmp / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with open(fd, "wb") as f:
                    f.write(data)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _plain_text(path: Path) -> str | None:
    data = files.read_plain(path)
    return data.decode() if data is not None else None


def run_check(check, runner: Runner, seed: int, *, deadline: float | None = None,
              limits: Limits | None = None) -> CheckResult:
    """One check, one verdict: exceptions from the learner's side become statuses, never escape.

    ``deadline`` (a time.monotonic() value) is the stage's; ``limits.check_timeout``, when set,
    replaces the check's own per-call ``timeout`` and bounds the whole check; otherwise
    ``limits.call_timeout``, when set (the stage's share, Limits.for_stage), bounds each call.
    """
    if _not_here(check):
        return CheckResult(check.name, check.points, 0, "not run", _not_here(check), hidden=check.hidden)
    limits = limits or Limits.from_env()
    booted = 0.0
    if limits.check_timeout is not None and getattr(runner, "_proc", False) is None:
        # A worker (re)started for this check, after an earlier check's crash or hang, is not the check's time:
        # the whole-check limit starts once it is up, as a call's own limit does (the stage file is imported
        # within the time the check has).
        began = time.monotonic()
        left = min(limits.check_timeout, (deadline or float("inf")) - began)
        if left > 0:
            runner._start(left)
            booted = time.monotonic() - began
    start = time.monotonic()
    timeout = check.timeout if limits.call_timeout is None else min(check.timeout, limits.call_timeout)
    if limits.check_timeout is not None:
        timeout = limits.check_timeout
        deadline = min((deadline or float("inf")) + booted, start + limits.check_timeout)
    ctx = Ctx(runner, seed, timeout=timeout, deadline=deadline)
    status, message, hint, diagnosis, also = "pass", "", "", "", []
    runner.last_call = None
    try:
        check.fn(ctx)
    except CheckFailed as exc:
        status, message, diagnosis, also = "FAIL", str(exc), exc.diagnosis, list(exc.also)
        hint = _usual_cause(check.hint, message) if not diagnosis else ""
    except CheckSkipped as exc:
        status, message = "not run", str(exc)
    except Misbehaved as exc:
        status, message, hint = "FAIL", exc.message, ""  # the hint is about numbers; this says it all
    except ImportFailed:
        raise                      # the stage file itself is broken: grade_stage reports it once
    except LearnerError as exc:
        if exc.type_name == "NotImplementedError":
            status, message = "todo", exc.message
        else:
            status, hint = "FAIL", ""     # the hint is about wrong numbers; the error says what happened
            message = _error_message(exc, runner)
    except WorkerDied as exc:
        status, message = ("timeout" if exc.timed_out else "crash"), exc.reason
        tail = _crash_context(runner.output_tail(4000), runner.stage)
        if tail:
            message += f"; last output: {tail}"
    except Exception as exc:  # the check could not use what came back: this check fails, no other
        status, hint = "FAIL", ""
        if runner.last_call:
            fn_name, what = runner.last_call
            message = (f"{fn_name} returned {what}, which this check could not use ({type(exc).__name__}: {exc}): "
                       "see its docstring for what it must return")
        else:
            message = f"the check stopped with {type(exc).__name__}: {exc}"
    status, message, hint = _holes_verdict(check, runner, ctx.called, status, message, hint)
    if status not in PASSING + ("not run",) and hint:
        message += f"\n  {hint}"
    earned = check.points if status in PASSING else 0
    return CheckResult(check.name, check.points, earned, status, message, time.monotonic() - start,
                       hidden=check.hidden, diagnosis=diagnosis if status == "FAIL" else "",
                       also=also if status == "FAIL" else [], calls=sorted(ctx.called))


def _not_here(check) -> str:
    """Why ``check`` cannot run on this machine ("" when it can): it needs a CUDA GPU, or a newer one."""
    if check.gpu and not runtime.ON_GPU:
        return "needs a CUDA GPU; none is visible here"
    if check.gpu and check.sm and runtime.capability() < divmod(check.sm, 10):
        major, minor = runtime.capability()
        return f"needs an sm_{check.sm} or newer GPU; this one is sm_{major}{minor}"
    return ""


def verdicts(checks, status: str, message: str) -> list[CheckResult]:
    """One verdict for every check of a stage that did not run them (not started, refused, an import
    error): ``status`` and ``message``, except "not run" for a check that cannot run here at all, which
    carries no points here whatever the submission (the max-score rule above)."""
    return [CheckResult(c.name, c.points, 0, "not run", _not_here(c), hidden=c.hidden) if _not_here(c)
            else CheckResult(c.name, c.points, 0, status, message, hidden=c.hidden) for c in checks]


def _usual_cause(hint: str, message: str) -> str:
    """The check's fixed hint, shown only when no diagnosis fits, as what usually causes it, never as
    this failure's cause; a hint about NaN only when NaN occurred."""
    if not hint or ("NaN" in hint and "NaN" not in message):
        return ""
    return f"no known mistake matches these numbers exactly; this check usually fails because: {hint}"


def _holes_verdict(check, runner: Runner, called: set[str], status: str, message: str, hint: str):
    """``todo`` for a check whose code still has a hole as released, wherever the hole is.

    A failure of any kind (a wrong answer from a kernel whose body is still ``pass``, the stub's
    NotImplementedError, a crash) is reported as the unfilled TODO it ran into, at the line it is
    on now.  A validation (or ``given``) check passes on the given code alone, so it earns nothing until the
    functions it calls are written.
    """
    if status == "not run" or not called:
        return status, message, hint
    try:
        stage = stages.find(runner.stage)
        found = holes.find(loader.source_dir(runner.source), stage).reached_by(called)
    except (OSError, ValueError, UnicodeDecodeError):
        return status, message, hint
    if not found:
        return status, message, hint
    if status != "pass":
        return "todo", holes.todo_message(found), ""
    if check.validation:
        fns = ", ".join(sorted(called))
        return "todo", (f"{holes.todo_message(found)}; this check of bad input counts once {fns} is written "
                        "(the given code refuses most bad input already)"), ""
    if check.given:
        return "todo", (f"{holes.todo_message(found)}; this check counts once that is written (the given code "
                        "alone passes it)"), ""
    return status, message, hint


def _error_message(exc: LearnerError, runner: Runner) -> str:
    """What learner code raised, and where in the learner's file: a kernel's own line, not its launch."""
    try:
        text = (loader.source_dir(runner.source) / f"{runner.stage}.py").read_text()
    except (OSError, ValueError, UnicodeDecodeError):
        text = ""
    compiled = locate.compile_error(exc.message, text, f"{runner.stage}.py") if text else None
    if compiled:
        return compiled
    where = locate.frame(exc.tb, runner.stage)
    return f"raised {exc.type_name}: {exc.message}" + (f" ({where})" if where else "")


def _crash_context(output: str, module: str) -> str:
    """The end of what the worker printed; after a crash, faulthandler's error and the stage-code line."""
    start = output.rfind("Fatal Python error")
    if start < 0:
        return output.strip()[-200:]
    report = output[start:].splitlines()
    frames = [ln.strip() for ln in report if ln.strip().startswith("File ") and f"{module}.py" in ln]
    return report[0].strip() + (f"; in {frames[0]}" if frames else "")


def default_jobs() -> int:
    """How many workers grade one stage at once: $WORKBOOK_JOBS, else one per two cores, at most 4.

    On a GPU most of a cold grading is Triton compiling each check's kernels on the CPU, one check
    after another; in the interpreter it is the kernels themselves.  Both spread over cores.  A
    2-core machine keeps one worker: the grader's own process needs the other core for its
    references and comparisons."""
    env = os.environ.get("WORKBOOK_JOBS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"WORKBOOK_JOBS must be a whole number of workers, 1 or more; got {env!r}")
        return int(env)
    return max(1, min(4, (os.cpu_count() or 1) // 2))


#: How long each check took when this machine last graded the learner's own files (or the reference):
#: the next grading starts the longest first, so that no long check starts last on its own worker.
DURATIONS = loader.ROOT / ".grader-cache" / "durations.json"


def _durations_key(stage: Stage) -> str:
    return f"{'gpu' if runtime.ON_GPU else 'cpu'}/{stage.name}"


def _longest_first(stage: Stage, checks) -> list[int]:
    """The order to start ``checks`` in: by the seconds each took last time, longest first; checks with
    no time yet (a first grading, a new check) keep their places ahead of the rest."""
    try:
        last = json.loads(DURATIONS.read_text()).get(_durations_key(stage), {})
    except (OSError, ValueError, AttributeError):
        last = {}
    if not isinstance(last, dict):
        last = {}

    def seconds(i):
        t = last.get(checks[i].name)
        return float("inf") if not isinstance(t, (int, float)) else float(t)
    return sorted(range(len(checks)), key=lambda i: -seconds(i))     # stable: ties keep the checks' order


def _remember_durations(stage: Stage, results, spent: dict[int, float]) -> None:
    """Keep each check's own seconds (``spent``, by index: without starting its worker, which
    whichever check comes first pays, and without Triton compiling kernels, which a cold cache
    pays once) for the next grading's order."""
    times = {r.name: round(spent[i], 2) for i, r in enumerate(results) if r.status != "not run" and i in spent}
    try:
        DURATIONS.parent.mkdir(parents=True, exist_ok=True)
        try:
            record = json.loads(DURATIONS.read_text())
        except (OSError, ValueError):
            record = {}
        record = record if isinstance(record, dict) else {}
        record[_durations_key(stage)] = times
        tmp = DURATIONS.with_name(f".durations.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
        os.replace(tmp, DURATIONS)
    except OSError:
        pass                          # a read-only checkout: the next grading keeps the checks' order


def grade_stage(stage: Stage, source: str = "stages", *, only: list[str] | None = None,
                on_result=None, limits: Limits | None = None, jobs: int | None = None) -> StageResult:
    """Grade ``stage`` from ``source`` ('stages', 'solutions' or a folder), within ``limits``.

    ``jobs`` workers (``default_jobs()`` unless given) take the checks in turn, each a sandboxed
    process of its own; ``on_result`` still sees the results in the checks' order.
    """
    started = time.monotonic()
    jobs = max(1, jobs if jobs is not None else default_jobs())
    limits = limits or Limits.from_env(jobs=jobs)
    deadline = started + limits.stage_timeout
    seed = session_seed()
    checks = [c for c in stage.checks() if only is None or c.name in only]
    folder = loader.source_dir(source)
    path = folder / f"{stage.module}.py"
    result = StageResult(stage.name, str(source), "graded", seed=seed, device=runtime.describe())
    if not os.path.lexists(path):
        result.status = "not started"
        result.results = verdicts(checks, "todo", f"{path} does not exist")
        return result
    with _cleaned_on_sigterm():
        try:
            untouched = str(source) != "solutions" and solution_file.is_untouched(path)
            snapshot = None if untouched else snapshot_stage(stage, source)
        except files.UnsafeFile as exc:
            result.status = "refused"
            result.results = verdicts(checks, "FAIL", str(exc))
            return result
        if untouched:
            result.status = "not started"
            result.results = verdicts(checks, "todo", "not started")
            return result
        try:
            return _grade_snapshot(stage, source, snapshot, result, checks, limits, jobs, seed, deadline, only,
                                   on_result, started)
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)


def _grade_snapshot(stage, source, snapshot, result, checks, limits, jobs, seed, deadline, only, on_result, started):
    """The rest of grade_stage, once the learner's files are in ``snapshot`` (which the caller removes)."""
    folder = loader.source_dir(source)
    path = folder / f"{stage.module}.py"
    try:                               # after the cheap answers above: a stage not started runs nothing
        mechanism = choice.choose()
    except IsolationError as exc:
        result.status = "not graded"
        result.results = verdicts(checks, "crash", str(exc))
        return result
    result.isolation = mechanism.name

    # Learner code reads its files from the snapshot; the folder they came from is none of its business,
    # nor are a batch's other submissions and records (its grader's environment names them).
    private = [] if folder in (loader.ROOT / "stages", loader.ROOT / "solutions") else [folder]
    private += _env_paths("WORKBOOK_PRIVATE")
    protected = _env_paths("WORKBOOK_PROTECT")
    keys = AnswerKeys(private + protected) if mechanism.name == "user" else contextlib.nullcontext()
    # Grading your own files again reuses the kernels compiled last time; other people's code (a
    # batch, or a folder given by path) starts from an empty cache.
    own = str(source) in ("stages", "solutions") and not os.environ.get("WORKBOOK_PRIVATE")
    cache = caches.compile_cache(str(source)) if own and mechanism.name != "none" else None

    def runner():
        return Runner(stage.module, str(snapshot), limits=limits, private=private, protected=protected,
                      mechanism=mechanism, cache=cache)

    result.workers = max(1, min(jobs, len(checks)))
    limits = limits.for_stage(len(checks), result.workers, gpu=runtime.ON_GPU)   # a hang costs its own checks
    order, spent = (_longest_first(stage, checks) if own else None), {}
    with keys:
        results, failed_import = _run_checks(checks, runner, seed, deadline, limits, result.workers, on_result,
                                             stage.module, order=order, spent=spent)
    if failed_import is None:
        result.results = results
        if own and only is None:
            _remember_durations(stage, results, spent)
    else:
        exc, tail = failed_import
        result.status = "import error"
        msg = _import_message(exc, path.name, stage.module)
        msg += f"; last output: {tail}" if tail else ""
        result.results = verdicts(checks, "timeout" if exc.timed_out else "crash", msg)
    copies = re.compile(re.escape(str(snapshot)) + r"(-w\d+)?")       # the snapshot, and each worker's copy of it
    for r in result.results:           # name the learner's file, not the private copy, in messages
        r.message = copies.sub(lambda _: str(folder), r.message)
    result.seconds = time.monotonic() - started
    return result


def _import_message(exc: ImportFailed, name: str, module: str) -> str:
    """Why the stage file did not import, at its line in the learner's file: never a line of the grader's own
    code (the loader that imported it), which says nothing about what to fix."""
    if exc.type_name in ("SyntaxError", "IndentationError", "TabError"):
        at = re.search(rf'^\s*File "[^"]*{re.escape(module)}\.py", line (\d+)\n((?:    .*\n?){{0,2}})', exc.tb, re.M)
        what = re.sub(r"\s*\([^()]*, line \d+\)$", "", exc.message)     # "invalid syntax (x.py, line 29)"
        if at:
            shown = "".join(f"\n  {ln}" for ln in at.group(2).rstrip("\n").split("\n") if ln.strip())
            return f"{name} could not be imported: {exc.type_name} at line {at.group(1)}: {what}{shown}"
    where = locate.frame(exc.tb, module)
    if f"{module}.py" not in where:
        where = ""                   # no line of the learner's file is involved: the message says it all
    where = re.sub(r'^File "[^"]*/([^"/]+)", line (\d+), in ', r"\1 line \2, in ", where)
    return f"{name} could not be imported: {exc.type_name}: {exc.message}" + (f" ({where})" if where else "")


def _env_paths(name: str) -> list[Path]:
    return [Path(p) for p in os.environ.get(name, "").split(os.pathsep) if p]


@contextlib.contextmanager
def _cleaned_on_sigterm():
    """SIGTERM (a scheduler's stop, ``kill``) ends a grading as Ctrl-C does: its workers are stopped
    and the snapshot of the learner's files is removed, not left for the next grading to sweep.
    Only where nobody else chose what SIGTERM does (the main thread, the default action)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_checks(checks, make_runner, seed: int, deadline: float, limits: Limits, jobs: int, on_result, module: str,
                *, order: list[int] | None = None, spent: dict[int, float] | None = None):
    """Run ``checks`` on ``jobs`` workers, each taking the next check not yet taken (in ``order``, a
    permutation of their indices, when given).  ``spent``, when given, receives each check's seconds
    less any spent starting its worker or compiling kernels.

    Returns ``(results in the checks' order, None)``, or ``(None, (ImportFailed, the worker's last
    output))`` as soon as a worker finds that the stage file cannot be imported: then no other
    check starts.  ``on_result`` is called in the checks' order, as each result and those before
    it are in.  An error of the grader's own in a worker's thread is raised here.
    """
    results: list[CheckResult | None] = [None] * len(checks)
    lock = threading.Lock()
    state = {"next": 0, "shown": 0, "import": None, "error": None}
    runners = []

    def take() -> int | None:
        with lock:
            if state["import"] is not None or state["error"] is not None or state["next"] >= len(checks):
                return None
            state["next"] += 1
            return state["next"] - 1 if order is None else order[state["next"] - 1]

    def done(i: int, r: CheckResult) -> None:
        with lock:
            results[i] = r
            while on_result and state["shown"] < len(checks) and results[state["shown"]] is not None:
                on_result(results[state["shown"]])
                state["shown"] += 1

    def work() -> None:
        try:
            with make_runner() as runner:
                runners.append(runner)
                while (i := take()) is not None:
                    check = checks[i]
                    if time.monotonic() >= deadline:
                        done(i, CheckResult(check.name, check.points, 0, "timeout", "not run: the checks before it "
                                            f"used up the stage's time limit ({limits.stage_timeout:.0f} s)",
                                            hidden=check.hidden))
                        continue
                    try:
                        booted = getattr(runner, "start_seconds", 0.0)
                        compiled = getattr(runner, "compile_seconds", 0.0)
                        r = run_check(check, runner, seed, deadline=deadline, limits=limits)
                        if spent is not None:
                            spent[i] = max(0.0, r.seconds - (getattr(runner, "start_seconds", 0.0) - booted)
                                           - (getattr(runner, "compile_seconds", 0.0) - compiled))
                        done(i, r)
                    except ImportFailed as exc:
                        tail = _crash_context(runner.output_tail(4000), module) if exc.type_name == "crash" else ""
                        with lock:
                            state["import"] = state["import"] or (exc, tail)
                        return
        except BaseException as exc:  # the grader's own failure, raised again in the caller
            with lock:
                state["error"] = state["error"] or exc

    if jobs == 1:
        work()
    else:
        threads = [threading.Thread(target=work, name=f"grader-worker-{n}", daemon=True) for n in range(jobs)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except (KeyboardInterrupt, SystemExit):      # stop every worker, as leaving a Runner's block would
            for r in list(runners):
                r.close()
            raise
    if state["error"] is not None:
        raise state["error"]
    if state["import"] is not None:
        return None, state["import"]
    return results, None
