"""Compile caches a worker keeps between gradings of one person's own files.

Compiling every kernel of a stage is most of a cold grading's time; a cache kept in the grader's
private folder lets the next grading of the same files skip it.  Learner code writes to a cache, so
it is never shared: not between the learner's files and the reference, and a batch (other people's
code) gets none.  The workers of one grading, each under a uid of its own, share theirs through a
group (``CACHE_GID``) and a umask that keeps what one writes usable by the others.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from grader.isolation.mechanism import UID_BASE, UID_SLOTS, IsolationError
from grader.isolation.private import private_dir

#: Where a worker finds its compile cache inside bubblewrap.
CACHE_MOUNT = "/compile-cache"


def compile_cache(name: str) -> Path:
    """A compile cache kept between gradings of one person's own files (``name``: 'stages' or
    'solutions'), so that only the first grading pays for compiling every kernel.

    Learner code writes to it, so it is never shared: not between the learner's files and the
    reference, and a batch (other people's code) gets none.  It lives in the grader's folder,
    out of reach of other users' workers."""
    if name not in ("stages", "solutions"):
        raise ValueError(f"name must be 'stages' or 'solutions', not {name!r}")
    path = private_dir() / f"cache-{name}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        owner = path.lstat().st_uid
        if path.is_symlink() or not path.is_dir() or (owner != os.geteuid()
                                                      and not UID_BASE <= owner < UID_BASE + UID_SLOTS):
            raise IsolationError(f"{path} is not a compile cache of the grader's: remove it") from None
    return path


#: The group of a compile cache that the workers of one grading share, each under a uid of its own.
CACHE_GID = UID_BASE + UID_SLOTS + 1


#: Those workers' umask: what one of them adds to the cache, the others may read and replace.
CACHE_UMASK = 0o007


def share(folder: Path, gid: int = CACHE_GID) -> None:
    """Make ``folder`` a cache for workers in group ``gid``: every folder in it setgid and the group's
    (so what a worker adds joins the group), every file readable and writable by the group.

    Every entry is opened without following links, from its folder's handle (os.fwalk), and changed
    through that handle: a link a worker planted, or a folder swapped for one while this runs, leads
    nowhere.  A file with other names elsewhere (a hard link a worker made) is removed, not shared:
    it may be someone else's.
    """
    def share(fd: int, folder: bool) -> None:
        mode = os.fstat(fd).st_mode
        os.fchown(fd, -1, gid)
        os.fchmod(fd, 0o2770 if folder else (stat.S_IMODE(mode) & 0o777) | 0o660)

    top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        share(top, True)
    finally:
        os.close(top)
    for _, dirs, names, dir_fd in os.fwalk(folder, follow_symlinks=False):
        for name, is_dir in [(d, True) for d in dirs] + [(n, False) for n in names]:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | (os.O_DIRECTORY if is_dir else 0)
            try:
                fd = os.open(name, flags, dir_fd=dir_fd)
            except OSError:
                continue                       # a link (ELOOP), or gone: nothing to share
            try:
                st = os.fstat(fd)
                if not stat.S_ISDIR(st.st_mode) and st.st_nlink > 1:
                    os.unlink(name, dir_fd=dir_fd)
                elif stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                    share(fd, stat.S_ISDIR(st.st_mode))
            finally:
                os.close(fd)


def cache_env(cache: str) -> dict[str, str]:
    return dict(TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
                TORCH_EXTENSIONS_DIR=f"{cache}/torch_extensions", CUDA_CACHE_PATH=f"{cache}/nv",
                WORKBOOK_CACHE=f"{cache}/workbook")         # stage 4's CUDA builds (kernels/cuda_build.py)
