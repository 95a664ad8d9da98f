"""python -m grader: progress, grading, release, batches.

    python -m grader                     progress over every stage
    python -m grader stage3              grade your stages/stage3_flash_forward.py
    python -m grader stage3 --solutions  grade the reference solution instead
    python -m grader stage3 --notebook   also run notebooks/03_flash_forward.ipynb with nbval
    python -m grader stage3 --list       the stage's checks, their points, which need a GPU
    python -m grader stage3 --help       what stage 3's grading checks, and how to run part of it
    python -m grader release             regenerate stages/ from solutions/ (keeps your edits)
    python -m grader release --check     are stages/ and solutions/ in sync?
    python -m grader doctor              what runs on this machine, what does not, and how to fix it
    python -m grader bench stage5        time stage 5's reference kernel against SDPA and FlexAttention
                                         (needs a GPU; all: every stage; --learner: your stages/ file)

For instructors:

    python -m grader sweep stage3 --seeds 200
                                         grade the reference on 200 seeds; the worst margin of each check

    python -m grader stage5,stage6 --submission DIR --format gradescope --out results.json
                                         grade a submission's stage files (DIR, or DIR/stages)
    python -m grader batch SUBMISSIONS --stages stage5,stage6 --out OUT
                                         grade a class: OUT/gradebook.csv, OUT/<learner>/results.json
    python -m grader release --to DIR [--through stage3]
                                         the learner's edition: no solutions, no hidden checks;
                                         run again on DIR to update it without touching learners' edits
    python -m grader publish stage2 --to DIR
                                         add stage 2's reference solution, note and notebook to an edition
    python -m grader release --to DIR --autograder stage5,stage6
                                         a Gradescope autograder (and DIR.zip)

In a learner's edition:

    python -m grader stage3 --compare    grade, then your code beside the published reference, hole by hole
    python -m grader update --from DIR   take a newer edition in; your edited files stay, new versions
                                         go beside them as <name>.new
    python -m grader stage3 --sanitize --only CHECK
                                         run a check under compute-sanitizer (needs a GPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "release":
        return _release(argv[1:])
    if argv and argv[0] == "batch":
        from grader import batch
        return batch.main(argv[1:])
    if argv and argv[0] == "publish":
        return _publish(argv[1:])
    if argv and argv[0] == "update":
        return _update(argv[1:])
    if argv[:2] == ["bench", "report"]:
        from grader.bench import report as bench_report
        return bench_report.main(argv[2:])
    if argv and argv[0] == "bench":
        from grader import bench
        return bench.main(argv[1:])
    if argv and argv[0] == "sweep":
        from grader.testing import sweep
        return sweep.main(argv[1:])
    if argv and argv[0] == "doctor":
        from grader import doctor
        return doctor.main(argv[1:])
    from grader.limits import Limits, add_limit_options, limit_overrides
    from grader.sandbox import add_isolation_option, use_isolation_option
    parser = argparse.ArgumentParser(prog="python -m grader", description=_description(argv),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", nargs="?", help="stage to grade: stage1 ..., or several: stage5,stage6 "
                                                 "(omit for progress over all)")
    parser.add_argument("--solutions", action="store_true", help="grade solutions/ instead of stages/")
    parser.add_argument("--fresh", action="store_true", help="progress view: grade every started stage again, "
                                                             "not from the cache of unchanged ones")
    parser.add_argument("--submission", metavar="DIR", help="grade the stage files in DIR (or DIR/stages) instead")
    parser.add_argument("--notebook", action="store_true", help="also run the stage's notebook with nbval")
    parser.add_argument("--only", action="append", metavar="CHECK",
                        help="run only this check (repeatable; --list names them)")
    parser.add_argument("--list", action="store_true", help="list the stage's checks, their points and what "
                                                            "they need, and run nothing")
    parser.add_argument("--format", choices=("table", "json", "gradescope"), default="table",
                        help="table (default); json: every result, hidden checks by name; gradescope: "
                             "results.json for Gradescope, hidden checks folded into one line")
    parser.add_argument("--out", metavar="FILE", help="with --format json or gradescope: write there, whole")
    parser.add_argument("--sanitize", action="store_true", help="run under compute-sanitizer memcheck (GPU)")
    parser.add_argument("--compare", action="store_true",
                        help="after grading, show your code beside the published reference, hole by hole")
    add_isolation_option(parser)
    add_limit_options(parser)
    args = parser.parse_args(argv)
    use_isolation_option(args)
    if args.solutions and args.submission:
        parser.error("--solutions and --submission choose different files: give one")
    if args.out and args.format == "table":
        parser.error("--out goes with --format json or --format gradescope")

    from grader import doctor, stages
    if args.stage is None:
        if not doctor.guard(None)[0]:   # a platform the grader cannot run on: say where it can
            return 2
        from grader.progress import progress
        return progress(source="solutions" if args.solutions else "stages", use_cache=not args.fresh)
    try:
        chosen = [stages.find(name) for name in args.stage.split(",")]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.list:
        for stage in chosen:
            print(_check_list(stage))
        return 0
    if args.only:
        names = {c.name for stage in chosen for c in stage.checks()}
        unknown = [name for name in args.only if name not in names]
        if unknown:
            listing = "\n".join(_check_list(stage) for stage in chosen)
            print(f"no check named {', '.join(map(repr, unknown))} in {args.stage}; the checks are:\n{listing}",
                  file=sys.stderr)
            return 2
    go, chosen = doctor.guard(chosen)   # without Triton: only the stages that need none
    if not go:
        return 2
    from kernels.loader import ROOT
    if args.solutions and not (ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/ (it is a learner's copy): there is no reference "
              "solution to grade")
        return 0
    from grader import sanitize
    if args.sanitize and not os.environ.get(sanitize.ENV):
        return sanitize.relaunch(argv)
    from grader.grade import grade_stage, print_result, submission_folder
    limits = Limits.from_env(**limit_overrides(args))
    table = args.format == "table"
    graded = []
    for stage in chosen:
        if args.submission:
            source = str(submission_folder(args.submission, stage))
        else:
            source = "solutions" if args.solutions else "stages"
        print(f"grading {stage.name} ({source}/{stage.module}.py) ...", file=sys.stdout if table else sys.stderr,
              flush=True)
        result = grade_stage(stage, source, only=args.only, limits=limits)
        if table:
            print_result(stage, result)
        if args.compare:
            from grader.publishing.compare import compare
            from kernels.loader import source_dir
            print("\n" + compare(stage, result, source_dir(source)), flush=True)
        graded.append((stage, result))
    ok = all(result.ok for _, result in graded)
    if not table:
        from grader import formats
        from grader.publishing import edition
        notes = [f"Graded by {edition.describe()}."] + edition.version_notes(args.submission)
        data = formats.gradescope(graded, notes) if args.format == "gradescope" else formats.detail(graded)
        text = json.dumps(data, indent=1) + "\n"
        if args.out:
            formats.write_atomic(args.out, text)
        else:
            sys.stdout.write(text)
    if args.notebook:
        from grader.notebook import run_notebook
        for stage, result in graded:
            ok = run_notebook(stage, result.source) and ok
    return 0 if ok else 1


def _check_list(stage) -> str:
    """A stage's checks, one a line: name, points, whether it needs a GPU, and what it checks."""
    from kernels import runtime
    shown = [c for c in stage.checks() if not c.hidden]
    hidden = [c for c in stage.checks() if c.hidden]
    width = max(len(c.name) for c in shown)
    lines = [f"{stage.name} ({stage.module}.py, notebook {stage.notebook}): {stage.title}",
             f"  {'check':<{width}}  points  runs on     checks"]
    for c in shown:
        needs = "GPU only" if c.gpu else "CPU or GPU"
        note = " (bad input: counts once the code it calls is written)" if c.validation else ""
        lines.append(f"  {c.name:<{width}}  {c.points:>6}  {needs:<10}  {c.doc.rstrip('.')}{note}")
    here = sum(c.points for c in shown + hidden if runtime.ON_GPU or not c.gpu)
    total = sum(c.points for c in shown + hidden)
    if hidden:
        lines.append(f"  and {len(hidden)} hidden check(s), {sum(c.points for c in hidden)} points")
    lines.append(f"  {total} points; {here} of them run on this machine ({runtime.describe()})")
    return "\n".join(lines)


