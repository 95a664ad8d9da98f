"""Reading files a learner controls, without trusting them.

A submission can hold anything a file system can: a symbolic link to ``solutions/``, a FIFO that
blocks whoever opens it, a device, a file of random bytes, a file of gigabytes.  The grader reads
learner files only through ``read_plain``: it never follows a link, never blocks, reads at most
``limit`` bytes, and raises ``UnsafeFile`` with a message a learner can act on.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

LIMIT = 4 << 20  # no stage file is near 4 MiB


class UnsafeFile(ValueError):
    """A file the grader will not read; the message says what it is and what to do."""


_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder"))


def kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a plain file")


def read_plain(path: str | os.PathLike, *, limit: int = LIMIT) -> bytes | None:
    """The bytes of a plain file; None if there is nothing at ``path``; UnsafeFile for anything else."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            raise UnsafeFile(f"{path} cannot be read: {exc.strerror}") from None
        if stat.S_ISREG(mode):
            raise UnsafeFile(f"{path} cannot be read: {exc.strerror}") from None
        raise UnsafeFile(f"{path} is {kind(mode)}: the grader reads only plain files; "
                         "replace it with the file itself") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path} is {kind(st.st_mode)}: the grader reads only plain files; "
                             "replace it with the file itself")
        if st.st_size > limit:
            raise UnsafeFile(f"{path} is {st.st_size} bytes; a stage file is at most {limit} bytes")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise UnsafeFile(f"{path} grew past {limit} bytes while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def plain_folder(path: str | os.PathLike) -> bool:
    """True for a real folder (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def plain_file(path: str | os.PathLike) -> bool:
    """True for a plain file (not a link, FIFO, socket or device)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
