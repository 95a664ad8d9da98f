"""``python -m grader stage3`` (or ``stage5,stage6``): grade stages, and say what each one checks.

``main`` grades the stages named and prints a table per stage (or the JSON of every result, or
Gradescope's ``results.json``), then, when asked, the learner's code beside the published
reference and the stage's notebook run against it.  ``check_list`` and ``stage_help`` are the
texts of ``--list`` and ``--help``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def main(stage_names: str, *, solutions: bool = False, submission: str | None = None, notebook: bool = False,
         only: list[str] | None = None, list_checks: bool = False, format: str = "table", out: str | None = None,
         sanitize: bool = False, compare: bool = False, limits: dict | None = None, jobs: int | None = None,
         argv: list[str] | None = None) -> int:
    """Grade ``stage_names`` (``"stage3"`` or ``"stage5,stage6"``); 0 only when everything that ran passed,
    3 when the grader itself failed (no isolation mechanism, an error of its own): nothing was graded.

    ``solutions``: grade solutions/ instead of stages/; ``submission``: the stage files in that folder (or
    its stages/); ``only``: these checks; ``list_checks``: list the checks and run nothing; ``format``:
    ``table``, ``json`` or ``gradescope``, written to ``out`` (a file) or printed; ``sanitize``: run again
    under compute-sanitizer with the command line ``argv``; ``limits``: ``Limits.from_env`` overrides.
    """
    from grader import doctor, stages
    try:
        chosen = [stages.find(name) for name in stage_names.split(",")]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if list_checks:
        for stage in chosen:
            print(check_list(stage))
        return 0
    if only:
        names = {c.name for stage in chosen for c in stage.checks()}
        unknown = [name for name in only if name not in names]
        if unknown:
            listing = "\n".join(check_list(stage) for stage in chosen)
            print(f"no check named {', '.join(map(repr, unknown))} in {stage_names}; the checks are:\n{listing}",
                  file=sys.stderr)
            return 2
    go, chosen = doctor.guard(chosen)   # without Triton: only the stages that need none
    if not go:
        return 2
    from kernels.loader import ROOT
    if solutions and not (ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/ (it is a learner's copy): there is no reference "
              "solution to grade")
        return 0
    from grader import sanitize as sanitizer
    if sanitize and not os.environ.get(sanitizer.ENV):
        return sanitizer.relaunch(sys.argv[1:] if argv is None else argv)
    from grader import progress
    from grader.grade import default_jobs, grade_stage, submission_folder
    from grader.isolation.limits import Limits
    from grader.results import print_result
    jobs = jobs or default_jobs()
    overrides = any(v is not None for v in (limits or {}).values())
    limits = Limits.from_env(jobs=jobs, **(limits or {}))
    table = format == "table"
    graded, failed = [], ""
    for stage in chosen:
        if submission:
            source = str(submission_folder(submission, stage))
        else:
            source = "solutions" if solutions else "stages"
        print(f"grading {stage.name} ({source}/{stage.module}.py) ...", file=sys.stdout if table else sys.stderr,
              flush=True)
        key = progress.key_of(stage, source) if source in ("stages", "solutions") and not (only or overrides) else None
        try:
            result = grade_stage(stage, source, only=only, limits=limits, jobs=jobs)
        except Exception as exc:  # the grader's own failure: reported as one, never as a score
            if table:
                raise
            traceback.print_exc()
            failed = f"grading {stage.name} stopped on an error of the grader's: {type(exc).__name__}: {exc}"
            break
        if key and result.status != "not graded":
            progress.remember(key, result)     # the progress view shows it while the files stay as graded
        if result.status == "not graded":         # the grader could not run the checks (no isolation)
            failed = failed or f"{stage.name} was not graded: {result.results[0].message if result.results else ''}"
        if table:
            print_result(stage, result)
        if compare:
            from kernels.loader import source_dir

            from grader.compare import compare as side_by_side
            print("\n" + side_by_side(stage, result, source_dir(source)), flush=True)
        graded.append((stage, result))
    ok = all(result.ok for _, result in graded)
    if failed:
        print(f"the grader failed, so nothing was graded: {failed}", file=sys.stderr, flush=True)
    if not table:
        from grader import edition_info, formats
        notes = [f"Graded by {edition_info.describe()}."] + edition_info.version_notes(submission)
        if failed:     # no score, and for a batch no result: its record says the grading failed, and it retries
            data = (formats.gradescope_failure(failed, [f"The grader: {edition_info.describe()}."])
                    if format == "gradescope" else {"error": failed})
        else:
            data = formats.gradescope(graded, notes) if format == "gradescope" else formats.detail(graded)
        text = json.dumps(data, indent=1) + "\n"
        if out:
            formats.write_atomic(out, text)
        else:
            sys.stdout.write(text)
    if failed:
        return 3
    if notebook:
        from grader.notebook import run_notebook
        for stage, result in graded:
            ok = run_notebook(stage, result.source) and ok
    return 0 if ok else 1


def check_list(stage) -> str:
    """A stage's checks, one a line: name, points, whether it needs a GPU, and what it checks."""
    from kernels import runtime
    shown = [c for c in stage.checks() if not c.hidden]
    hidden = [c for c in stage.checks() if c.hidden]
    width = max(len(c.name) for c in shown)
    lines = [f"{stage.name} ({stage.module}.py, notebook {stage.notebook}): {stage.title}",
             f"  {'check':<{width}}  points  runs on     checks"]
    for c in shown:
        needs = "GPU only" if c.gpu else "CPU or GPU"
        note = (" (bad input: counts once the code it calls is written)" if c.validation else
                " (given code passes it: counts once the TODOs it exercises are filled)" if c.given else "")
        lines.append(f"  {c.name:<{width}}  {c.points:>6}  {needs:<10}  {c.doc.rstrip('.')}{note}")
    here = sum(c.points for c in shown + hidden if runtime.ON_GPU or not c.gpu)
    total = sum(c.points for c in shown + hidden)
    if hidden:
        points = sum(c.points for c in hidden)
        lines.append(f"  and {len(hidden)} hidden check{'s' if len(hidden) != 1 else ''}, "
                     f"{points} point{'s' if points != 1 else ''}")
    lines.append(f"  {total} points; {here} of them run on this machine ({runtime.describe()})")
    return "\n".join(lines)


def stage_help(stage_names: str) -> str:
    """What ``python -m grader stage3 --help`` says before its options: how to run it, and its checks."""
    from grader import COMMAND, stages
    parts = []
    for stage in (stages.find(name) for name in stage_names.split(",")):
        parts.append(f"Grade {stage.name}: stages/{stage.module}.py, with notebooks/{stage.notebook} beside it.\n\n"
                     f"    {COMMAND} {stage.name}                 every check below\n"
                     f"    {COMMAND} {stage.name} --only CHECK    one of them (repeatable)\n"
                     f"    {COMMAND} {stage.name} --notebook      also run the notebook against your file\n"
                     f"    WORKBOOK_SEED=N {COMMAND} {stage.name} repeat the inputs of a run (its seed is "
                     "printed)\n\n" + check_list(stage))
    return "\n\n".join(parts) + "\n\nStatuses: pass, FAIL (a wrong answer, its most likely cause first), todo (a " \
        "TODO still as released), crash, timeout, not run (needs a GPU or a tool)."
