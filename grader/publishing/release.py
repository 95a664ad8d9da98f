"""Generate the learner's files in stages/ from the instructor's solutions/.

In a solution, code between ``# BEGIN SOLUTION`` and ``# END SOLUTION`` is what the learner
writes.  The comments just above the block (the TODO) stay; the block becomes one stub line:

    # BEGIN SOLUTION              ->  raise NotImplementedError("stage1_online_softmax.py: TODO(1a) is not written yet")
    # BEGIN SOLUTION stub=pass    ->  pass        (inside a @triton.jit kernel, where raise cannot go)
    # BEGIN SOLUTION stub=        ->  (nothing: solution-only code such as a __main__ benchmark)

In a ``.cu`` file the markers are ``// BEGIN SOLUTION`` and ``// END SOLUTION``.

An ``# include: stage5_causal._key_blocks`` line takes code from an earlier stage's solution
(kernels/includes.py); release expands it first, so the learner's file holds that code, answers
filled in, as given code.

Release never destroys a learner's work.  ``stages/.release.json`` records what release last
wrote; a stage file that differs from it was edited by the learner and is left alone unless
``force=True``, and then it is first copied to ``stages/.backup/``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

from grader.isolation import files
from kernels.includes import expand_file
from kernels.loader import ROOT

MANIFEST = ".release.json"
_BEGIN = re.compile(r"^(\s*)(?:#|//) BEGIN SOLUTION(?:\s+stub=(.*))?\s*$")
_END = re.compile(r"^\s*(?:#|//) END SOLUTION\s*$")
LABEL = re.compile(r"TODO\(\w+\)")          # a TODO's label: TODO(1a)


class MarkerError(ValueError):
    pass


def _label_above(out: list[str]) -> str | None:
    """The TODO label (``TODO(1a)``) in the lines right above a hole, up to a blank line."""
    for line in reversed(out):
        if not line.strip():
            return None
        found = LABEL.search(line)
        if found:
            return found.group(0)
    return None


def render(text: str, filename: str) -> str:
    """The learner's version of a solution file."""
    out: list[str] = []
    inside = False
    start = 0
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        begin, end = _BEGIN.match(line), _END.match(line)
        if begin:
            if inside:
                raise MarkerError(f"{filename}:{lineno}: BEGIN SOLUTION inside another (opened at line {start})")
            inside, start = True, lineno
            indent, stub = begin.group(1), begin.group(2)
            if stub is None and filename.endswith(".cu"):
                stub = ""  # C++ has no NotImplementedError: the .cu's TODO comments say what to write
            elif stub is None:         # named by its TODO's label, which (unlike a line number) never goes stale
                label = _label_above(out)
                stub = f'raise NotImplementedError("{filename}: {label or "the TODO above"} is not written yet")'
            if stub.strip():
                out.append(f"{indent}{stub.strip()}\n")
        elif end:
            if not inside:
                raise MarkerError(f"{filename}:{lineno}: END SOLUTION without a BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{filename}:{start}: BEGIN SOLUTION is never closed")
    return "".join(out)


