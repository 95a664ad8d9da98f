"""Editions: the learner's copy of the workbook, versioned, published stage by stage, updated in place.

``python -m grader release --to DIR --through stageN`` writes an edition; ``DIR/edition.json``
says what it is and what was written:

    {"version": "0.1.0+892164508c5c.published.2", "commit": "<the instructor repository's commit>",
     "base_version": "0.1.0+892164508c5c", "through": "stage3", "published": ["stage2"],
     "repository": "my-org/course",
     "files": {"stages/stage1_online_softmax.py": "<sha256 of what the edition wrote>", ...}}

``base_version`` is the source's (with ``.changes.<digest of the files>`` after the commit when
released from uncommitted changes); ``version`` adds the published stages.  ``repository`` is the
GitHub repository the notebooks open on Colab from, where one was given.  The grader reads it
(grader/edition_info.py: the edition it names, and the ``.new`` files waiting to be merged).

Writing into a folder that already holds an edition updates it in place, and never loses a
learner's work: a file still as the edition wrote it is replaced by the new version; a file the
learner changed stays as it is, and the new version is written beside it as ``<name>.new``; a
file the new edition no longer has is removed only if the learner never changed it.  Every
change is listed; a rerun with nothing new changes nothing.

``python -m grader publish stage2 --to DIR`` adds the reference solution of stage 2 to an
edition (grader/publishing/publish.py).  Whatever is written, ``audit`` first checks that the edition would
hold no solution of a stage that is neither published nor shipped as given code, no hidden check
and no wrong solution.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kernels.loader import ROOT
from kernels.solution_file import is_marker, sha, solution_blocks

from grader.edition_info import MANIFEST, NEW, read
from grader.isolation import files
from grader.publishing import release

#: The edition's own version of each file a learner edits (stages/, notebooks/), as last written:
#: the common ancestor ``update --merge`` needs for a three-way merge of a ``.new``.
BASE = ".edition/base"
_MERGEABLE = ("stages/", "notebooks/")
#: What the notebooks' Colab badges and set-up cells name until an edition fills in its repository.
PLACEHOLDER = "YOUR-ORG/flash-attention-workbook"


class EditionError(RuntimeError):
    """An edition cannot be written as asked; the message says why and what to do."""


# -- versions -------------------------------------------------------------------------------------
def edition_version(base: str, published: list[str]) -> str:
    """An edition's version: its source's (``base``), then the stages whose solutions it publishes, so that
    publishing a stage, which changes what the edition holds, changes its version too."""
    numbers = [name.removeprefix("stage") for name in published]
    return base + (".published." + ".".join(numbers) if numbers else "")


def content_digest(wanted: dict[str, bytes]) -> str:
    """A short digest of what an edition holds: it tells two releases from uncommitted changes apart."""
    digest = hashlib.sha256()
    for rel in sorted(wanted):
        digest.update(f"{rel}\0{sha(wanted[rel])}\n".encode())
    return digest.hexdigest()[:8]


# -- writing an edition ---------------------------------------------------------------------------
def write(dest: Path, wanted: dict[str, bytes], meta: dict, *, log=print, remove_missing: bool = True) -> list[str]:
    """Make ``dest`` hold ``wanted`` (relative path -> bytes) without losing a learner's edit.

    Returns the list of changes, one line each; ``meta`` (without "files") becomes edition.json.
    """
    dest = Path(dest)
    old = read(dest) or {}
    recorded: dict[str, str] = dict(old.get("files", {}))
    changes: list[str] = []
    for rel in sorted(wanted):
        data = wanted[rel]
        target = dest / rel
        try:
            current = files.read_plain(target, limit=1 << 30)
        except files.UnsafeFile:
            current = b"\0<not a plain file>"
        if current == data:
            recorded[rel] = sha(data)
            _keep_base(dest, rel, data)
            continue
        if current is not None and recorded.get(rel) == sha(data):
            if not files.plain_file(dest / (rel + NEW)):        # (while a .new waits, its ancestor stays)
                _keep_base(dest, rel, data)
            continue           # changed by the learner, unchanged in the edition: nothing to say
        if current is None:
            _put(target, data, rel)
            _keep_base(dest, rel, data)
            changes.append(f"added    {rel}")
        elif recorded.get(rel) == sha(current):
            _put(target, data, rel)
            _keep_base(dest, rel, data)
            changes.append(f"updated  {rel}")
        else:
            beside = dest / (rel + NEW)
            existing = files.read_plain(beside, limit=1 << 30) if files.plain_file(beside) else None
            if existing is None:         # the merge's ancestor: the version their file started from
                _check_base(dest, rel, recorded.get(rel))
            if existing != data:
                _put(beside, data, rel)
            changes.append(f"kept     {rel}: it has your changes; the new version is {rel + NEW}")
        recorded[rel] = sha(data)
    for rel in sorted(set(recorded) - set(wanted)) if remove_missing else []:
        target = dest / rel
        current = files.read_plain(target) if files.plain_file(target) else None
        if current is not None and sha(current) == recorded[rel]:
            target.unlink()
            _check_base(dest, rel, None)
            changes.append(f"removed  {rel}")
        elif current is not None:
            changes.append(f"kept     {rel}: no longer part of the edition, and it has your changes")
        del recorded[rel]
    manifest = dict(meta, files=dict(sorted(recorded.items())))
    text = (json.dumps(manifest, indent=1) + "\n").encode()
    if files.read_plain(dest / MANIFEST) != text:
        _put(dest / MANIFEST, text, MANIFEST)
    for line in changes:
        log(line)
    return changes


def _keep_base(dest: Path, rel: str, data: bytes) -> None:
    """Record ``data`` as the edition's version of ``rel`` (a file a learner edits), the base of a later merge."""
    if not rel.startswith(_MERGEABLE):
        return
    base = dest / BASE / rel
    try:
        if files.read_plain(base, limit=1 << 30) == data:
            return
    except files.UnsafeFile:
        pass
    _put(base, data, rel)


