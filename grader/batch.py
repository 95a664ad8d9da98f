"""``python -m grader batch SUBMISSIONS --stages stage5,stage6 --out OUT``: grade a class.

Each folder in SUBMISSIONS is one learner: their stage files, or a whole copy of the workbook
(its ``stages/`` is used), there or one folder down; so is each zip of those (``kim.zip``), which
grader/intake.py checks and extracts into OUT/intake/.  Each (learner, stage) is graded by a fresh

    python -m grader stageN --format json      (the learner's folder and the record's path in its environment)

in a process of its own, so nothing one learner's code does can reach another's grading; up to
``--jobs`` of them (the machine's cores) run at once.  Every learner gets the same inputs (one
seed per batch, kept in OUT/batch.json).  Learner code runs in the sandbox grader/isolation/
chooses: it sees its own submission and nothing of SUBMISSIONS, OUT or the other workers.  A
batch refuses to start without a real isolation mechanism unless told ``--isolation none``.

    OUT/gradebook.csv                      learner, stage, score, max_score, status, seconds, isolation,
                                           submitted: a row per graded learner and stage
    OUT/checks.csv                         learner, stage, check, points, max_points, status: a row per check
    OUT/learners/<learner>/results.json    Gradescope's format, over every stage graded into OUT; hidden
                                           checks folded into one line, so it can go back to the learner
    OUT/learners/<learner>/<stage>.json    the grader's full record, hidden checks by name: the
                                           instructor's

A record says what graded it: the SHA-256 of the stage files it graded, when they were handed in
(the newest file's time, UTC), and a fingerprint: the grader's version, the stage's checks (their
sources, hidden ones included: ``checks_digest``), the inputs' seed, the limits and the kind of
machine.  A batch that is interrupted, or run again, grades a (learner, stage) again when its
record is missing, its files changed, its fingerprint is not this batch's, or its grading failed
for the grader's own reasons (an "error" record); it says how many for each reason.
``--regrade LEARNER``, ``--regrade LEARNER/STAGE`` and ``--regrade all`` grade again whatever the
record says.  The seed is the batch's (OUT/batch.json): a ``--seed`` other than that one is
refused unless ``--regrade all`` comes with it, so no learner is ever graded on other inputs than
the class.

Grading some stages keeps the others: the gradebook, checks.csv and results.json hold every stage
graded into OUT, by this batch or an earlier one, and learners graded earlier who are not in
SUBMISSIONS now.  Every file is written to a temporary name and renamed, so none is ever
half-written; the gradebook is rewritten, whole, each time a grading finishes.  A learner folder
whose name is not UTF-8 is written in them with its odd bytes as ``\\xNN`` (``formats.learner_label``).
Entries whose names start with a dot, anything in SUBMISSIONS that is neither a plain folder nor a
zip, and what intake refuses are listed, with why, and left out.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from kernels import runtime
from kernels.loader import ROOT

from grader import BATCH_OUT_ENV, BATCH_SUBMISSION_ENV, formats, intake, stages
from grader.grade import submission_folder, verdicts
from grader.isolation import answer_keys, choice, files
from grader.isolation.limits import Limits, default_memory_mb
from grader.isolation.mechanism import IsolationError, Mechanism
from grader.results import StageResult

COLUMNS = ("learner", "stage", "score", "max_score", "status", "seconds", "isolation", "submitted")
CHECK_COLUMNS = ("learner", "stage", "check", "points", "max_points", "status")
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


def version(root: Path = ROOT) -> str:
    """The grader's version, pyproject's (a record made by another version is graded again)."""
    try:
        match = re.search(r'^version\s*=\s*"([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    except OSError:
        match = None
    return match.group(1) if match else "unknown"


#: The files besides a stage's own check modules whose change can change a verdict: the shared check
#: helpers (every file of grader/checks/ that is not one stage's), how a check runs and is timed, and
#: the reference and tolerances the answers are compared with.
GRADING_SOURCES = ("grader/check.py", "grader/grade.py", "grader/results.py", "grader/isolation/limits.py",
                   "kernels/reference.py", "kernels/tolerance.py", "kernels/masks.py")


def checks_digest(stage, root: Path = ROOT) -> str:
    """SHA-256 over what decides ``stage``'s verdicts: its check modules (grader/checks/stageN.py and,
    where there is one, grader/checks/hidden/stageN.py), the shared check helpers and GRADING_SOURCES,
    and each check's name, points and needs.  A hidden check added or changed changes it."""
    checks = root / "grader" / "checks"
    paths = [checks / f"{stage.name}.py", checks / "hidden" / f"{stage.name}.py"]
    paths += sorted(p for p in checks.glob("*.py") if not re.fullmatch(r"stage\d+\.py", p.name))
    paths += [root / rel for rel in GRADING_SOURCES]
    h = hashlib.sha256()
    for path in paths:
        try:
            data = path.read_bytes()
        except OSError:
            data = b"<missing>"
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + data + b"\0")
    for c in stage.checks():
        h.update(f"{c.name} {c.points} {c.gpu} {c.sm} {c.hidden} {c.validation} {c.timeout}\n".encode())
    return h.hexdigest()


