"""``python -m grader`` with no stage: one line per stage, grading the ones you have started.

Results are cached by content in ``.grader-cache/progress/``: a stage whose files, and the
grader's own code, are unchanged since it was last graded on this machine, by this view or by
``python -m grader stageN`` (all its checks, the default limits), is shown from the cache at once
(with the seed it was graded with).  The cache only speeds up this view: ``python -m grader stageN``
always grades afresh, and so do batches and Gradescope.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

from kernels import loader, runtime, solution_file

from grader import COMMAND, edition_info, stages
from grader.grade import grade_stage
from grader.results import StageResult, format_result, score_line

CACHE = loader.ROOT / ".grader-cache" / "progress"


def _code_version() -> str:
    """A digest of the grader's and the kernels' code: a change to either makes every cached result stale."""
    digest = hashlib.sha256()
    for folder in ("grader", "kernels"):
        for path in sorted((loader.ROOT / folder).rglob("*.py")):
            digest.update(str(path.relative_to(loader.ROOT)).encode() + path.read_bytes())
    return digest.hexdigest()


def _key(stage, source: str, version: str) -> str:
    folder = loader.source_dir(source)
    digest = hashlib.sha256(f"{version}\n{runtime.describe()}\n{stage.name}\n".encode())
    for name in stage.files():
        path = folder / name
        data = path.read_bytes() if path.exists() else b"<missing>"
        if solution_file.has_given_code(data.decode(errors="replace")):
            data = solution_file.expand_file(path).encode()    # what runs: an earlier stage's edit counts too
        digest.update(name.encode() + data)
    return digest.hexdigest()[:32]


def _cached(key: str) -> StageResult | None:
    try:
        return StageResult.from_dict(json.loads((CACHE / f"{key}.json").read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def _store(key: str, result: StageResult) -> None:
    try:
        CACHE.mkdir(parents=True, exist_ok=True)
        tmp = CACHE / f".{key}.tmp"
        tmp.write_text(json.dumps(result.to_dict()))
        tmp.replace(CACHE / f"{key}.json")
    except OSError:
        pass                          # a read-only checkout: no cache, same results


def key_of(stage, source: str) -> str:
    """The cache key of ``stage``'s files in ``source`` now; taken before grading, so an edit made while
    a grading runs is never paired with its result."""
    return _key(stage, source, _code_version())


def remember(key: str, result: StageResult) -> None:
    """Keep the result of ``python -m grader stageN`` for this view (a stage not started needs none)."""
    if result.status != "not started":
        _store(key, result)


def _grade(stage, source: str, version: str, *, use_cache: bool, out) -> tuple[StageResult, bool]:
    key = _key(stage, source, version)
    if use_cache and (hit := _cached(key)) is not None:
        return hit, True
    path = loader.source_dir(source) / f"{stage.module}.py"
    if not path.exists() or (source != "solutions" and solution_file.is_untouched(path)):
        return grade_stage(stage, source), False          # not started: nothing runs
    checks = stage.checks()
    start = time.monotonic()
    print(f"  grading {stage.name} ({len(checks)} checks) ", end="", file=out, flush=True)

    def tick(result):
        print("." if result.status == "pass" else result.status[0].upper(), end="", file=out, flush=True)

    result = grade_stage(stage, source, on_result=tick)
    print(f" {time.monotonic() - start:.0f} s", file=out, flush=True)
    if result.status != "not started":
        _store(key, result)
    return result, False


def _state(result: StageResult) -> tuple[str, bool]:
    """The stage's line in the table, and whether the stage is done."""
    if result.status == "not started":
        return "not started", False
    if result.status == "import error":
        return "does not import", False
    text = score_line(result).replace("score ", "", 1).replace(" (the points that run here)", " points")
    return text + ("  done" if result.ok else ""), result.ok


def main(*, solutions: bool = False, fresh: bool = False) -> int:
    """``python -m grader``: progress over every stage of stages/ (or ``solutions``), re-graded if ``fresh``."""
    from grader import doctor
    if not doctor.guard(None)[0]:   # a platform the grader cannot run on: say where it can
        return 2
    return progress(source="solutions" if solutions else "stages", use_cache=not fresh)


def progress(source: str = "stages", *, use_cache: bool = True, out=None) -> int:
    out = out or sys.stdout
    print(f"Flash Attention Workbook: progress ({source}/) on {runtime.describe()}", file=out, flush=True)
    print(edition_info.describe(), file=out, flush=True)
    version = _code_version()
    rows, details, ok, cached = [], [], True, 0
    for stage in stages.STAGES:
        result, hit = _grade(stage, source, version, use_cache=use_cache, out=out)
        cached += hit
        state, done = _state(result)
        if result.status != "not started" and not done:
            ok = False
            details.append(format_result(stage, result))
        rows.append((stage, result, state, done))
    print(file=out)
    for stage, _, state, _ in rows:
        print(f"  {stage.name:<7} {stage.title:<66} {state}", file=out)
    if cached:
        print(f"  ({cached} stage(s) unchanged since they were last graded here: shown from .grader-cache/; "
              f"{COMMAND} stageN grades afresh)", file=out)
    if details:
        print("\n" + "\n\n".join(details), file=out)
    if note := edition_info.pending_note():
        print("\n" + note, file=out)
    print("\n" + next_step(rows), file=out)
    return 0 if ok else 1


def next_step(rows) -> str:
    """What to do next: the first stage not done, its notebook, and the command that grades it."""
    for stage, result, _, done in rows:
        if done:
            continue
        notebook = f"notebooks/{stage.notebook}"
        if result.status == "not started":
            return (f"next: {stage.name} ({stage.title}): open {notebook}, fill in the TODOs of "
                    f"stages/{stage.module}.py, then run: {COMMAND} {stage.name}")
        shown = [r for r in result.results if not r.hidden]
        todo = sum(r.status == "todo" for r in shown)
        wrong = sum(r.status not in ("pass", "todo", "not run") for r in shown)
        parts = ([f"fill in what the {todo} todo check(s) above name"] if todo else []) + \
                ([f"fix the {wrong} failing check(s) above"] if wrong else [])
        what = "fix the import error above" if result.status == "import error" else (
            " and ".join(parts) or "see the hidden checks' line above")
        return f"next: {stage.name}: {what} ({notebook} explains it), then run: {COMMAND} {stage.name}"
    return f"every stage is done here. On a GPU, {COMMAND} runs the GPU checks too"
