"""python -m grader: progress, grading, release, batches.

    python -m grader                     progress over every stage
    python -m grader stage3              grade your stages/stage3_flash_forward.py
    python -m grader stage3 --solutions  grade the reference solution instead
    python -m grader stage3 --notebook   also run notebooks/03_flash_forward.ipynb with nbval
    python -m grader release             regenerate stages/ from solutions/ (keeps your edits)
    python -m grader release --check     are stages/ and solutions/ in sync?
    python -m grader doctor              what runs on this machine, what does not, and how to fix it
    python -m grader bench stage5        time stage 5's reference kernel against SDPA and FlexAttention
                                         (needs a GPU; all: every stage; --learner: your stages/ file)

For instructors:

    python -m grader stage5,stage6 --submission DIR --format gradescope --out results.json
                                         grade a submission's stage files (DIR, or DIR/stages)
    python -m grader batch SUBMISSIONS --stages stage5,stage6 --out OUT
                                         grade a class: OUT/gradebook.csv, OUT/<learner>/results.json
    python -m grader release --to DIR    the learner's bundle: no solutions, no hidden checks
    python -m grader release --to DIR --autograder stage5,stage6
                                         a Gradescope autograder (and DIR.zip)
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
    if argv and argv[0] == "bench":
        from grader import bench
        return bench.main(argv[1:])
    if argv and argv[0] == "doctor":
        from grader import doctor
        return doctor.main(argv[1:])
    from grader.limits import Limits, add_limit_options, limit_overrides
    parser = argparse.ArgumentParser(prog="python -m grader", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", nargs="?", help="stage to grade: stage1 ..., or several: stage5,stage6 "
                                                 "(omit for progress over all)")
    parser.add_argument("--solutions", action="store_true", help="grade solutions/ instead of stages/")
    parser.add_argument("--submission", metavar="DIR", help="grade the stage files in DIR (or DIR/stages) instead")
    parser.add_argument("--notebook", action="store_true", help="also run the stage's notebook with nbval")
    parser.add_argument("--only", action="append", metavar="CHECK", help="run only this check (repeatable)")
    parser.add_argument("--format", choices=("table", "json", "gradescope"), default="table",
                        help="table (default); json: every result, hidden checks by name; gradescope: "
                             "results.json for Gradescope, hidden checks folded into one line")
    parser.add_argument("--out", metavar="FILE", help="with --format json or gradescope: write there, whole")
    parser.add_argument("--sanitize", action="store_true", help="run under compute-sanitizer memcheck (GPU)")
    add_limit_options(parser)
    args = parser.parse_args(argv)
    if args.solutions and args.submission:
        parser.error("--solutions and --submission choose different files: give one")
    if args.out and args.format == "table":
        parser.error("--out goes with --format json or --format gradescope")

    from grader import doctor, stages
    if args.stage is None:
        if not doctor.guard(None)[0]:   # a platform the grader cannot run on: say where it can
            return 2
        from grader.progress import progress
        return progress(source="solutions" if args.solutions else "stages")
    try:
        chosen = [stages.find(name) for name in args.stage.split(",")]
    except ValueError as exc:
        print(exc, file=sys.stderr)
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
        graded.append((stage, result))
    ok = all(result.ok for _, result in graded)
    if not table:
        from grader import formats
        data = formats.gradescope(graded) if args.format == "gradescope" else formats.detail(graded)
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
    args = parser.parse_args(argv)
    from grader import release
    if args.autograder and not args.to:
        parser.error("--autograder goes with --to DIR")
    if not (release.ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/ (it is a learner's copy): its stages/ came with it, "
              "and there is nothing to release")
        return 0
    if args.to:
        from grader import bundle
        try:
            bundle.build(args.to, autograder=args.autograder.split(",") if args.autograder else None)
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


if __name__ == "__main__":
    sys.exit(main())