def fingerprint(stage, *, seed: int, limits: Limits, jobs: int) -> dict:
    """What graded a record: the grader's version, the stage's checks (``checks_digest``), the inputs'
    seed, the limits (the memory limit as "default" where it is the machine's default for ``jobs``,
    so that another ``--jobs`` alone grades nothing again) and the kind of machine (a GPU runs checks a
    CPU cannot).  A resume grades again every record whose fingerprint is not this one."""
    shown = asdict(limits)
    if shown["memory_mb"] == default_memory_mb(jobs):
        shown["memory_mb"] = "default"
    if runtime.ON_GPU:
        major, minor = runtime.capability()
        machine = f"gpu sm_{major}{minor}"
    else:
        machine = "cpu"
    return {"grader": version(), "checks": checks_digest(stage), "seed": seed, "limits": shown, "machine": machine}


#: Why a record is graded again, by the fingerprint's part that differs.
_CHANGED = {"grader": "another grader version", "checks": "the checks or the code that runs them changed",
            "seed": "other inputs seed", "limits": "other limits", "machine": "another kind of machine"}


def parse_regrade(values: list[str] | None, everyone: list[Path], chosen: list) -> set[tuple[str, str | None]]:
    """``--regrade`` values (``all``, ``LEARNER`` or ``LEARNER/STAGE``) as (learner's folder name, stage name or
    None) pairs, ("*", None) for all; a ValueError naming the value for a learner or stage not in this batch."""
    found: set[tuple[str, str | None]] = set()
    names = {p.name: p.name for p in everyone} | {formats.learner_label(p.name): p.name for p in everyone}
    for value in values or ():
        if value == "all":
            found.add(("*", None))
            continue
        learner, _, stage_name = value.rpartition("/") if "/" in value else (value, "", "")
        if learner not in names:
            listing = ", ".join(sorted(map(formats.learner_label, set(names.values()))))[:300] or "none"
            raise ValueError(f"--regrade {value!r}: there is no learner {learner!r} in the submissions "
                             f"(the learners: {listing})")
        if stage_name:
            try:
                stage = stages.find(stage_name)
            except ValueError as exc:
                raise ValueError(f"--regrade {value!r}: {exc}") from None
            if stage not in chosen:
                raise ValueError(f"--regrade {value!r}: {stage.name} is not among --stages "
                                 f"({', '.join(s.name for s in chosen)})")
            found.add((names[learner], stage.name))
        else:
            found.add((names[learner], None))
    return found


