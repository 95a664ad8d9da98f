"""Which edition of the workbook this is, as the grader reports it.

An edition (grader/publishing/edition.py writes it) says what it is in ``edition.json``; an
update leaves a newer version of a file the learner changed beside it as ``<name>.new``, and
publishing a stage puts its reference in ``published/``.  Grading reads all three: the header
names the edition, a learner's copy of another edition gets a note, the files still waiting to
be merged are listed, and ``--compare`` (grader/compare.py) shows the published reference.
Publishing writes them, with these names.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from kernels.loader import ROOT

from grader import COMMAND
from grader.isolation import files

MANIFEST = "edition.json"
NEW = ".new"
PUBLISHED = "published"         # published/<stage file>, stageN.md, stageN.holes.json
_MANIFEST_LIMIT = 1 << 20      # an edition.json lists a few hundred files: tens of kilobytes


def source_version(root: Path = ROOT) -> dict:
    """The version of the instructor's repository: pyproject's version and the git commit."""
    match = re.search(r'^version\s*=\s*"([^"]+)"', (root / "pyproject.toml").read_text(), re.M)
    version = match.group(1) if match else "0"
    commit = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "+changes" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        pass
    return {"version": f"{version}+{commit[:12]}" if commit != "unknown" else version, "commit": commit}


def read(folder: Path = ROOT) -> dict | None:
    """The edition.json of ``folder``, or None where there is none (the instructor's repository) or
    where it is not an edition's (not a JSON object)."""
    try:
        data = files.read_plain(Path(folder) / MANIFEST)
        meta = json.loads(data) if data is not None else None
    except (files.UnsafeFile, ValueError, RecursionError):
        return None
    return meta if isinstance(meta, dict) else None


def describe(folder: Path = ROOT) -> str:
    """One line for the grader's header: which edition, or which commit, this is."""
    meta = read(folder)
    if meta is None:
        return f"workbook {source_version(folder)['version']} (the instructor's repository)"
    if meta.get("kind") == "autograder":
        return f"workbook edition {meta['version']} (autograder)"
    published = ", ".join(meta.get("published", [])) or "none yet"
    return (f"workbook edition {meta['version']}, stages through {meta['through']}, "
            f"reference solutions published: {published}")


def version_notes(submission: str | None, folder: Path = ROOT) -> list[str]:
    """A line for a learner whose copy is another edition than the grader's (a whole workbook handed in),
    or whose edition.json is not an edition's: the learner's file, so any bytes at all, never an error."""
    if not submission:
        return []
    path = Path(submission) / MANIFEST
    try:
        data = files.read_plain(path, limit=_MANIFEST_LIMIT)
    except files.UnsafeFile:
        data = b""
    if data is None:
        return []
    try:
        theirs = json.loads(data)
    except (ValueError, RecursionError):
        theirs = None
    version = theirs.get("version") if isinstance(theirs, dict) else None
    if not isinstance(version, str) or not 0 < len(version) <= 100:
        return [f"Your copy's {MANIFEST} is not one an edition writes (a JSON object with a \"version\", at most "
                f"{_MANIFEST_LIMIT >> 20} MiB), so the grader cannot tell which edition your copy is; your stage files "
                f"were graded all the same. Take {MANIFEST} back from the edition you were given."]
    mine = read(folder) or source_version(folder)
    if version != mine.get("version"):
        return [f"Your copy is edition {version}; this grader is {mine.get('version')}: if a check "
                "surprises you, update your copy (python -m grader update --from <the new edition>)."]
    return []


def pending(folder: Path = ROOT) -> list[str]:
    """The files of an edition with a newer version waiting beside them (``<name>.new``), unmerged."""
    meta = read(folder) or {}
    return [rel for rel in sorted(meta.get("files", {})) if files.plain_file(Path(folder) / (rel + NEW))]


def pending_note(root: Path = ROOT) -> str:
    """Lines that name each file with a newer version waiting beside it, and the command that merges it
    ("" when none waits): the progress view and every grading print them until the learner merges."""
    waiting = pending(root)
    if not waiting:
        return ""
    lines = [f"{len(waiting)} file(s) have a newer version waiting beside them ({NEW}): update kept your "
             "changes and did not merge. Merge each one (your version is backed up first):"]
    lines += [f"    {COMMAND} update --merge {rel}" for rel in waiting]
    return "\n".join(lines)
