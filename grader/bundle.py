"""``python -m grader release --to DIR``: the learner's bundle, or a Gradescope autograder.

The learner's bundle is the workbook without the instructor's side:

    README.md, LICENSE, pyproject.toml, setup.sh, workbook, .gitignore
    kernels/, notebooks/, docs/, constraints/
    grader/    without grader/checks/hidden/
    stages/    rendered from solutions/ now (with its .release.json), whatever stages/ holds here
    tests/     the tests that run without solutions/: not tests/wrong/ (its edits quote the
               solutions), nor any test that reads solutions/

``autograder=[stages]`` builds a Gradescope autograder instead: the same files with the hidden
checks kept, Gradescope's ``setup.sh`` and ``run_autograder`` (from grader/gradescope/) at the top,
and ``DIR.zip`` to upload.  Neither ever holds ``solutions/``: a submission is graded against the
float64 reference, which needs no solution.

Before ``build`` returns, it searches what it wrote: no ``solutions/`` folder, no solution markers
in a stage file, a notebook or kernels/, and, in a learner's bundle, no hidden check's name in any
file.  A bundle that fails the search is deleted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grader import release, stages
from kernels.loader import ROOT

TOP_FILES = ("README.md", "LICENSE", "pyproject.toml", "setup.sh", "workbook", ".gitignore")
TOP_DIRS = ("kernels", "grader", "notebooks", "docs", "constraints")
_JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")


class BundleError(RuntimeError):
    pass


def hidden_check_names() -> set[str]:
    return {c.name for s in stages.STAGES for c in s.checks() if c.hidden}


def _ignore(keep_hidden: bool):
    def ignore(folder, names):
        skip = set(_JUNK(folder, names))
        if not keep_hidden and Path(folder) == ROOT / "grader" / "checks":
            skip.add("hidden")
        return skip
    return ignore


def _learner_tests() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").glob("*.py") if "solutions" not in p.read_text())


def build(dest: str | Path, *, autograder: list[str] | None = None, log=print) -> Path:
    """Write the learner's bundle (or, with ``autograder``, a Gradescope autograder) into ``dest``."""
    dest = Path(dest).resolve()
    if dest.exists() and any(dest.iterdir()):
        raise BundleError(f"{dest} exists and is not empty: choose a new folder")
    for name in autograder or []:
        stages.find(name)  # an unknown stage is an error now, not on Gradescope
    hidden = hidden_check_names()
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOP_FILES:
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)
    for name in TOP_DIRS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=_ignore(keep_hidden=bool(autograder)))
    (dest / "tests").mkdir()
    for path in _learner_tests():
        shutil.copy2(path, dest / "tests" / path.name)
    release.release(stages=dest / "stages", log=lambda *_: None)
    if autograder:
        for name in ("setup.sh", "run_autograder"):
            text = (ROOT / "grader" / "gradescope" / name).read_text()
            (dest / name).write_text(text.replace("@STAGES@", ",".join(autograder)))
            (dest / name).chmod(0o755)
    problems = audit(dest, set() if autograder else hidden)
    if problems:
        shutil.rmtree(dest, ignore_errors=True)
        raise BundleError("the bundle would give away what it must not, so it was not written:\n  "
                          + "\n  ".join(problems))
    if autograder:
        archive = shutil.make_archive(str(dest), "zip", dest)
        log(f"wrote {dest} and {archive}: upload the .zip as the Gradescope autograder")
    else:
        log(f"wrote {dest}: the learner's workbook ({len(list(dest.rglob('*')))} files, no solutions)")
    return dest


def audit(dest: Path, hidden_names: set[str]) -> list[str]:
    """What in ``dest`` would give away a solution or a hidden check."""
    problems = [f"{p.relative_to(dest)}: a solutions folder" for p in dest.rglob("solutions") if p.is_dir()]
    marked = [*dest.glob("stages/*"), *dest.glob("notebooks/*.ipynb"), *dest.glob("kernels/*.py")]
    for path in marked:
        if any(release._BEGIN.match(line) or release._END.match(line) for line in _lines(path)):
            problems.append(f"{path.relative_to(dest)}: holds a solution block")
    for path in (p for p in dest.rglob("*") if p.is_file() and hidden_names):
        text = "\n".join(_lines(path))
        named = sorted(n for n in hidden_names if n in text)
        if named:
            problems.append(f"{path.relative_to(dest)}: names hidden check(s) {', '.join(named)}")
    return problems


def _lines(path: Path) -> list[str]:
    """A file's lines; a notebook's are its cells' source lines, unescaped."""
    try:
        text = path.read_text()
    except (UnicodeDecodeError, OSError):
        return []
    if path.suffix == ".ipynb":
        cells = json.loads(text).get("cells", [])
        return [ln for c in cells for ln in "".join(c.get("source", "")).splitlines()]
    return text.splitlines()
