"""The grader's own temporary folder, and the records it keeps there.

One folder per grader uid, ``$TMPDIR/workbook-grader-UID``, holds what workers must not list:
snapshots of submissions, workers' scratch folders and copies, bwrap's option files, logs, compile
caches (caches.py) and the grader's records (probes that succeeded, answer-key modes taken away).
Workers may traverse it (0711) but not list it, so a worker reaches only what it is given by name.
What a grading makes there is named after its pid, and what a grader that was killed left is swept
away by the next.  A record is believed only from a file of the grader's own that nobody else could
have written, and replaced whole.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from grader.isolation.mechanism import IsolationError


def private_dir() -> Path:
    """The grader's own temporary folder: traversable (0711) but not listable by workers.

    Snapshots of submissions go in it under unguessable names; a worker is shown its own (by a
    bind mount, or by the name it is given), never another's.
    """
    path = Path(tempfile.gettempdir()) / f"workbook-grader-{os.geteuid()}"
    try:
        path.mkdir(mode=0o711)
    except FileExistsError:
        pass
    st = path.lstat()
    if path.is_symlink() or st.st_uid != os.geteuid():
        raise IsolationError(f"{path} is not the grader's own folder (owner {st.st_uid}): remove it")
    os.chmod(path, 0o711)
    _sweep(path)
    return path


def _sweep(folder: Path) -> None:
    """Remove what graders that were killed left behind (every name starts with its grader's pid)."""
    for entry in os.listdir(folder):
        pid = entry.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        target = folder / entry
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() and not target.is_symlink() else unlink(target)


def own_record(path: Path) -> dict:
    """A record's entries, if it is a regular file of ours that nobody else could have written."""
    import json
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return {}
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_record(path: Path, record: dict) -> None:
    """Replace ``path`` with the JSON of ``record``, mode 0600, at once (a reader sees old or new)."""
    import json
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, path)


class locked:
    """An exclusive lock on ``path`` (made 0600) for the length of a ``with`` block."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