def _check_base(dest: Path, rel: str, digest: str | None) -> None:
    """Remove the recorded base of ``rel`` unless it is the version whose SHA-256 is ``digest``: a merge
    with a wrong ancestor would silently undo changes, so without the right one it shows a diff instead."""
    base = dest / BASE / rel
    try:
        data = files.read_plain(base, limit=1 << 30)
    except files.UnsafeFile:
        data = b""
    if data is not None and (digest is None or sha(data) != digest):
        base.unlink()


def _put(target: Path, data: bytes, rel: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if os.path.islink(target) or (os.path.lexists(target) and not files.plain_file(target)):
        target.unlink()
    tmp = target.parent / f".{target.name}.writing"
    tmp.write_bytes(data)
    os.chmod(tmp, 0o755 if rel.endswith(".sh") or rel in ("run_autograder", "workbook") else 0o644)
    os.replace(tmp, target)


# -- what would give an answer away ---------------------------------------------------------------
def _significant(line: str) -> str | None:
    s = line.strip()
    return s if len(s) >= 10 and not s.startswith(("#", "//")) else None


def answer_keys(solutions: Path = ROOT / "solutions") -> dict[int, list[set[str]]]:
    """Stage number -> its answers, as sets of significant lines, one set per solution block.

    A line that the stage's own learner file holds (given code) is no answer."""
    from grader import stages
    rendered = release.rendered(solutions)
    keys: dict[int, list[set[str]]] = {}
    for stage in stages.STAGES:
        for name in stage.files():
            path = solutions / name
            if not path.exists():
                continue
            given = set(filter(None, map(_significant, rendered[name].splitlines())))
            for block in solution_blocks(path.read_text()):
                lines = set(filter(None, map(_significant, block))) - given
                if lines:
                    keys.setdefault(stage.number, []).append(lines)
    return keys


def answers_in(text: str | bytes, keys: dict[int, list[set[str]]]) -> set[int]:
    """The stages whose answers ``text`` holds: most lines of one of their solution blocks."""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    lines = set(filter(None, map(_significant, text.splitlines())))
    return {n for n, blocks in keys.items() if any(len(b & lines) >= max(1, 0.6 * len(b)) for b in blocks)}


def audit(contents: dict[str, bytes], allowed: set[int], keys: dict[int, list[set[str]]],
          hidden_names: set[str] = frozenset()) -> list[str]:
    """What in an edition (relative path -> bytes) gives away the answers of a stage not in
    ``allowed``, a solution block, a wrong solution or (``hidden_names``) a hidden check."""
    problems = []
    for rel in sorted(contents):
        parts = Path(rel).parts
        if "solutions" in parts[:-1] or parts[:2] == ("tests", "wrong"):
            problems.append(f"{rel}: {'a solutions folder' if 'solutions' in parts else 'a wrong solution'}")
        if Path(rel).suffix not in (".py", ".cu", ".ipynb", ".md", ".json", ".txt", ".sh", ""):
            continue
        text = "\n".join(_lines(rel, contents[rel]))
        if parts[0] != "grader" and any(map(is_marker, text.splitlines())):
            problems.append(f"{rel}: holds a solution block")   # (kernels/solution_file.py: the markers)
        leaked = sorted(answers_in(text, keys) - allowed)
        if leaked:
            problems.append(f"{rel}: holds the answers of " + ", ".join(f"stage{n}" for n in leaked)
                            + " (neither published nor shipped as given code)")
        named = sorted(n for n in hidden_names if n in text)
        if named:
            problems.append(f"{rel}: names hidden check(s) {', '.join(named)}")
    return problems


def _lines(rel: str, data: bytes) -> list[str]:
    """A file's lines; a notebook's are its cells' source lines."""
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return []
    if rel.endswith(".ipynb"):
        try:
            cells = json.loads(text).get("cells", [])
        except ValueError:
            return []
        return [ln for c in cells for ln in "".join(c.get("source", "")).splitlines()]
    return text.splitlines()


def on_disk(folder: Path, meta: dict) -> dict[str, bytes]:
    """An edition's files as they are now (what edition.json lists, and any .new beside them)."""
    found = {}
    for rel in meta.get("files", {}):
        for name in (rel, rel + NEW):
            try:
                data = files.read_plain(Path(folder) / name, limit=1 << 30)
            except files.UnsafeFile:
                continue
            if data is not None:
                found[name] = data
    return found


def fill_repository(contents: dict[str, bytes], repo: str | None) -> None:
    """Point the Colab badge and set-up cell of every notebook in ``contents`` at the GitHub ``repo``
    (``OWNER/NAME``), in place; nothing without one."""
    for rel, data in contents.items():
        if repo and rel.endswith(".ipynb"):
            contents[rel] = data.replace(PLACEHOLDER.encode(), repo.encode())


def cleared(notebook: bytes) -> bytes:
    """A notebook with no stored outputs: nothing in it says "passed" before the learner's own run."""
    nb = json.loads(notebook)
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    return (json.dumps(nb, indent=1, ensure_ascii=False) + "\n").encode()
