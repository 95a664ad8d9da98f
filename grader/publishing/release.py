"""Generate the learner's files in stages/ from the instructor's solutions/.

A learner's file is its solution file with the given code expanded and every solution block
rendered as a stub under its TODO (kernels/solution_file.py defines both): an earlier stage's
answers become given code, the stage's own become holes.

Release never destroys a learner's work.  ``stages/.release.json`` records what release last
wrote; a stage file that differs from it was edited by the learner and is left alone unless
``force=True``, and then it is first copied to ``stages/.backup/``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kernels.loader import ROOT
from kernels.solution_file import MANIFEST, learner_text, manifest_text, sha, stage_files

from grader.isolation import files


def _read(path: Path) -> bytes | None:
    """A stage file's bytes (None if absent), never through a link nor blocking on a FIFO: a file
    that is not a plain one counts as edited, which keeps it from being overwritten."""
    try:
        return files.read_plain(path)
    except files.UnsafeFile:
        return b"\0<not a plain file>"


def rendered(solutions: Path | None = None) -> dict[str, str]:
    """File name -> learner text, for every stage file in solutions/ (its given code expanded:
    an earlier stage's answers become given code)."""
    solutions = solutions or ROOT / "solutions"
    return {p.name: learner_text(p) for p in stage_files(solutions)}


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
                manifest[name] = sha(text)
                continue
            edited = manifest.get(name) != sha(current)
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
        manifest[name] = sha(text)
        log(f"wrote    {name}")
    manifest_path.write_text(manifest_text(manifest))
    return kept


def without_solutions() -> bool:
    """True, after saying so, in a learner's copy of the workbook: it has no solutions/ to release from."""
    if (ROOT / "solutions").is_dir():
        return False
    print("this copy of the workbook has no solutions/ (it is a learner's copy): its stages/ came with it, "
          "and there is nothing to release")
    return True


def main(*, check_only: bool = False, force: bool = False) -> int:
    """``python -m grader release``: regenerate stages/ (keeping edits unless ``force``), or only check
    that it is in sync (``check_only``).  ``release --to DIR`` writes a learner's edition instead
    (grader/publishing/bundle.py)."""
    if without_solutions():
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
