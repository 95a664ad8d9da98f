"""``python -m grader update --from DIR``: bring a newer edition into this copy of the workbook.

Files the learner did not change are replaced; files they changed stay, and the new version goes
beside them as ``<name>.new`` (grader/publishing/edition.py writes them).  ``update --merge FILE``
merges one of those into your file (:func:`merge`); until then the progress view and every grading
list them (grader/edition_info.py).
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernels.loader import ROOT

from grader import edition_info
from grader.isolation import files
from grader.publishing import edition


def main(*, source: str) -> int:
    """Take the edition in the folder ``source`` into this copy; 2 when either is not an edition."""
    new = edition_info.read(Path(source))
    if new is None:
        print(f"{source} holds no edition ({edition_info.MANIFEST})", file=sys.stderr)
        return 2
    if not isinstance(new.get("files"), dict) or not isinstance(new.get("version"), str):
        print(f"{source}/{edition_info.MANIFEST} is not an edition's: it needs a \"version\" and the \"files\" "
              "the edition holds; nothing was changed", file=sys.stderr)
        return 2
    mine = edition_info.read(ROOT)
    if mine is None:
        print("this copy is not a learner's edition (no edition.json): nothing to update", file=sys.stderr)
        return 2
    wanted = {rel: data for rel, data in edition.on_disk(Path(source), new).items() if rel in new["files"]}
    changes = edition.write(ROOT, wanted, {k: v for k, v in new.items() if k != "files"})
    print(f"edition {mine['version']} -> {new['version']}: {len(changes)} change(s)")
    return 0


# -- what update left to merge --------------------------------------------------------------------
def merge(file: str, *, root: Path = ROOT, out=print) -> int:
    """``update --merge FILE``: fold ``FILE.new``, the newer edition's version, into ``FILE``.

    With the version ``FILE`` started from (recorded in .edition/base/ when the edition wrote it) and
    ``git merge-file``, a three-way merge: the edition's changes go into your file, your changes stay,
    and where both changed the same lines the file holds both between ``<<<<<<<`` and ``>>>>>>>`` markers
    for you to choose.  Your version is first copied to .edition/backup/, and ``FILE.new`` is removed.
    Without either, nothing changes: the differences are shown (``-`` your lines, ``+`` the new edition's)
    for you to copy by hand, then delete ``FILE.new``.  Returns 0 after a clean merge, 1 when there is
    something left to do by hand, 2 for a file with no newer version waiting.
    """
    rel = _relative(file, root)
    waiting = edition_info.pending(root)
    if rel is None or rel not in waiting:
        listed = ", ".join(waiting) or "none"
        out(f"update --merge {file}: no newer version waits for that file (files with one: {listed})")
        return 2
    path, new_path, base_path = root / rel, root / (rel + edition_info.NEW), root / edition.BASE / rel
    mine, new = path.read_bytes(), new_path.read_bytes()
    git = shutil.which("git")
    if not (git and files.plain_file(base_path)):
        why = ("git is not installed" if not git else
               "the version your file started from is not recorded (an edition made before this grader)")
        out(f"{rel}: no three-way merge ({why}). What the new edition changes, - your lines, + its lines:\n")
        out("".join(difflib.unified_diff(mine.decode(errors="replace").splitlines(keepends=True),
                                         new.decode(errors="replace").splitlines(keepends=True),
                                         fromfile=rel, tofile=rel + edition_info.NEW)))
        out(f"Copy into {rel} what you want of the + lines, then delete {rel + edition_info.NEW}.")
        return 1
    backup = _backup(root, rel, mine)
    with tempfile.TemporaryDirectory() as tmp:
        merged = Path(tmp) / "merged"
        merged.write_bytes(mine)
        done = subprocess.run([git, "merge-file", "-L", "your version", "-L", "the version you started from",
                               "-L", "the new edition", str(merged), str(base_path), str(new_path)],
                              capture_output=True, text=True, timeout=60)
        if done.returncode < 0 or done.returncode > 127:
            out(f"{rel}: git merge-file failed ({done.stderr.strip()}); nothing changed")
            return 1
        path.write_bytes(merged.read_bytes())
    base_path.write_bytes(new)                 # the next merge starts from the version just taken in
    new_path.unlink()
    where = backup.relative_to(root)
    if done.returncode:
        out(f"{rel}: merged with {done.returncode} conflict(s): where you and the new edition changed the same "
            "lines, the file holds both, between <<<<<<< and >>>>>>> lines; keep what is right and delete the "
            f"markers. Your version before the merge is in {where}.")
        return 1
    out(f"{rel}: merged: the new edition's changes are in, and yours stay. Your version before the merge is in "
        f"{where}.")
    return 0


def _backup(root: Path, rel: str, data: bytes) -> Path:
    """Keep ``data`` (the learner's ``rel`` before a merge) in .edition/backup/, under a name no earlier
    backup has."""
    folder = root / ".edition" / "backup"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        backup = folder / (f"{rel}.{stamp}" if n == 0 else f"{rel}.{stamp}.{n}")
        backup.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        with open(fd, "wb") as f:
            f.write(data)
        return backup
    raise FileExistsError(f"1000 backups of {rel} in {folder} within one second")


def _relative(file: str, root: Path) -> str | None:
    """``FILE`` (or ``FILE.new``), from the current folder, as a path inside ``root``; None if outside."""
    path = Path(os.path.abspath(file))
    try:
        rel = path.relative_to(Path(os.path.abspath(root))).as_posix()
    except ValueError:
        return None
    return rel[: -len(edition_info.NEW)] if rel.endswith(edition_info.NEW) else rel