def _sha(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _read(path: Path) -> bytes | None:
    """A stage file's bytes (None if absent), never through a link nor blocking on a FIFO: a file
    that is not a plain one counts as edited, which keeps it from being overwritten."""
    try:
        return files.read_plain(path)
    except files.UnsafeFile:
        return b"\0<not a plain file>"


def stage_files(solutions: Path) -> list[Path]:
    return sorted(p for p in solutions.iterdir() if p.name.startswith("stage") and p.suffix in (".py", ".cu")
                  and files.plain_file(p))


def rendered(solutions: Path | None = None) -> dict[str, str]:
    """File name -> learner text, for every stage file in solutions/ (its includes expanded:
    an earlier stage's answers become given code)."""
    solutions = solutions or ROOT / "solutions"
    return {p.name: render(expand_file(p), p.name) for p in stage_files(solutions)}


def is_untouched(path: Path, solutions: Path | None = None) -> bool:
    """True when a learner file is exactly what release generates (the learner has not started).

    Without ``solutions/`` (a learner's bundle, an autograder), what release wrote is known from
    ``stages/.release.json``.  Compared as bytes: a file in any encoding, or none, is just edited.
    """
    solutions = solutions or ROOT / "solutions"
    current = _read(path)
    if current is None:
        return False
    if not solutions.is_dir():
        manifest = ROOT / "stages" / MANIFEST
        recorded = json.loads(manifest.read_text()).get(path.name) if manifest.exists() else None
        return recorded is not None and _sha(current) == recorded
    source = solutions / path.name               # render this one file: every stage's takes seconds
    if source not in stage_files(solutions):
        return False
    return current == render(expand_file(source), path.name).encode()


def check(*, stages: Path | None = None, solutions: Path | None = None) -> list[str]:
    """Names of files in stages/ that are not what release would write now (empty: in sync)."""
    stages = stages or ROOT / "stages"
    return [name for name, text in rendered(solutions).items() if _read(stages / name) != text.encode()]


def _backup(target: Path, stages: Path) -> Path:
    """Copy an edited file to stages/.backup/ under a name no earlier backup has."""
    folder = stages / ".backup"
    folder.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        backup = folder / f"{target.name}.{stamp}" if n == 0 else folder / f"{target.name}.{stamp}.{n}"
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with open(fd, "wb") as f:
            f.write(_read(target) or b"")
        return backup
    raise FileExistsError(f"1000 backups of {target.name} in {folder} within one second")


def release(*, force: bool = False, stages: Path | None = None, solutions: Path | None = None,
            log=print) -> int:
    """Write stages/ from solutions/; return how many edited files were kept (not overwritten)."""
    stages = stages or ROOT / "stages"
    stages.mkdir(exist_ok=True)
    manifest_path = stages / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    kept = 0
    for name, text in rendered(solutions).items():
        target = stages / name
        current = _read(target)
        if current is not None:
            if current == text.encode():
                manifest[name] = _sha(text)
                continue
            edited = manifest.get(name) != _sha(current)
            if edited and not force:
                log(f"kept     {name}: it has your edits (release --force overwrites it and keeps a backup)")
                kept += 1
                continue
            if edited:
                backup = _backup(target, stages)
                log(f"backup   {name} -> {backup.relative_to(stages.parent)}")
            if not files.plain_file(target):
                target.unlink()  # a link or a FIFO: replaced by the file, never written through
        target.write_text(text)
        manifest[name] = _sha(text)
        log(f"wrote    {name}")
    manifest_path.write_text(manifest_text(manifest))
    return kept


def manifest_text(manifest: dict[str, str]) -> str:
    """stages/.release.json: file name -> SHA-256 of what release wrote."""
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def main(*, check_only: bool = False, force: bool = False, to: str | None = None, autograder: str | None = None,
         through: str | None = None, repo: str | None = None) -> int:
    """``python -m grader release``: regenerate stages/ (keeping edits unless ``force``), only check
    that it is in sync (``check_only``), or write the learner's edition ``to`` a folder (a Gradescope ``autograder`` for
    those stages, or stages 1..``through`` only, its notebooks opening on Colab from the GitHub ``repo``).

    A new learner's edition needs ``through``: the file of stage N+1 holds stage N's answers as given
    code, so shipping every stage hands out earlier stages' answers; ``--through stage9`` says that is
    meant.  An edition updated in place keeps the stages it ships unless told otherwise."""
    if not (ROOT / "solutions").is_dir():
        print("this copy of the workbook has no solutions/ (it is a learner's copy): its stages/ came with it, "
              "and there is nothing to release")
        return 0
    if to:
        from grader.publishing import bundle, edition
        if not (through or autograder or edition.read(Path(to))):
            print(f"release --to {to} needs --through stageN: the stages to ship (1..N). Stage N+1's file holds "
                  "stage N's answers as given code, so an edition of every stage hands out earlier stages' "
                  "answers; ship a stage once the one before it is due (--through stage9 ships all nine, if "
                  "that is what you mean).", file=sys.stderr)
            return 2
        try:
            bundle.build(to, autograder=autograder.split(",") if autograder else None, through=through, repo=repo)
        except (bundle.BundleError, ValueError) as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    if check_only:
        stale = check()
        if stale:
            print("stages/ is out of sync with solutions/ for: " + ", ".join(stale))
            print("run: python -m grader release")
            return 1
        print("stages/ is in sync with solutions/")
        return 0
    kept = release(force=force)
    return 1 if kept else 0
