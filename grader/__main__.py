"""python -m grader: progress, grading, release, batches.

Each command is also ./workbook COMMAND, the grader under .venv's Python with nothing to activate
(the command the learner's messages print); python -m grader started from a Python without the
workbook's packages starts again under .venv's.

    python -m grader                     progress over every stage
    python -m grader stage3              grade your stages/stage3_flash_forward.py
    python -m grader stage3 --solutions  grade the reference solution instead
    python -m grader stage3 --notebook   also run notebooks/03_flash_forward.ipynb with nbval
    python -m grader stage3 --list       the stage's checks, their points, which need a GPU
    python -m grader --list              every stage's checks
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
    python -m grader release --to DIR --through stage3 [--repo OWNER/NAME]
                                         the learner's edition of stages 1-3: no solutions, no hidden
                                         checks, its notebooks opening on Colab from OWNER/NAME; run
                                         again on DIR to update it without touching learners' edits
    python -m grader publish stage2 --to DIR
                                         add stage 2's reference solution, note and notebook to an edition
    python -m grader release --to DIR --autograder stage5,stage6
                                         a Gradescope autograder (and DIR.zip)

In a learner's edition:

    python -m grader stage3 --compare    grade, then your code beside the published reference, hole by hole
    python -m grader update --from DIR   take a newer edition in; your edited files stay, new versions
                                         go beside them as <name>.new
    python -m grader update --merge FILE merge FILE.new into your FILE (a three-way merge; yours is backed up)
    python -m grader stage3 --sanitize --only CHECK
                                         run a check under compute-sanitizer (needs a GPU)

This module only parses: each command is the ``main`` of its module, called with keyword options
(grader/grade_stages.py, grader/progress.py, grader/batch.py, grader/doctor.py,
grader/publishing/, grader/bench/, grader/testing/sweep.py).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path

STAGE_NAMES = [f"stage{n}" for n in range(1, 10)]
COMMANDS = (*STAGE_NAMES, "grade", "release", "publish", "update", "batch", "bench", "sweep", "doctor")


class _Parser(argparse.ArgumentParser):
    """A parser whose description is computed only when its help is shown (importing the checks of a
    stage, or torch, to build a help text nobody asked for would slow every command)."""

    def __init__(self, *args, describe=None, **kwargs):
        super().__init__(*args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
        self._describe = describe

    def format_help(self) -> str:
        if self._describe is not None:
            self.description = self._describe()
        return super().format_help()


def _doc(module: str):
    return lambda: importlib.import_module(module).__doc__


def _stage_help(name: str):
    return lambda: importlib.import_module("grader.grade_stages").stage_help(name)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of milliseconds, got {text}")
    return value


def _add_grading_options(p, *, limits: bool = True) -> None:
    from grader.isolation.choice import add_isolation_option
    from grader.isolation.limits import add_limit_options
    add_isolation_option(p)
    if limits:
        add_limit_options(p)


def _add_stage_options(p) -> None:
    """The options of ``python -m grader stageN`` (and of several stages: ``stage5,stage6``)."""
    p.add_argument("--solutions", action="store_true", help="grade solutions/ instead of stages/")
    p.add_argument("--submission", metavar="DIR", help="grade the stage files in DIR (or DIR/stages) instead")
    p.add_argument("--notebook", action="store_true",
                   help="also run the stage's notebook with nbval, as you, outside the sandbox (so not with "
                        "--submission)")
    p.add_argument("--only", action="append", metavar="CHECK",
                   help="run only this check (repeatable; --list names them)")
    p.add_argument("--list", action="store_true", dest="list_checks",
                   help="list the stage's checks, their points and what they need, and run nothing")
    p.add_argument("--format", choices=("table", "json", "gradescope"), default="table",
                   help="table (default); json: every result, hidden checks by name; gradescope: results.json for "
                        "Gradescope, hidden checks folded into one line")
    p.add_argument("--out", metavar="FILE", help="with --format json or gradescope: write there, whole")
    p.add_argument("--sanitize", action="store_true", help="run under compute-sanitizer memcheck (GPU)")
    p.add_argument("--compare", action="store_true",
                   help="after grading, show your code beside the published reference, hole by hole")
    p.add_argument("--jobs", type=_positive_int, metavar="N",
                   help="worker processes that take the checks in turn (default: $WORKBOOK_JOBS, else one per two "
                        "cores, at most 4)")
    _add_grading_options(p)
    p.set_defaults(command="grade", parser=p)


def parser() -> argparse.ArgumentParser:
    """The one parser: ``python -m grader`` alone is the progress view; every other command is a subcommand."""
    top = _Parser(prog="python -m grader", description=__doc__)
    top.add_argument("--solutions", action="store_true", help="progress view: over solutions/ instead of stages/")
    top.add_argument("--fresh", action="store_true", help="progress view: grade every started stage again, not "
                                                          "from the cache of unchanged ones")
    top.add_argument("--list", action="store_true", dest="list_checks",
                     help="list every stage with its checks, their points and what they need, and run nothing")
    top.set_defaults(command="progress")
    sub = top.add_subparsers(title="commands", metavar="COMMAND")

    for name in STAGE_NAMES:
        p = sub.add_parser(name, help=f"grade {name} (--help: its checks)", describe=_stage_help(name))
        p.set_defaults(stages=name)
        _add_stage_options(p)
    p = sub.add_parser("grade", help="grade several stages: grade stage5,stage6 (or just: stage5,stage6)",
                       description="Grade several stages, one table each: python -m grader stage5,stage6.")
    p.add_argument("stages", help="the stages, comma-separated: stage5,stage6")
    _add_stage_options(p)

    p = sub.add_parser("release", help="regenerate stages/ from solutions/, or make an edition (--to)",
                       describe=_doc("grader.publishing.release"))
    p.add_argument("--check", action="store_true", dest="check_only", help="only say whether stages/ is in sync")
    p.add_argument("--force", action="store_true", help="overwrite files you edited (a backup goes to stages/.backup/)")
    p.add_argument("--to", metavar="DIR", help="write the learner's bundle into DIR (a new folder): stages, "
                                               "notebooks, kernels, grader and tests; no solutions, no hidden checks")
    p.add_argument("--autograder", metavar="STAGES", help="with --to: a Gradescope autograder for these stages "
                                                          "(stage5,stage6), hidden checks kept, and DIR.zip")
    p.add_argument("--through", metavar="STAGE", help="with --to: ship stages 1..STAGE only (stage N+1's file "
                                                      "holds stage N's answers as given code); a new learner's "
                                                      "edition needs it (stage9: all nine)")
    p.add_argument("--repo", metavar="OWNER/NAME", help="with --to: the edition's GitHub repository, which the "
                                                        "notebooks' Colab badges and set-up cells open (default: "
                                                        "DIR's git remote origin on GitHub)")
    p.set_defaults(command="release", parser=p)

    p = sub.add_parser("publish", help="add reference solutions to a learner's edition, stage by stage",
                       describe=_doc("grader.publishing.publish"))
    p.add_argument("stages", help="the stages to publish: stage2 or stage2,stage3")
    p.add_argument("--to", metavar="DIR", required=True, help="the learner's edition (made by release --to)")
    p.set_defaults(command="publish")

    p = sub.add_parser("update", help="take a newer edition into this copy; your edited files stay",
                       describe=_doc("grader.publishing.update"))
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--from", dest="source", metavar="DIR", help="the newer edition's folder")
    what.add_argument("--merge", metavar="FILE", help="merge FILE.new, the version update put beside your changed "
                                                      "FILE, into FILE (yours is backed up first)")
    p.set_defaults(command="update")

    p = sub.add_parser("batch", help="grade a class of submissions: a gradebook and each learner's results",
                       describe=_doc("grader.batch"))
    p.add_argument("submissions", help="a folder with one folder (or .zip) per learner")
    p.add_argument("--stages", required=True, help="stages to grade, comma-separated: stage5,stage6")
    p.add_argument("--out", required=True, help="where the gradebook and results go")
    p.add_argument("--jobs", type=int, help="gradings at once (default: the machine's cores)")
    p.add_argument("--seed", type=int, help="the inputs' seed (default: random, then kept in OUT/batch.json; "
                                            "another one than OUT/batch.json's needs --regrade all)")
    p.add_argument("--regrade", action="append", metavar="LEARNER[/STAGE]",
                   help="grade again, whatever its record says: one learner, one learner's stage, or all "
                        "(repeatable)")
    _add_grading_options(p)
    p.set_defaults(command="batch")

    _add_bench(sub)

    p = sub.add_parser("sweep", help="grade the reference on many seeds: the worst margin of each check",
                       describe=_doc("grader.testing.sweep"))
    p.add_argument("stages", metavar="stage", help="stage(s) to sweep: stage3, or stage1,stage2")
    p.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    p.add_argument("--first-seed", type=int, default=0, help="the first seed (default 0)")
    p.add_argument("--seed", type=int, action="append", dest="exact_seeds", help="exactly these seeds (repeatable)")
    p.add_argument("--only", action="append", metavar="CHECK", help="only this check (repeatable)")
    p.add_argument("--json", metavar="FILE", help="also write every check's margins there")
    p.add_argument("--jobs", type=int, default=1, help="processes to deal the seeds out to, each with its share of "
                                                       "the cores (default 1; on a GPU too, they share it)")
    p.add_argument("--time-limit", type=_positive_int, metavar="SECONDS",
                   help="start no seed after this long (per stage); the margins are those of the seeds done")
    p.set_defaults(command="sweep")

    p = sub.add_parser("doctor", help="what runs on this machine, what does not, and how to fix it",
                       describe=_doc("grader.doctor"))
    p.set_defaults(command="doctor")
    return top


def _add_bench(sub) -> None:
    """``bench STAGES``, ``bench report FILE``, ``bench train`` and ``bench host``: timing runs on a GPU."""
    bench = sub.add_parser("bench", help="time kernels against PyTorch SDPA and FlexAttention (GPU)",
                           describe=_doc("grader.bench.measure"))
    kinds = bench.add_subparsers(title="what to time", metavar="{STAGES,report,train,host}", required=True)
    # `bench stage5` is `bench time stage5`: see _canonical.
    p = kinds.add_parser("time", help="STAGES: stage5, stage5,stage7 or all (the default command)",
                         describe=_doc("grader.bench.measure"))
    p.add_argument("stages", metavar="stage", help="what to benchmark: stage3 ... stage9, several (stage5,stage7), "
                                                   "or all")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--learner", action="store_true", help="time your stages/ files instead of the reference "
                                                            "solutions/")
    who.add_argument("--solutions", action="store_true", help=argparse.SUPPRESS)   # the default; kept for old commands
    p.add_argument("--providers", metavar="A,B", help="comma-separated providers (default: the stage's list)")
    p.add_argument("--json", metavar="PATH", help="write the rows {stage, case, provider, ms, tflops, peak_mib, "
                                                  "input_mib, note} here")
    p.add_argument("--plot", metavar="PATH", help="save a bar chart (PNG) of TFLOP/s per case and provider here")
    p.add_argument("--rep", metavar="MS", type=_positive_int,
                   help="milliseconds of timed runs per measurement (default 100)")
    p.set_defaults(command="bench")

    p = kinds.add_parser("report", help="the Markdown page of a bench --json file (docs/performance.md)",
                         describe=_doc("grader.bench.report"))
    p.add_argument("json", help="rows written by python -m grader bench --json")
    p.add_argument("--out", help="write the Markdown page here (default: print it)")
    p.add_argument("--device", help="the machine, for a JSON file that does not record it")
    p.add_argument("--software", help="the versions, for a JSON file that does not record them")
    p.set_defaults(command="bench report")

    p = kinds.add_parser("train", help="a gpt-oss-style training step against FlexAttention and SDPA",
                         describe=_doc("grader.bench.train"))
    p.add_argument("--sizes", metavar="A,B", help="comma-separated sizes (default: the small ones)")
    p.add_argument("--providers", metavar="A,B", help="comma-separated providers (default: all)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per provider (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="steps before timing, the compile among them (default 3)")
    p.add_argument("--json", metavar="PATH", help="write (merge) the rows into this JSON file")
    p.set_defaults(command="bench train")

    p = kinds.add_parser("host", help="host time per call of solutions/attention_op's attention (and SDPA's)",
                         describe=_doc("grader.bench.host"))
    p.add_argument("--repeat", type=int, default=1, help="time every case this many times over (default 1)")
    p.add_argument("--json", metavar="PATH", help="write the runs, with the GPU's name, into this JSON file")
    p.set_defaults(command="bench host")


def _canonical(argv: list[str]) -> list[str]:
    """The two shorthands argparse cannot name as subcommands.  Stages as the command: ``stage5,stage6``
    (or ``3``, or a stage's module name) is ``grade stage5,stage6``, whose error lists the stages when
    one is unknown; and the stages after bench: ``bench stage5`` is ``bench time stage5``."""
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        return ["grade", *argv]
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] not in ("report", "train", "host", "time", "-h", "--help"):
        return ["bench", "time", *argv[1:]]
    return argv


def _parse(argv: list[str]) -> argparse.Namespace:
    """The options of the command line, checked as a whole; argparse's SystemExit when they are wrong."""
    args = parser().parse_args(_canonical(argv))
    if args.command == "grade":
        from grader import BATCH_OUT_ENV, BATCH_SUBMISSION_ENV
        if args.submission is None and os.environ.get(BATCH_SUBMISSION_ENV):     # a batch's grading
            args.submission = os.environ[BATCH_SUBMISSION_ENV]
            args.out = args.out or os.environ.get(BATCH_OUT_ENV)
        if args.solutions and args.submission:
            args.parser.error("--solutions and --submission choose different files: give one")
        if args.submission:         # a folder named by the person typing: relative to where they are
            args.submission = os.path.abspath(args.submission)
        if args.notebook and args.submission:
            from grader.notebook import refusal
            why = refusal(args.submission, args.isolation)
            if why:
                args.parser.error(why)
        if args.out and args.format == "table":
            args.parser.error("--out goes with --format json or --format gradescope")
    if args.command == "release" and (args.autograder or args.through or args.repo) and not args.to:
        args.parser.error("--autograder, --through and --repo go with --to DIR")
    return args


_REEXEC = "WORKBOOK_REEXEC"          # set in the environment of the grader started again under .venv's Python


def _venv_python(root: Path) -> Path | None:
    """The Python of the workbook's own environment, ``.venv`` beside grader/, if there is one."""
    for rel in ("bin/python", "Scripts/python.exe"):
        path = root / ".venv" / rel
        if path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def ensure_workbook_python(argv: list[str]) -> None:
    """Run the grader under a Python that has the workbook's packages, or say how to, with no traceback.

    ``python -m grader stage1`` typed without activating .venv starts a Python that has no torch.
    Where the workbook's .venv exists, the same command starts again under .venv's Python (once:
    ``WORKBOOK_REEXEC`` stops a loop when .venv itself is broken); otherwise this prints what to run
    and exits with status 2.  Only looks for torch (``find_spec``), it imports nothing.
    """
    if importlib.util.find_spec("torch") is not None:
        return
    root = Path(__file__).absolute().parent.parent       # not resolved: the folder the grader was found in
    venv = _venv_python(root)
    if venv is not None and not os.environ.get(_REEXEC):
        path = os.environ.get("PYTHONPATH")
        env = dict(os.environ, **{_REEXEC: "1"}, PYTHONPATH=str(root) + (os.pathsep + path if path else ""))
        try:
            os.execve(venv, [str(venv), "-m", "grader", *argv], env)
        except OSError:
            pass                      # cannot start it: say what to do, as when there is no .venv
    from grader import COMMAND
    command = " ".join([COMMAND, *argv])
    if venv is not None:
        why = (f"{venv} has no torch either: the set-up of .venv did not finish. Run  bash setup.sh  again "
               "in the workbook's folder, then:")
    else:
        why = "There is no .venv in the workbook's folder yet. Run  bash setup.sh  there once (it installs them), then:"
    print(f"The workbook's packages (torch, Triton) are not installed for this Python ({sys.executable}).\n"
          f"{why}\n\n    {command}\n\n(./workbook runs the grader with .venv's Python; nothing to activate.)",
          file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ensure_workbook_python(argv)
    try:
        args = _parse(argv)
    except SystemExit as exc:          # argparse printed the usage and the error (or the help)
        return int(exc.code or 0)
    if getattr(args, "isolation", None):
        from grader.isolation.choice import use_isolation_option
        use_isolation_option(args)
    limits = _limits(args)
    command = args.command
    if command == "progress" and args.list_checks:
        from grader import grade_stages, stages
        return grade_stages.main(",".join(s.name for s in stages.STAGES), list_checks=True)
    if command == "progress":
        from grader import progress
        return progress.main(solutions=args.solutions, fresh=args.fresh)
    if command == "grade":
        from grader import grade_stages
        status = grade_stages.main(args.stages, solutions=args.solutions, submission=args.submission,
                                 notebook=args.notebook, only=args.only, list_checks=args.list_checks,
                                 format=args.format, out=args.out, sanitize=args.sanitize, compare=args.compare,
                                 limits=limits, jobs=args.jobs, argv=argv)
        _pending_note(args)
        return status
    if command == "release" and args.to:
        from grader.publishing import bundle
        return bundle.main(to=args.to, autograder=args.autograder, through=args.through, repo=args.repo)
    if command == "release":
        from grader.publishing import release
        return release.main(check_only=args.check_only, force=args.force)
    if command == "publish":
        from grader.publishing import publish
        return publish.main(args.stages, to=args.to)
    if command == "update":
        from grader.publishing import update
        if args.merge:
            return update.merge(args.merge)
        status = update.main(source=args.source)
        from grader import edition_info
        if note := edition_info.pending_note():
            print("\n" + note)
        return status
    if command == "batch":
        from grader import batch
        return batch.main(args.submissions, stages=args.stages, out=args.out, jobs=args.jobs, seed=args.seed,
                          limits=limits, regrade=args.regrade)
    if command == "bench":
        from grader.bench import measure
        return measure.main(args.stages, learner=args.learner, providers=args.providers, json_path=args.json,
                            plot_path=args.plot, rep=args.rep)
    if command == "bench report":
        from grader.bench import report
        return report.main(args.json, out=args.out, device=args.device, software=args.software)
    if command == "bench train":
        from grader.bench import train
        return train.main(sizes=args.sizes, providers=args.providers, steps=args.steps, warmup=args.warmup,
                          json_path=args.json)
    if command == "bench host":
        from grader.bench import host
        return host.main(repeat=args.repeat, json_path=args.json)
    if command == "sweep":
        from grader.testing import sweep
        return sweep.main(args.stages, seeds=args.seeds, first_seed=args.first_seed, exact_seeds=args.exact_seeds,
                          only=args.only, json_path=args.json, jobs=args.jobs, time_limit=args.time_limit)
    from grader import doctor
    return doctor.main()


def _pending_note(args) -> None:
    """After grading a learner's own stages: the files a newer edition waits to be merged into."""
    if args.format != "table" or args.solutions or args.submission or args.list_checks:
        return
    from grader import edition_info
    if note := edition_info.pending_note():
        print("\n" + note)


def _limits(args) -> dict:
    """The limit options given (``Limits.from_env`` overrides), for the commands that take them."""
    if not hasattr(args, "check_timeout"):
        return {}
    from grader.isolation.limits import limit_overrides
    return limit_overrides(args)


if __name__ == "__main__":
    sys.exit(main())
