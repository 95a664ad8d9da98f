"""python -m grader: progress, grading, release.

    python -m grader                     progress over every stage
    python -m grader stage3              grade your stages/stage3_flash_forward.py
    python -m grader stage3 --solutions  grade the reference solution instead
    python -m grader stage3 --notebook   also run notebooks/03_flash_forward.ipynb with nbval
    python -m grader release             regenerate stages/ from solutions/ (keeps your edits)
    python -m grader release --check     are stages/ and solutions/ in sync?
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "release":
        return _release(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m grader", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", nargs="?", help="stage to grade: stage1 ... (omit for progress over all)")
    parser.add_argument("--solutions", action="store_true", help="grade solutions/ instead of stages/")
    parser.add_argument("--notebook", action="store_true", help="also run the stage's notebook with nbval")
    parser.add_argument("--only", action="append", metavar="CHECK", help="run only this check (repeatable)")
    args = parser.parse_args(argv)

    from grader import stages
    if args.stage is None:
        from grader.progress import progress
        return progress(source="solutions" if args.solutions else "stages")
    try:
        stage = stages.find(args.stage)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    from grader.grade import grade_stage, print_result
    source = "solutions" if args.solutions else "stages"
    print(f"grading {stage.name} ({source}/{stage.module}.py) ...", flush=True)
    result = grade_stage(stage, source, only=args.only)
    print_result(stage, result)
    ok = result.ok
    if args.notebook:
        from grader.notebook import run_notebook
        ok = run_notebook(stage, source) and ok
    return 0 if ok else 1


def _release(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader release",
                                     description="Regenerate stages/ from solutions/.")
    parser.add_argument("--check", action="store_true", help="only say whether stages/ is in sync")
    parser.add_argument("--force", action="store_true",
                        help="overwrite files you edited (a backup goes to stages/.backup/)")
    args = parser.parse_args(argv)
    from grader import release
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