def _description(argv: list[str]) -> str:
    """The help text; ``python -m grader stage3 --help`` adds what stage 3's grading checks."""
    if not any(a in ("-h", "--help") for a in argv):
        return __doc__
    from grader import stages
    named = [a for a in argv if not a.startswith("-")]
    try:
        chosen = [stages.find(n) for n in named[0].split(",")] if named else []
    except ValueError:
        chosen = []
    if not chosen:
        return __doc__
    parts = []
    for stage in chosen:
        parts.append(f"Grade {stage.name}: stages/{stage.module}.py, with notebooks/{stage.notebook} beside it.\n\n"
                     f"    python -m grader {stage.name}                 every check below\n"
                     f"    python -m grader {stage.name} --only CHECK    one of them (repeatable)\n"
                     f"    python -m grader {stage.name} --notebook      also run the notebook against your file\n"
                     f"    WORKBOOK_SEED=N python -m grader {stage.name} repeat the inputs of a run (its seed is "
                     "printed)\n\n" + _check_list(stage))
    return "\n\n".join(parts) + "\n\nStatuses: pass, FAIL (a wrong answer, its most likely cause first), todo (a " \
        "TODO still as released), crash, timeout, not run (needs a GPU or a tool)."


def _release(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader release",
                                     description="Regenerate stages/ from solutions/.")
    parser.add_argument("--check", action="store_true", help="only say whether stages/ is in sync")
    parser.add_argument("--force", action="store_true",
                        help="overwrite files you edited (a backup goes to stages/.backup/)")
    parser.add_argument("--to", metavar="DIR", help="write the learner's bundle into DIR (a new folder): stages, "
                                                    "notebooks, kernels, grader and tests; no solutions, no hidden checks")
    parser.add_argument("--autograder", metavar="STAGES", help="with --to: a Gradescope autograder for these "
                                                               "stages (stage5,stage6), hidden checks kept, and DIR.zip")
    parser.add_argument("--through", metavar="STAGE", help="with --to: ship stages 1..STAGE only (stage N+1's file "
                                                           "holds stage N's answers as given code)")
    args = parser.parse_args(argv)
    from grader.publishing import release
    if (args.autograder or args.through) and not args.to:
        parser.error("--autograder and --through go with --to DIR")
    if not (release.ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/ (it is a learner's copy): its stages/ came with it, "
              "and there is nothing to release")
        return 0
    if args.to:
        from grader.publishing import bundle
        try:
            bundle.build(args.to, autograder=args.autograder.split(",") if args.autograder else None,
                         through=args.through)
        except (bundle.BundleError, ValueError) as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    if args.check:
        stale = release.check()
        if stale:
            print("stages/ is out of sync with solutions/ for: " + ", ".join(stale))
            print("run: python -m grader release")
            return 1
        print("stages/ is in sync with solutions/")
        return 0
    kept = release.release(force=args.force)
    return 1 if kept else 0


def _publish(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader publish",
                                     description="Add reference solutions, their notes and notebooks to a learner's "
                                                 "edition, stage by stage.")
    parser.add_argument("stages", help="the stages to publish: stage2 or stage2,stage3")
    parser.add_argument("--to", metavar="DIR", required=True, help="the learner's edition (made by release --to)")
    args = parser.parse_args(argv)
    from grader.publishing import publish
    try:
        publish.publish(args.to, args.stages.split(","))
    except (publish.PublishError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def _update(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader update",
                                     description="Bring a newer edition into this copy: files you did not change are "
                                                 "replaced, files you changed stay and the new version goes beside "
                                                 "them as <name>.new.")
    parser.add_argument("--from", dest="source", metavar="DIR", required=True, help="the newer edition's folder")
    args = parser.parse_args(argv)
    from pathlib import Path

    from grader.publishing import edition
    from kernels.loader import ROOT
    new = edition.read(Path(args.source))
    if new is None:
        print(f"{args.source} holds no edition ({edition.MANIFEST})", file=sys.stderr)
        return 2
    mine = edition.read(ROOT)
    if mine is None:
        print("this copy is not a learner's edition (no edition.json): nothing to update", file=sys.stderr)
        return 2
    wanted = {rel: data for rel, data in edition.on_disk(Path(args.source), new).items()
              if rel in new["files"]}
    changes = edition.write(ROOT, wanted, {k: v for k, v in new.items() if k != "files"})
    print(f"edition {mine['version']} -> {new['version']}: {len(changes)} change(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
