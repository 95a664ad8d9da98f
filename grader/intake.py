"""Intake: a class's submissions as a learning-management system exports them.

``python -m grader batch SUBMISSIONS`` takes one entry of SUBMISSIONS per learner:

    ada/                   their stage files, or a whole workbook (ada/stages/...): graded where they are
    lee/myproject/...      the same one folder further down (an export's folder per learner around the
                           learner's own folder): the stage files are copied into OUT/intake/lee/
    kim.zip                a zip of either: the stage files are extracted into OUT/intake/kim/

A zip is never unpacked as it stands.  Every member is checked first, and the zip is refused, with
the reason, when one member is a symbolic link (or any other kind of file than a plain file or a
folder), has an absolute path or a ``..`` in its path, or is encrypted, or when the zip holds more
than ``MAX_MEMBERS`` members or their sizes add up to more than ``MAX_TOTAL`` bytes (a zip bomb).
Then only the stage files are read, each up to the size a stage file may have, and written into the
batch's own folder, never next to the learner's files.

Anything else is left out with the reason: stage files in two folders, or two copies of one stage
file, or stage files deeper than one folder down, or a file that is not a zip.  A folder or zip
that holds no stage file at all is a learner who handed in nothing: graded, "not started".
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
import zipfile
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from grader import stages
from grader.isolation import files

FOLDER = "intake"                # OUT/intake/<learner>/: the stage files taken from a nested folder or a zip
MAX_MEMBERS = 20_000             # a whole workbook with its git history is a few thousand files
MAX_TOTAL = 512 << 20            # bytes, uncompressed, over every member of a zip
_DEEPEST = 6                     # folders searched below a learner's own, only to say where their files are
# Never a learner's own folder: macOS's resource forks, beside the files in zips it makes, and an
# edition's published reference solutions, which have the stage files' names.
_IGNORED = ("__MACOSX", "published")


@dataclass(frozen=True)
class Entry:
    """One entry of SUBMISSIONS: the learner it is, and where their stage files are read from."""
    name: str                    # the learner: the folder's name, or the zip's without .zip
    source: Path                 # what SUBMISSIONS holds for them
    folder: Path | None          # the folder to grade; None when the entry is left out
    problem: str = ""            # why it is left out


def stage_file_names() -> set[str]:
    """Every file name a stage is graded from (``stage1_online_softmax.py``, ``...variable_block.cu``)."""
    return {name for stage in stages.STAGES for name in stage.files()}


def survey(submissions: Path, out: Path) -> list[Entry]:
    """Each entry of ``submissions`` (but ``out``), as a learner to grade or one left out with why.

    Nested folders and zips are taken into ``out/intake/`` now; what is there already and still
    current is left as it is."""
    submissions, out = Path(submissions), Path(out)
    found = [p for p in sorted(submissions.iterdir()) if p.resolve() != out.resolve()]
    folders = {p.name for p in found if files.plain_folder(p)}
    zips: dict[str, int] = {}
    for p in found:
        if _is_zip(p):
            zips[_zip_name(p)] = zips.get(_zip_name(p), 0) + 1
    entries = []
    for p in found:
        if p.name.startswith("."):
            mode = os.lstat(p).st_mode
            what = {stat.S_IFDIR: "a hidden folder", stat.S_IFREG: "a hidden file"}.get(
                stat.S_IFMT(mode), f"hidden, and {files.kind(mode)}")
            entries.append(Entry(p.name, p, None, what))
        elif files.plain_folder(p):
            entries.append(_folder(p, out))
        elif _is_zip(p):
            name = _zip_name(p)
            if name in folders or zips[name] > 1:
                other = f"{name}/" if name in folders else f"another {name}.zip"
                entries.append(Entry(name, p, None, f"{other} is there too: one submission per learner"))
            else:
                st = os.lstat(p)
                entries.append(_zip(p, out / FOLDER / name, st.st_size, st.st_mtime_ns, st.st_ino))
        else:
            mode = os.lstat(p).st_mode
            what = "a file that is not a .zip" if stat.S_ISREG(mode) else files.kind(mode)
            entries.append(Entry(p.name, p, None, f"{what}: a learner's submission is a folder or a .zip"))
    return sorted(entries, key=lambda e: e.name)


def submitted(folder: Path, chosen: list | None = None) -> str | None:
    """When a learner's submission was made, as ISO 8601 UTC (``2026-11-27T09:30:00Z``): the newest
    modification time of the files of ``chosen`` stages (all without it) in ``folder``, a folder that
    ``survey`` gave.  For a zip that is its newest member's date, or the zip's own time where its
    members carry none; for a nested folder, that of the learner's own files.  None when there is none."""
    from grader.grade import submission_folder
    newest = None
    for stage in chosen or stages.STAGES:
        where = submission_folder(folder, stage)
        for name in stage.files():
            try:
                st = os.lstat(where / name)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                newest = st.st_mtime if newest is None else max(newest, st.st_mtime)
    if newest is None:
        return None
    return datetime.fromtimestamp(newest, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- a folder -------------------------------------------------------------------------------------
def _holds(folder: Path, names: set[str]) -> list[str]:
    """The stage files in ``folder`` and in its ``stages/`` (relative to ``folder``)."""
    found = [n for n in sorted(names) if os.path.lexists(folder / n)]
    if files.plain_folder(folder / "stages"):
        found += [f"stages/{n}" for n in sorted(names) if os.path.lexists(folder / "stages" / n)]
    return found


def _folder(path: Path, out: Path) -> Entry:
    names = stage_file_names()
    if _holds(path, names):
        return Entry(path.name, path, path)                    # graded where it is
    inner = [d for d in sorted(path.iterdir()) if files.plain_folder(d) and not d.name.startswith(".")
             and d.name not in _IGNORED and _holds(d, names)]
    if len(inner) > 1:
        return Entry(path.name, path, None, "stage files in more than one folder: "
                     + ", ".join(f"{d.name}/" for d in inner) + "; hand in one")
    if not inner:
        deep = _deeper(path, names)
        if deep:
            return Entry(path.name, path, None, f"its stage files are too deep, at {deep}: the grader looks in the "
                         "learner's folder and one folder down; move them up")
        return Entry(path.name, path, path)                    # nothing handed in: "not started"
    found = _holds(inner[0], names)
    twice = _twice(found)
    if twice:
        return Entry(path.name, path, None, f"two copies of {twice} in {inner[0].name}/: hand in one")
    wanted = {}
    try:
        for rel in found:
            data = files.read_plain(inner[0] / rel)
            if data is not None:
                wanted[Path(rel).name] = (data, os.lstat(inner[0] / rel).st_mtime)
    except files.UnsafeFile as exc:
        return Entry(path.name, path, None, str(exc))
    dest = out / FOLDER / path.name
    _fill(dest, wanted)
    return Entry(path.name, path, dest)


def _twice(found: list[str]) -> str:
    """A stage file that is both in a folder and in its ``stages/``, or ""."""
    names = [Path(rel).name for rel in found]
    return next((n for n in names if names.count(n) > 1), "")


def _deeper(path: Path, names: set[str]) -> str:
    """Where, more than one folder down, the first stage file is (relative to ``path``), or ""."""
    seen = 0
    for top, dirs, filenames in os.walk(path):
        depth = len(Path(top).relative_to(path).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _IGNORED) if depth < _DEEPEST else []
        seen += len(filenames)
        hit = sorted(names & set(filenames))
        if hit:
            return str(Path(top, hit[0]).relative_to(path))
        if seen > MAX_MEMBERS:
            break
    return ""


def _fill(dest: Path, wanted: dict[str, tuple[bytes, float]]) -> None:
    """Make ``dest`` hold exactly ``wanted`` (name -> (bytes, modification time)), each file written
    whole (a temporary name, then a rename), those already right left as they are."""
    dest.mkdir(parents=True, exist_ok=True)
    os.chmod(dest.parent, 0o700)
    for name, (data, mtime) in wanted.items():
        target = dest / name
        try:
            same = files.read_plain(target) == data
        except files.UnsafeFile:
            same = False
        if not same:
            tmp = dest / f".{name}.{secrets.token_hex(6)}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, target)
        if os.lstat(target).st_mtime != mtime:
            os.utime(target, (mtime, mtime), follow_symlinks=False)
    for old in dest.iterdir():
        if old.name not in wanted:
            old.unlink()


# -- a zip ----------------------------------------------------------------------------------------
def _is_zip(path: Path) -> bool:
    return path.suffix.lower() == ".zip" and not path.name.startswith(".") and files.plain_file(path)


def _zip_name(path: Path) -> str:
    return path.name[:-len(".zip")]


_ABSOLUTE = re.compile(r"^([\\/]|[A-Za-z]:)")


def _refusal(info: zipfile.ZipInfo) -> str:
    """Why a member makes its zip unsafe to take in, or ""."""
    name = info.filename
    mode = info.external_attr >> 16     # a Unix mode, where the zip was made on Unix; its type, if it has one
    if stat.S_ISLNK(mode):
        return f"{name} is a symbolic link"
    if stat.S_IFMT(mode) and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        return f"{name} is {files.kind(mode)}"
    if _ABSOLUTE.match(name):
        return f"{name} has an absolute path"
    if ".." in re.split(r"[\\/]", name):
        return f"{name} has '..' in its path (it would land outside the folder it is unpacked in)"
    if info.flag_bits & 0x1:
        return f"{name} is encrypted"
    return ""


@lru_cache(maxsize=4096)
def _zip(path: Path, dest: Path, size: int, mtime_ns: int, ino: int) -> Entry:
    """Take the zip at ``path`` in (``size``, ``mtime_ns`` and ``ino`` make a changed zip another call)."""
    name = dest.name
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
            if len(infos) > MAX_MEMBERS:
                return Entry(name, path, None, f"the zip holds {len(infos)} members; at most {MAX_MEMBERS} are read")
            total = sum(i.file_size for i in infos)
            if total > MAX_TOTAL:
                return Entry(name, path, None, f"the zip unpacks to {total} bytes; at most {MAX_TOTAL} are read")
            for info in infos:
                why = _refusal(info)
                if why:
                    return Entry(name, path, None, f"the zip is refused: {why}")
            chosen = _zip_choice(infos)
            if isinstance(chosen, str):
                return Entry(name, path, None, chosen)
            wanted = {}
            for info in chosen:
                with z.open(info) as member:
                    data = member.read(files.LIMIT + 1)
                if len(data) > files.LIMIT:
                    return Entry(name, path, None, f"{info.filename} in the zip is larger than {files.LIMIT} bytes, "
                                 "more than a stage file can be")
                wanted[info.filename.replace("\\", "/").rsplit("/", 1)[-1]] = (data, _member_time(info, path))
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, OSError) as exc:
        return Entry(name, path, None, f"the zip cannot be read: {exc}")
    _fill(dest, wanted)
    return Entry(name, path, dest)


