"""``python -m grader batch SUBMISSIONS --stages stage5,stage6 --out OUT``: grade a class.

Each folder in SUBMISSIONS is one learner: their stage files, or a whole copy of the workbook
(its ``stages/`` is used), there or one folder down; so is each zip of those (``kim.zip``), which
grader/intake.py checks and extracts into OUT/intake/.  Each (learner, stage) is graded by a fresh

    python -m grader stageN --submission SUBMISSIONS/<learner> --format json

in a process of its own, so nothing one learner's code does can reach another's grading; up to
``--jobs`` of them (the machine's cores) run at once.  Every learner gets the same inputs (one
seed per batch, kept in OUT/batch.json).  Learner code runs in the sandbox grader/sandbox.py
chooses: it sees its own submission and nothing of SUBMISSIONS, OUT or the other workers.  A
batch refuses to start without a real isolation mechanism unless told ``--isolation none``.

    OUT/gradebook.csv                      learner, stage, score, max_score, status, seconds, isolation
    OUT/learners/<learner>/results.json    Gradescope's format; hidden checks folded into one line,
                                           so it can go back to the learner as it is
    OUT/learners/<learner>/<stage>.json    the grader's full record, hidden checks by name: the
                                           instructor's

A batch that is interrupted resumes: a (learner, stage) whose record exists and was made from
the same stage files (their SHA-256 is in it) is not graded again, unless its grading failed for
the grader's own reasons (an "error" record).  Every file is written to a temporary name and
renamed, so none is ever half-written; the gradebook is rewritten, whole, each time a grading
finishes.  Entries whose names start with a dot, anything in SUBMISSIONS that is neither a plain
folder nor a zip, and what intake refuses are listed, with why, and left out.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from grader import files, formats, intake, sandbox, stages
from grader.grade import CheckResult, StageResult, submission_folder
from grader.limits import Limits
from kernels.loader import ROOT

COLUMNS = ("learner", "stage", "score", "max_score", "status", "seconds", "isolation")
_GRACE = 120.0  # seconds a grading process may take beyond its stage's limit (starting up, reporting)


def learners(submissions: Path, out: Path) -> list[Path]:
    """The folder to grade of each learner, in their names' order: their own folder, or where
    grader/intake.py took a nested folder or a zip in (``out/intake/<learner>``); each path's name is
    the learner's.  Hidden entries, links, other files and the output, if it is there, are not learners."""
    return [e.folder for e in intake.survey(submissions, out) if e.folder is not None]


def left_out(submissions: Path, out: Path) -> list[str]:
    """What ``learners`` leaves out, with why (said once at the start of a batch, never silently)."""
    return [f"{e.source.name} ({e.problem})" for e in intake.survey(submissions, out) if e.folder is None]


def digest(folder: Path, stage) -> str:
    """SHA-256 over a submission's files for ``stage`` (the record is stale once they change)."""
    h = hashlib.sha256()
    where = submission_folder(folder, stage)
    for name in stage.files():
        try:
            data = files.read_plain(where / name)
        except files.UnsafeFile as exc:
            data = f"<unsafe: {exc}>".encode()
        h.update(name.encode() + b"\0" + (b"<missing>" if data is None else data) + b"\0")
    return h.hexdigest()