class Batch:
    def __init__(self, submissions: Path, chosen: list, out: Path, *, jobs: int, limits: Limits, seed: int,
                 mechanism: Mechanism, regrade: set | None = None):
        self.submissions, self.stages, self.out, self.mechanism = submissions, chosen, out, mechanism
        self.jobs, self.limits, self.seed = jobs, limits, seed
        self.regrade = set(regrade or ())
        # When each learner handed in (POSIX seconds), where the files' own times do not say it (an archive).
        self.fingerprints = {s.name: fingerprint(s, seed=seed, limits=limits, jobs=jobs) for s in chosen}
        self._graded: set[tuple[str, str]] = set()      # (learner, stage) graded by this batch: --regrade is done
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopping = False

    def folder(self, learner: Path | str) -> Path:
        return self.out / "learners" / (learner if isinstance(learner, str) else learner.name)

    def record_path(self, learner: Path | str, stage) -> Path:
        return self.folder(learner) / f"{stage.name}.json"

    def read(self, learner: Path | str, stage) -> dict | None:
        """The record of ``learner``'s ``stage`` as it is on disk, whoever graded it; None if there is none."""
        try:
            data = files.read_plain(self.record_path(learner, stage))
            record = json.loads(data) if data is not None else None
        except (files.UnsafeFile, ValueError):
            return None
        return record if isinstance(record, dict) and ("result" in record or "error" in record) else None

    def stale(self, learner: Path, stage) -> str:
        """Why ``learner``'s ``stage`` must be graded (again) in this batch; "" when its record stands."""
        record = self.read(learner, stage)
        asked = {("*", None), (learner.name, None), (learner.name, stage.name)} & self.regrade
        if asked and (learner.name, stage.name) not in self._graded:
            return "--regrade"
        if record is None:
            return "not graded yet"
        if "error" in record:
            return "the grader failed"
        if record.get("digest") != digest(learner, stage):
            return "the submission changed"
        made = record.get("fingerprint")
        if not isinstance(made, dict):
            return "graded before records named what graded them"
        now = self.fingerprints[stage.name]
        changed = [_CHANGED[k] for k in now if made.get(k) != now[k]]
        return ", ".join(changed)

    def load(self, learner: Path, stage) -> dict | None:
        """The record of a finished grading that this batch keeps: None if there is none, the submission or
        the grading's fingerprint changed since, or the grading failed for the grader's own reasons."""
        record = self.read(learner, stage)
        return record if record is not None and not self.stale(learner, stage) else None

    def submission_time(self, learner: Path, stage) -> str:
        """When ``stage``'s files were handed in (a zip's member dates, which intake keeps); "" if never."""
        return intake.submitted(learner, [stage]) or ""

    # -- one grading, in a process of its own ---------------------------------------------------
    def grade(self, learner: Path, stage) -> dict:
        started = time.monotonic()
        tmp = self.folder(learner) / f".{stage.name}.{secrets.token_hex(6)}.tmp"
        # The learner's folder and the record's path go in the environment, never on the command line.
        env = dict(os.environ, **self.limits.env(), WORKBOOK_SEED=str(self.seed),
                   WORKBOOK_PRIVATE=str(self.submissions), WORKBOOK_PROTECT=str(self.out),
                   **{BATCH_SUBMISSION_ENV: str(learner), BATCH_OUT_ENV: str(tmp)},
                   **choice.checked_env(self.mechanism),
                   OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // self.jobs)))
        cmd = [sys.executable, "-m", "grader", stage.name, "--format", "json"]
        record = {"learner": formats.learner_label(learner.name), "stage": stage.name,
                  "digest": digest(learner, stage), "fingerprint": self.fingerprints[stage.name],
                  "submitted": self.submission_time(learner, stage), "isolation": self.mechanism.name}
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
            self._graded.add((learner.name, stage.name))
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
        return StageResult(stage.name, record["learner"], "error", results=verdicts(stage.checks(), "crash",
                                                                                    record["error"]))

    def _kept(self, learner: Path | str, stage) -> dict | None:
        """The record that stands for ``learner``'s ``stage`` in what this batch writes: for a stage of this
        batch, a current record (or a failed grading, said as such); for any other stage, the record an
        earlier batch left, whatever graded it (grading stage 2 this week keeps last week's stage 1)."""
        if stage in self.stages and not isinstance(learner, str):
            record = self.read(learner, stage)
            return record if record is not None and ("error" in record or not self.stale(learner, stage)) else None
        return self.read(learner, stage)

    def write_learner(self, learner: Path) -> None:
        """results.json over every stage graded for ``learner``, once this batch's stages are all graded."""
        graded = []
        for stage in stages.STAGES:
            record = self.load(learner, stage) if stage in self.stages else self.read(learner, stage)
            if record is None and stage in self.stages:
                return
            if record is not None and "result" in record:
                graded.append((stage, self.stage_result(record, stage)))
        formats.write_atomic(self.folder(learner) / "results.json",
                             json.dumps(formats.gradescope(graded), indent=1) + "\n")

    def _learner_names(self) -> list[Path | str]:
        """The learners of this batch (paths), then those with records from earlier batches only (names)."""
        found: list[Path | str] = list(learners(self.submissions, self.out))
        seen = {p.name for p in found}
        try:
            earlier = sorted(e.name for e in os.scandir(self.out / "learners")
                             if e.is_dir(follow_symlinks=False) and e.name not in seen)
        except OSError:
            earlier = []
        return sorted(found + earlier, key=lambda p: p if isinstance(p, str) else p.name)

    def write_gradebook(self) -> int:
        """gradebook.csv (a row per graded learner and stage) and checks.csv (a row per check); every stage
        graded into this folder, by this batch or an earlier one, keeps its rows.  Returns the rows."""
        rows, checks = [], []
        for learner in self._learner_names():
            label = formats.learner_label(learner if isinstance(learner, str) else learner.name)
            for stage in stages.STAGES:
                record = self._kept(learner, stage)
                if record is None:
                    continue
                result = self.stage_result(record, stage)
                rows.append((label, stage.name, result.score, result.max_score, gradebook_status(result),
                             record.get("seconds", ""), record.get("isolation", ""), record.get("submitted", "")))
                checks += [(label, stage.name, r.name, r.earned, r.points if r.status != "not run" else 0, r.status)
                           for r in result.results]
        formats.write_atomic(self.out / "gradebook.csv", _csv(COLUMNS, rows))
        formats.write_atomic(self.out / "checks.csv", _csv(CHECK_COLUMNS, checks))
        return len(rows)


def gradebook_status(result: StageResult) -> str:
    """The gradebook's status: the stage's, and for a graded one "timeout" when checks ran out of time,
    with how many, and how many GPU-only checks could not run here."""
    status = result.status
    if status != "graded":
        return status
    timed_out = sum(r.status == "timeout" for r in result.results)
    not_run = sum(r.status == "not run" for r in result.results)
    notes = ([f"{timed_out} check{'s' if timed_out != 1 else ''} timed out"] if timed_out else []) + \
        ([f"{not_run} GPU-only checks not run"] if not_run else [])
    return ("timeout" if timed_out else status) + (f" ({'; '.join(notes)})" if notes else "")


# A spreadsheet reads a cell that starts with one of these as a formula: a learner's folder named
# "=HYPERLINK(...)" would run in the instructor's gradebook. Such a cell gets a leading apostrophe,
# which spreadsheets show as text and do not display.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _cell(value):
    return "'" + value if isinstance(value, str) and value.startswith(_FORMULA_START) else value


def _csv(columns, rows) -> str:
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(columns)
    writer.writerows([_cell(v) for v in row] for row in rows)
    return text.getvalue()


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
        seed: int | None = None, regrade: list[str] | None = None) -> int:
    """Grade every learner in ``submissions`` on ``chosen`` stages into ``out``; 0 when all finished.

    ``regrade``: ``--regrade`` values (``all``, ``LEARNER``, ``LEARNER/STAGE``), graded again whatever their
    records say."""
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if not submissions.is_dir():
        _say(f"{submissions} is not a folder of submissions (one folder per learner)")
        return 2
    try:
        mechanism = choice.choose()
    except IsolationError as exc:
        _say(str(exc))
        return 2
    if mechanism.name == "none" and choice.requested() != "none":
        _say("no isolation mechanism works here, so learner code would run as you, able to read the answer keys "
             f"and the other submissions ({mechanism.reason}).\nInstall bubblewrap or run as root to grade "
             "a class; --isolation none grades anyway (only for code you trust).")
        return 2
    jobs = max(1, jobs or os.cpu_count() or 1)
    limits = limits or Limits.from_env(jobs=jobs)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)  # records are the grader's alone
    if mechanism.name == "user":
        answer_keys.protect_answer_keys([submissions, out])
    meta_path = out / "batch.json"
    try:
        meta = json.loads(files.read_plain(meta_path) or b"{}")
    except (files.UnsafeFile, ValueError):
        meta = {}
    everyone = learners(submissions, out)
    try:
        targets = parse_regrade(regrade, everyone, chosen)
    except ValueError as exc:
        _say(str(exc))
        return 2
    kept = meta.get("seed") if isinstance(meta, dict) else None
    if seed is not None and isinstance(kept, int) and seed != kept:
        # Every learner of a batch gets the same inputs: another seed is a new grading of the whole class.
        if ("*", None) not in targets:
            _say(f"--seed {seed} is not this batch's seed ({kept}, in {meta_path}): its records were graded on "
                 f"seed {kept}'s inputs, and learners graded from now on would get other inputs than the class.\n"
                 f"Run without --seed to go on with seed {kept}, or add --regrade all to grade everyone again "
                 f"on seed {seed}.")
            return 2
        _say(f"NOTE: the inputs seed changes from {kept} to {seed}: every learner is graded again (--regrade all)")
    seed = seed if seed is not None else kept if isinstance(kept, int) else secrets.randbelow(2**31)
    formats.write_atomic(meta_path, json.dumps({"seed": seed, "submissions": str(submissions)}, indent=1) + "\n")
    batch = Batch(submissions, chosen, out, jobs=jobs, limits=limits, seed=seed, mechanism=mechanism,
                  regrade=targets)
    why = {(p, s): batch.stale(p, s) for p in everyone for s in chosen}
    todo = [(p, s) for p in everyone for s in chosen if why[(p, s)]]
    for p in everyone:
        batch.folder(p).mkdir(parents=True, exist_ok=True)
    total = len(everyone) * len(chosen)
    skipped = left_out(submissions, out)
    if skipped:
        _say(f"left out (not a learner's folder): {', '.join(skipped)}")
    _say(f"{len(everyone)} learners, {', '.join(s.name for s in chosen)}: {len(todo)} to grade, "
         f"{total - len(todo)} already graded; {jobs} at a time; inputs seed {seed}; learner code isolated by "
         f"{mechanism.describe()}")
    again = Counter(reason for reason in why.values() if reason and reason != "not graded yet")
    if again:
        _say("graded again: " + "; ".join(f"{n} ({reason})" for reason, n in sorted(again.items())))
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
            progress.step(f"{formats.learner_label(learner.name)} {stage.name}: {result.score}/{result.max_score} "
                          f"{gradebook_status(result)}", ok=result.ok)
    except KeyboardInterrupt:
        batch.stop()
        pool.shutdown(wait=True, cancel_futures=True)
        batch.write_gradebook()
        done = sum(batch.load(p, s) is not None for p in everyone for s in chosen)
        _say(f"\ninterrupted: {done} of {total} gradings are in {out / 'gradebook.csv'}; "
             "run the same command again to grade the rest")
        return 130
    pool.shutdown()
    for p in everyone:  # learners whose every stage was already graded before this run
        batch.write_learner(p)
    rows = batch.write_gradebook()
    _say(f"gradebook: {out / 'gradebook.csv'} ({rows} rows; a row per check in checks.csv); each learner's "
         f"results.json is in {out / 'learners'}/<learner>/")
    return 0


def main(submissions: str | Path, *, stages: str, out: str | Path, jobs: int | None = None, seed: int | None = None,
         limits: dict | None = None, regrade: list[str] | None = None) -> int:
    """``python -m grader batch``: grade every learner in ``submissions`` on ``stages`` (``stage5,stage6``)
    into ``out``; ``limits`` are ``Limits.from_env`` overrides; ``regrade`` the ``--regrade`` values."""
    from grader import stages as all_stages
    try:
        chosen = [all_stages.find(name) for name in stages.split(",")]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    limits = Limits.from_env(jobs=jobs or os.cpu_count() or 1, **(limits or {}))
    return run(Path(submissions), chosen, Path(out), jobs=jobs, limits=limits, seed=seed, regrade=regrade)