def _zip_choice(infos: list[zipfile.ZipInfo]) -> list[zipfile.ZipInfo] | str:
    """The members to take (the stage files in the zip's top, or in the one folder there that holds
    them, or in its ``stages/``), or why there is no one choice."""
    names = stage_file_names()
    bases: dict[str, list[zipfile.ZipInfo]] = {}
    deeper = ""
    for info in infos:
        parts = [p for p in re.split(r"[\\/]", info.filename) if p]
        if info.is_dir() or not parts or parts[-1] not in names or parts[0] in _IGNORED:
            continue
        folders = parts[:-1]
        if folders[-1:] == ["stages"]:
            folders = folders[:-1]
        if len(folders) > 1 or any(p.startswith(".") for p in folders):
            deeper = deeper or info.filename
            continue
        bases.setdefault("/".join(folders), []).append(info)
    if len(bases) > 1:
        shown = ", ".join(f"{b}/" if b else "the zip's top" for b in sorted(bases))
        return f"stage files in more than one folder of the zip: {shown}; hand in one"
    if not bases:
        if deeper:
            return (f"the stage files in the zip are too deep, at {deeper}: the grader looks in the zip's top "
                    "and one folder down")
        return []                                              # nothing handed in: "not started"
    chosen = next(iter(bases.values()))
    twice = _twice([i.filename.replace("\\", "/") for i in chosen])
    if twice:
        return f"two copies of {twice} in the zip: hand in one"
    return chosen


def _member_time(info: zipfile.ZipInfo, path: Path) -> float:
    """A member's date (a zip keeps local time, no zone), or the zip's own time where it has none
    (1980-01-01, the earliest a zip can hold, is what tools write for "no date")."""
    if info.date_time[:3] > (1980, 1, 1):
        try:
            return time.mktime(info.date_time + (0, 0, -1))
        except (OverflowError, ValueError):
            pass
    return os.lstat(path).st_mtime