class Batch:
    def __init__(self, submissions: Path, chosen: list, out: Path, *, jobs: int, limits: Limits, seed: int,
                 mechanism: sandbox.Mechanism):
        self.submissions, self.stages, self.out, self.mechanism = submissions, chosen, out, mechanism
        self.jobs, self.limits, self.seed = jobs, limits, seed
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def folder(self, learner: Path) -> Path:
        return self.out / "learners" / learner.name

    def record_path(self, learner: Path, stage) -> Path:
        return self.folder(learner) / f"{stage.name}.json"

    def load(self, learner: Path, stage) -> dict | None:
        """The record of a finished grading, or None if there is none, it is stale, or the grading
        failed for the grader's own reasons (graded again on resume)."""
        try:
            data = files.read_plain(self.record_path(learner, stage))
            record = json.loads(data) if data is not None else None
        except (files.UnsafeFile, ValueError):
            return None
        if not isinstance(record, dict) or "error" in record:
            return None
        return record if record.get("digest") == digest(learner, stage) else None

    # -- one grading, in a process of its own ---------------------------------------------------
    def grade(self, learner: Path, stage) -> dict:
        started = time.monotonic()
        tmp = self.folder(learner) / f".{stage.name}.{secrets.token_hex(6)}.tmp"
        env = dict(os.environ, **self.limits.env(), WORKBOOK_SEED=str(self.seed),
                   WORKBOOK_PRIVATE=str(self.submissions), WORKBOOK_PROTECT=str(self.out),
                   **sandbox.checked_env(self.mechanism),
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // self.jobs)))
        cmd = [sys.executable, "-m", "grader", stage.name, "--submission", str(learner), "--format", "json",
               "--out", str(tmp)]
        record = {"learner": learner.name, "stage": stage.name, "digest": digest(learner, stage),
                  "isolation": self.mechanism.name}
        try:
            with self._lock:
                if self._stopping:
                    raise KeyboardInterrupt
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        start_new_session=True)
                self._running.add(proc)
            try:
                _, err = proc.communicate(timeout=self.limits.stage_timeout + _GRACE)
            except subprocess.TimeoutExpired:
                _kill(proc)
                _, err = proc.communicate()
                err = f"the grader did not finish within {self.limits.stage_timeout + _GRACE:.0f} s".encode()
            finally:
                with self._lock:
                    self._running.discard(proc)
            try:
                record["result"] = json.loads(tmp.read_text())["stages"][0]
            except (OSError, ValueError, KeyError, IndexError):
                tail = err.decode(errors="replace").strip()[-600:]
                record["error"] = f"grading failed (exit status {proc.returncode}): {tail or 'no output'}"
        finally:
            tmp.unlink(missing_ok=True)
        record["seconds"] = round(time.monotonic() - started, 1)
        if not self._stopping:  # an interrupted grading is graded again on resume
            formats.write_atomic(self.record_path(learner, stage), json.dumps(record, indent=1) + "\n")
        return record

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            for proc in list(self._running):
                _kill(proc)

    # -- what comes out ---------------------------------------------------------------------------
    def stage_result(self, record: dict, stage) -> StageResult:
        if "result" in record:
            return StageResult.from_dict(record["result"])
        return StageResult(stage.name, record["learner"], "error", results=[
            CheckResult(c.name, c.points, 0, "crash", record["error"], hidden=c.hidden) for c in stage.checks()])

    def write_learner(self, learner: Path) -> None:
        records = [(s, self.load(learner, s)) for s in self.stages]
        if all(r is not None for _, r in records):
            graded = [(s, self.stage_result(r, s)) for s, r in records]
            formats.write_atomic(self.folder(learner) / "results.json",
                                 json.dumps(formats.gradescope(graded), indent=1) + "\n")

    def write_gradebook(self) -> int:
        rows = []
        for learner in learners(self.submissions, self.out):
            for stage in self.stages:
                record = self.load(learner, stage)
                if record is None:
                    continue
                result = self.stage_result(record, stage)
                status = result.status
                not_run = sum(r.status == "not run" for r in result.results)
                if status == "graded" and not_run:
                    status += f" ({not_run} GPU-only checks not run)"
                rows.append((learner.name, stage.name, result.score, result.max_score, status, record["seconds"],
                             record.get("isolation", "")))
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(rows)
        formats.write_atomic(self.out / "gradebook.csv", text.getvalue())
        return len(rows)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the grader and its worker: a session of their own
        except OSError:
            pass


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, one line per step otherwise."""

    def __init__(self, total: int, done: int = 0):
        self.total, self.done, self.failed, self.start = total, done, 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, what: str, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        elapsed = time.monotonic() - self.start
        fill = int(30 * self.done / max(1, self.total))
        line = (f"[{'#' * fill}{'.' * (30 - fill)}] {self.done}/{self.total}  {elapsed:.0f} s"
                f"{f'  ({self.failed} not passed)' if self.failed else ''}  {what}")
        if self.tty:
            sys.stderr.write("\r\033[K" + line + ("\n" if self.done == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(submissions: Path, chosen: list, out: Path, *, jobs: int | None = None, limits: Limits | None = None,
        seed: int | None = None) -> int:
    """Grade every learner in ``submissions`` on ``chosen`` stages into ``out``; 0 when all finished."""
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if not submissions.is_dir():
        _say(f"{submissions} is not a folder of submissions (one folder per learner)")
        return 2
    try:
        mechanism = sandbox.choose()
    except sandbox.IsolationError as exc:
        _say(str(exc))
        return 2
    if mechanism.name == "none" and sandbox.requested() != "none":
        _say("no isolation mechanism works here, so learner code would run as you, able to read the answer keys "
             f"and the other submissions ({mechanism.reason}).\nInstall bubblewrap or run as root to grade "
             "a class; --isolation none grades anyway (only for code you trust).")
        return 2
    jobs = max(1, jobs or os.cpu_count() or 1)
    limits = limits or Limits.from_env(jobs=jobs)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)  # records are the grader's alone
    if mechanism.name == "user":
        sandbox.protect_answer_keys([submissions, out])
    meta_path = out / "batch.json"
    try:
        meta = json.loads(files.read_plain(meta_path) or b"{}")
    except (files.UnsafeFile, ValueError):
        meta = {}
    seed = seed if seed is not None else meta.get("seed", secrets.randbelow(2**31))
    formats.write_atomic(meta_path, json.dumps({"seed": seed, "submissions": str(submissions)}, indent=1) + "\n")
    batch = Batch(submissions, chosen, out, jobs=jobs, limits=limits, seed=seed, mechanism=mechanism)
    everyone = learners(submissions, out)
    todo = [(p, s) for p in everyone for s in chosen if batch.load(p, s) is None]
    for p in everyone:
        batch.folder(p).mkdir(parents=True, exist_ok=True)
    total = len(everyone) * len(chosen)
    skipped = left_out(submissions, out)
    if skipped:
        _say(f"left out (not a learner's folder): {', '.join(skipped)}")
    _say(f"{len(everyone)} learners, {', '.join(s.name for s in chosen)}: {len(todo)} to grade, "
         f"{total - len(todo)} already graded; {jobs} at a time; inputs seed {seed}; learner code isolated by "
         f"{mechanism.describe()}")
    progress = Progress(total, total - len(todo))
    remaining = {p.name: sum(1 for q, _ in todo if q == p) for p in everyone}
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop leaves a whole gradebook, too
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = {pool.submit(batch.grade, p, s): (p, s) for p, s in todo}
        for future in as_completed(futures):
            learner, stage = futures[future]
            record = future.result()
            result = batch.stage_result(record, stage)
            remaining[learner.name] -= 1
            if not remaining[learner.name]:
                batch.write_learner(learner)
            batch.write_gradebook()
            progress.step(f"{learner.name} {stage.name}: {result.score}/{result.max_score} {result.status}",
                          ok=result.ok)
    except KeyboardInterrupt:
        batch.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        rows = batch.write_gradebook()
        _say(f"\ninterrupted: {rows} of {total} gradings are in {out / 'gradebook.csv'}; "
             "run the same command again to grade the rest")
        return 130
    pool.shutdown()
    for p in everyone:  # learners whose every stage was already graded before this run
        batch.write_learner(p)
    rows = batch.write_gradebook()
    _say(f"gradebook: {out / 'gradebook.csv'} ({rows} rows); each learner's results.json is in "
         f"{out / 'learners'}/<learner>/")
    return 0


def main(submissions: str | Path, *, stages: str, out: str | Path, jobs: int | None = None, seed: int | None = None,
         limits: dict | None = None) -> int:
    """``python -m grader batch``: grade every learner in ``submissions`` on ``stages`` (``stage5,stage6``)
    into ``out``; ``limits`` are ``Limits.from_env`` overrides."""
    from grader import stages as all_stages
    try:
        chosen = [all_stages.find(name) for name in stages.split(",")]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    limits = Limits.from_env(jobs=jobs or os.cpu_count() or 1, **(limits or {}))
    return run(Path(submissions), chosen, Path(out), jobs=jobs, limits=limits, seed=seed)
