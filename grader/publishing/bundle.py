"""``python -m grader release --to DIR``: the learner's edition, or a Gradescope autograder.

The learner's edition is the workbook made for a learner:

    README.md      written for learners: set-up, the stages shipped, grading, help
    LICENSE, pyproject.toml, setup.sh, workbook, .gitignore, constraints/ (the tested versions)
    kernels/, grader/   the grader without grader/checks/hidden/ (and without Gradescope's files)
    stages/        rendered from solutions/ now (with its .release.json): stages 1..N with
                   ``--through stageN``, every stage without it
    notebooks/     the notebooks of those stages, with no stored outputs
    tests/         the tests that run without solutions/ (not tests/wrong/, whose edits quote them)
    published/     reference solutions, once ``python -m grader publish`` adds them
    edition.json   the version, the source commit, what is shipped and published, and what was
                   written (grader/publishing/edition.py)

The file of stage N+1 holds stage N's answers as given code, so ``--through`` is how a stage's
file waits until the one before it is due; release says which answers each shipped file gives.

``autograder=[stages]`` builds a Gradescope autograder instead: the same files with the hidden
checks kept, Gradescope's ``setup.sh`` and ``run_autograder`` (from grader/gradescope/) at the top,
and ``DIR.zip`` to upload.  Neither ever holds ``solutions/``: a submission is graded against the
float64 reference, which needs no solution.

Before anything is written, ``edition.audit`` searches what would be: no solutions folder, no
wrong solutions, no solution markers, no answers of a stage that is neither published nor given
code in a shipped file, and, in a learner's edition, no hidden check's name.  An edition that
fails the search is not written.  Run on a folder that already holds an edition, release updates
it in place without touching what the learner changed (grader/publishing/edition.py).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from kernels.loader import ROOT
from kernels.solution_file import MANIFEST, manifest_text, sha

from grader import COMMAND, edition_info, stages
from grader.publishing import edition, publish, release

TOP_FILES = ("LICENSE", "pyproject.toml", "setup.sh", "workbook", ".gitignore")
CODE_DIRS = ("kernels", "grader", "constraints")
LEARNER_DOCS = ("platforms.md",)           # docs written for learners; the rest are the instructor's
_JUNK = {"__pycache__", ".ipynb_checkpoints"}
PLACEHOLDER = edition.PLACEHOLDER
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+$")
_GITHUB = re.compile(r"^(?:https://github\.com/|git@github\.com:|ssh://git@github\.com/)"
                     r"([A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+?)(?:\.git)?/?$")


class BundleError(RuntimeError):
    pass


def hidden_check_names() -> set[str]:
    return {c.name for s in stages.STAGES for c in s.checks() if c.hidden}


def _tree(top: Path, *, skip=()) -> dict[str, bytes]:
    found = {}
    for path in sorted(top.rglob("*")):
        rel = path.relative_to(ROOT)
        if path.is_dir() or _JUNK & set(rel.parts) or path.suffix == ".pyc" or path.name.endswith(edition_info.NEW):
            continue
        if any(rel.as_posix().startswith(s) for s in skip):
            continue
        found[rel.as_posix()] = path.read_bytes()
    return found


#: Tests of the instructor's material, which an edition does not ship: docs/training.md and its JSON
#: (bench train), the notebooks' stored outputs and placeholder repository (Colab), grader/gradescope/
#: (setup), and editions made and published from this repository (first hour).
INSTRUCTOR_TESTS = ("test_bench_train.py", "test_colab.py", "test_setup.py", "test_first_hour.py")


def _learner_tests(shipped: list) -> list[Path]:
    """The tests that run without solutions/, less those of the stages an edition does not ship, and less
    those that import a test module the edition does not ship (their helpers would be missing)."""
    later = {f"test_{s.name}.py" for s in stages.ALL if s not in shipped}
    kept = {p.name: p.read_text() for p in (ROOT / "tests").glob("*.py")}
    kept = {name: text for name, text in kept.items()
            if "solutions" not in text and name not in later and name not in INSTRUCTOR_TESTS}
    while True:
        missing = {name for name, text in kept.items()
                   if any(f"{m}.py" not in kept for m in re.findall(r"^\s*(?:from|import) (test_\w+)", text, re.M))}
        if not missing:
            return sorted(ROOT / "tests" / name for name in kept)
        kept = {name: text for name, text in kept.items() if name not in missing}


def collect(shipped: list, *, autograder: list[str] | None = None, published: list[str] = ()) -> dict[str, bytes]:
    """Every file of an edition (relative path -> bytes) shipping the ``shipped`` stages."""
    wanted: dict[str, bytes] = {}
    for name in TOP_FILES:
        if (ROOT / name).is_file():
            wanted[name] = (ROOT / name).read_bytes()
    # The bench's probes time the instructors' kernels in solutions/ (no edition has them), and some
    # hold a kernel written out in full: an edition, an autograder's too, ships none of them.
    skip = ["grader/bench/probes"] + ([] if autograder else ["grader/checks/hidden", "grader/gradescope"])
    later = [f"grader/checks/{s.name}.py" for s in stages.ALL if s not in shipped]   # their checks come with them
    for name in CODE_DIRS:
        wanted.update(_tree(ROOT / name, skip=skip + later))
    for name in LEARNER_DOCS:
        if (ROOT / "docs" / name).is_file():
            wanted[f"docs/{name}"] = (ROOT / "docs" / name).read_bytes()
    for path in _learner_tests(shipped):
        wanted[f"tests/{path.name}"] = path.read_bytes()
    rendered = release.rendered()
    manifest = {}
    for stage in shipped:
        for name in stage.files():
            text = rendered[name]
            wanted[f"stages/{name}"] = text.encode()
            manifest[name] = sha(text)
        wanted[f"notebooks/{stage.notebook}"] = edition.cleared((ROOT / "notebooks" / stage.notebook).read_bytes())
    wanted[f"stages/{MANIFEST}"] = manifest_text(manifest).encode()
    wanted["README.md"] = learner_readme(shipped).encode()
    for name in published:
        wanted.update(publish.files_of(stages.find(name)))
    if autograder:
        for name in ("setup.sh", "run_autograder"):
            text = (ROOT / "grader" / "gradescope" / name).read_text()
            wanted[name] = text.replace("@STAGES@", ",".join(autograder)).encode()
    return wanted


def repository(dest: Path, repo: str | None, old: dict | None) -> str | None:
    """The GitHub repository (``OWNER/NAME``) learners open the edition's notebooks from: ``repo``, else
    the one the edition recorded, else ``dest``'s git remote ``origin`` where that is on GitHub."""
    if repo:
        if not _REPO.match(repo):
            raise ValueError(f"--repo {repo!r}: expected OWNER/NAME, the GitHub repository learners open the "
                             "notebooks from (my-org/attention-course, say)")
        return repo
    if old and old.get("repository"):
        return old["repository"]
    if not (dest / ".git").exists():
        return None
    try:
        origin = subprocess.run(["git", "-C", str(dest), "remote", "get-url", "origin"], capture_output=True,
                                text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    found = _GITHUB.match(origin)
    return found.group(1) if found else None


def build(dest: str | Path, *, autograder: list[str] | None = None, through: str | None = None,
          repo: str | None = None, log=print) -> Path:
    """Write (or update in place) the learner's edition, or with ``autograder`` a Gradescope autograder.

    ``through``: ship stages 1..that one (default: what the edition in ``dest`` ships, else all);
    ``repo``: the GitHub repository (``OWNER/NAME``) the notebooks' Colab badges and cells point at
    (default: the one the edition recorded, else ``dest``'s GitHub remote ``origin``; without one the
    placeholder stays and a warning says so).
    """
    dest = Path(dest).resolve()
    old = edition_info.read(dest)
    if dest.exists() and any(p.name != ".git" for p in dest.iterdir()) and old is None:
        raise BundleError(f"{dest} exists, is not empty and holds no edition ({edition_info.MANIFEST}): "
                          "choose a new folder")
    for name in autograder or []:
        stages.find(name)  # an unknown stage is an error now, not on Gradescope
    last = stages.find(through or (old or {}).get("through") or stages.ALL[-1].name)
    shipped = [s for s in stages.ALL if s.number <= last.number]
    published = list((old or {}).get("published", []))
    repo = repository(dest, repo, old)
    wanted = collect(shipped, autograder=autograder, published=published)
    edition.fill_repository(wanted, repo)
    keys = edition.answer_keys()
    given = {n for s in shipped for n in edition.answers_in(wanted[f"stages/{s.module}.py"], keys)}
    allowed = given | {stages.find(p).number for p in published}
    problems = edition.audit(wanted, allowed, keys, set() if autograder else hidden_check_names())
    if problems:
        raise BundleError("the edition would give away what it must not, so nothing was written:\n  "
                          + "\n  ".join(problems))
    source = edition_info.source_version()
    base = source["version"] + (f".changes.{edition.content_digest(wanted)}"
                                if source["commit"].endswith("+changes") else "")
    meta = dict(source, version=edition.edition_version(base, published), base_version=base,
                kind="autograder" if autograder else "learner", through=last.name, published=published)
    if repo:
        meta["repository"] = repo
    if old and old.get("kind", "learner") != meta["kind"]:
        raise BundleError(f"{dest} holds a {old.get('kind', 'learner')} edition, not a {meta['kind']} one")
    dest.mkdir(parents=True, exist_ok=True)
    changes = edition.write(dest, wanted, meta, log=log if old else (lambda *_: None))
    for stage in shipped:
        answers = sorted(edition.answers_in(wanted[f"stages/{stage.module}.py"], keys) - {stage.number})
        if answers and not old:
            log(f"note     stages/{stage.module}.py gives, as given code, the answers of "
                + ", ".join(f"stage{n}" for n in answers))
    if autograder:
        archive = shutil.make_archive(str(dest), "zip", dest)
        log(f"wrote {dest} and {archive}: upload the .zip as the Gradescope autograder "
            f"(edition {meta['version']})")
    elif old:
        log(f"{dest} now holds the learner's edition {meta['version']}, stages 1-{last.number}: "
            f"{len(changes)} change(s), listed above")
    else:
        log(f"wrote {dest}: the learner's edition {meta['version']}, stages 1-{last.number}, {len(wanted)} files, "
            "no solutions")
    if not autograder and not repo:
        log(f"WARNING  the notebooks' Open-in-Colab badges and Colab set-up cells still name the placeholder "
            f"{PLACEHOLDER}, which does not exist: on Colab they lead to a 404. Give the edition's GitHub "
            "repository: release --to DIR --repo OWNER/NAME (or make DIR a clone whose origin is on GitHub).")
    return dest


def main(*, to: str, autograder: str | None = None, through: str | None = None, repo: str | None = None) -> int:
    """``python -m grader release --to DIR``: write the learner's edition into ``to`` (a Gradescope
    ``autograder`` for those stages, or stages 1..``through`` only, its notebooks opening on Colab from
    the GitHub ``repo``).

    A new learner's edition needs ``through``: the file of stage N+1 holds stage N's answers as given
    code, so shipping every stage hands out earlier stages' answers; ``--through stage9`` says that is
    meant.  An edition updated in place keeps the stages it ships unless told otherwise."""
    if release.without_solutions():
        return 0
    if not (through or autograder or edition_info.read(Path(to))):
        print(f"release --to {to} needs --through stageN: the stages to ship (1..N). Stage N+1's file holds "
              "stage N's answers as given code, so an edition of every stage hands out earlier stages' "
              "answers; ship a stage once the one before it is due (--through stage9 ships all nine, if "
              "that is what you mean).", file=sys.stderr)
        return 2
    try:
        build(to, autograder=autograder.split(",") if autograder else None, through=through, repo=repo)
    except (BundleError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def learner_readme(shipped: list) -> str:
    """The README of a learner's edition: what this is, set-up, the stages, grading, help."""
    rows = "\n".join(f"| {s.number} | {s.title} | `stages/{s.module}.py` | `notebooks/{s.notebook}` | {s.runs_on} |"
                     for s in shipped)
    later = "" if shipped[-1].number == stages.ALL[-1].number else (
        f"\nStages {shipped[-1].number + 1}-{stages.ALL[-1].number} arrive in a later edition; "
        f"`{COMMAND} update --from NEW` (or your instructor's instructions) brings them in without "
        "touching your work.\n")
    return f"""# Flash Attention Workbook

Write FlashAttention from scratch, one graded stage at a time: from an online softmax in plain
PyTorch to Triton kernels with causal masks, grouped-query attention, sliding windows, attention
sinks and the backward pass, and a CUDA kernel for head dims that are not a power of two. Each
stage is a file with holes to fill in, a notebook that teaches it and runs your code, and a grader
that checks your code against a float64 reference and tells you what to fix.

## Set up

```bash
bash setup.sh        # makes .venv, installs torch, Triton and the notebooks, checks they work here
```

Then open the first notebook: `.venv/bin/jupyter lab notebooks/01_online_softmax.ipynb`. Without a
GPU, Triton kernels run in Triton's CPU interpreter (small sizes, a little slow); the CUDA kernel
of stage 4 needs an NVIDIA GPU, and its checks say "not run" elsewhere.

## The stages

| # | stage | your file | notebook | runs on |
| --- | --- | --- | --- | --- |
{rows}
{later}
## How you work

1. Read the stage's notebook and run its cells: they load **your** file from `stages/`.
2. Fill in the holes marked `TODO(3a)`, `TODO(3b)`, ...: the comment above each says what to write.
3. Grade:

```bash
./workbook stage3              # your stage 3, check by check, with what to fix
./workbook stage3 --notebook   # ... and its notebook
./workbook                     # your progress over every stage
./workbook stage3 --compare    # once your instructor publishes stage 3's reference
```

`./workbook` runs the grader with `.venv`'s Python, from any folder, with nothing to activate. When
an update keeps a file you changed and puts the new version beside it as `<name>.new`, the grader
lists it until you run `./workbook update --merge <name>`.

Each check is `pass`, `FAIL` (the message says where, and the likely cause), `todo` (a hole not
filled yet), `crash`, `timeout` or `not run` (it needs a GPU). Inputs are fresh random numbers each
run; the seed is printed, and `WORKBOOK_SEED=<seed>` repeats a run.

## Help

- A check's message names the worst position, the tile it is in and the usual cause: start there.
- The notebooks draw what each kernel does; re-run a stage's picture cells after a change.
- `edition.json` says which edition this is; quote it (and the seed) when you ask for help.
"""
