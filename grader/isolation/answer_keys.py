"""The answer keys, and how the ``user`` mechanism keeps them out of a worker's reach.

``ANSWER_KEYS`` are what learner code must never read: the reference solutions, the tests (their
wrong solutions quote the solutions), the hidden checks and the float64 reference.  Under
bubblewrap they are not in the worker's file system at all (view.py).  A ``user`` worker shares the
machine's, so while a grading runs the keys, the submission graded and a batch's submissions and
records lose every permission of other users, and get them back when the last grading of the
checkout ends.  Each mode is recorded before it is changed, so a grading that was killed loses
nothing: the next one out restores it.
"""

from __future__ import annotations

import glob
import os
import stat
from pathlib import Path
from typing import Self

from kernels.loader import ROOT

from grader.isolation.private import locked, own_record, private_dir, unlink, write_record

ANSWER_KEYS = ("solutions", "tests", "grader/checks", "kernels/reference.py")


def _answer_key_paths(extra=()) -> list[Path]:
    paths = [ROOT / p for p in ANSWER_KEYS] + list(map(Path, glob.glob(str(ROOT / "kernels" / "__pycache__" /
                                                                           "reference.*"))))
    return [*paths, *map(Path, extra)]


def _keys_files() -> tuple[Path, Path]:
    """The record of the modes taken away in this checkout (path -> mode before), and the lock every
    grading of this checkout that hides them holds shared while its workers run."""
    import hashlib
    name = f"hidden-modes-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]}"
    return private_dir() / f"{name}.json", private_dir() / f"{name}.lock"


class AnswerKeys:
    """For the ``user`` mechanism: while it is held, the answer keys (and ``extra`` folders: the
    submission graded, a batch's submissions and records) are unreadable to other users.

    Several gradings of one checkout may run at once: each holds a shared lock while its workers
    run, and the last one out gives every mode back, as recorded (in the grader's own folder) when
    it was taken away.  A grading that was killed leaves the record: the next one out restores it.
    """

    def __init__(self, extra=()):
        self.extra = [str(p) for p in extra]
        self._fd: int | None = None

    def __enter__(self) -> Self:
        import fcntl
        record, lock = _keys_files()
        self._fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)         # waits while a grading gives the modes back
        with locked(record.with_suffix(".state")):
            modes = own_record(record)
            for path in _answer_key_paths(self.extra):
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if st.st_mode & 0o077 and not stat.S_ISLNK(st.st_mode):
                    modes.setdefault(str(path), stat.S_IMODE(st.st_mode))
                    write_record(record, modes)      # recorded before it is changed: a kill loses nothing
                    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
        return self

    def __exit__(self, *exc) -> None:
        import fcntl
        if self._fd is None:
            return
        record, _ = _keys_files()
        try:
            with locked(record.with_suffix(".state")):
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)   # no other grading holds them
                except OSError:
                    return
                restore_modes()
        finally:
            os.close(self._fd)
            self._fd = None


def restore_modes() -> list[str]:
    """Give back every mode an AnswerKeys took away, as recorded; returns the paths changed."""
    record, _ = _keys_files()
    changed = []
    for path, mode in own_record(record).items():
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISLNK(st.st_mode) and isinstance(mode, int):
            os.chmod(path, (stat.S_IMODE(st.st_mode) & ~0o077) | (mode & 0o077))
            changed.append(path)
    unlink(str(record))
    return changed


_held: list[AnswerKeys] = []


def protect_answer_keys(extra=()) -> None:
    """For the ``user`` mechanism: hide the answer keys (and ``extra`` folders, e.g. a batch's
    submissions and records) from other users until this process ends (AnswerKeys); their modes
    come back when it exits, or when the last grading that hid them ends."""
    import atexit
    keys = AnswerKeys(extra).__enter__()
    if not _held:
        atexit.register(lambda: [k.__exit__() for k in _held])
    _held.append(keys)
