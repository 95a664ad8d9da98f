"""A uid of its own for each worker, its own copies of what it may read, and what it leaves behind.

Run by root, the grader starts each worker as a dedicated unprivileged uid (``UID_BASE`` plus a
slot; a lock per slot says which are held), under bubblewrap or on its own (the ``user``
mechanism).  Such a worker reads its own copy of each folder it is given, readable by its uid alone,
so no snapshot is ever readable by another worker's uid.  When it ends its processes are killed by
uid; under ``user``, whatever the uid left where any user may write (files, folders, SysV IPC) is
removed, and again before its slot serves another worker.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from grader.isolation.mechanism import UID_BASE, UID_SLOTS, IsolationError
from grader.isolation.private import private_dir, unlink
from grader.isolation.procfs import processes_of, sysv_objects


def claim_uid() -> tuple[int, int]:
    """A dedicated uid no other worker on this machine holds, and the lock that holds it."""
    import fcntl
    locks = Path(tempfile.gettempdir()) / f"workbook-uids-{os.geteuid()}"
    locks.mkdir(mode=0o700, exist_ok=True)
    if locks.is_symlink() or locks.stat().st_uid != os.geteuid():
        raise IsolationError(f"{locks} is not the grader's own folder")
    os.chmod(locks, 0o700)
    for slot in range(UID_SLOTS):
        fd = os.open(locks / str(slot), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        uid = UID_BASE + slot
        if processes_of(uid):  # a grader that was killed left them: they go first
            subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "kill", "-KILL", "-1"],
                           capture_output=True, timeout=30)
        remove_leftovers(uid)   # and what they left, before the uid serves anyone else
        return uid, fd
    raise IsolationError(f"all {UID_SLOTS} worker uids are in use")


def copy_for(folder: str, uid: int) -> str:
    """A copy of the grader's own ``folder`` (a snapshot: plain files) that only ``uid`` may read: a
    folder of mode 0700 and files of mode 0600, owned by ``uid``, in the grader's folder.  Workers of
    one grading each get their own, so no snapshot is ever readable by another worker's uid."""
    copy = f"{folder}-w{uid}" if os.path.dirname(folder) == str(private_dir()) else \
        tempfile.mkdtemp(prefix=f"{os.getpid()}-view-", dir=private_dir())
    os.makedirs(copy, mode=0o700, exist_ok=True)
    os.chown(copy, uid, uid)
    os.chmod(copy, 0o700)
    for top, dirs, names, top_fd in os.fwalk(folder, follow_symlinks=False):
        target = os.path.join(copy, os.path.relpath(top, folder))
        for name in dirs:
            os.mkdir(os.path.join(target, name), 0o700)
            os.chown(os.path.join(target, name), uid, uid)
        for name in names:
            try:
                src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=top_fd)
            except OSError:
                continue                        # a link, or not a file: nothing the worker is given
            with open(src, "rb") as f:
                data = f.read()
            fd = os.open(os.path.join(target, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
                os.fchown(f.fileno(), uid, uid)
                f.write(data)
    return copy


#: Folders every user may write to: what a worker's uid made there is removed when it ends.
SHARED_FOLDERS = ("/tmp", "/var/tmp", "/run/lock", "/dev/shm", "/dev/mqueue")
_IPC = {"shm": "-m", "sem": "-s", "msg": "-q"}        # /proc/sysvipc/<kind> -> ipcrm's option


def leftovers(uid: int) -> list[str]:
    """What ``uid`` left where any user may write: its files and folders in the world-writable folders
    (SHARED_FOLDERS, the temporary folder, and world-writable folders inside them), and its SysV
    shared memory, semaphores and message queues (as ``sysv:<kind>:<id>``)."""
    found: list[str] = []
    tops = {os.path.realpath(t) for t in (*SHARED_FOLDERS, tempfile.gettempdir()) if os.path.isdir(t)}
    todo = sorted(tops)
    seen: set[tuple[int, int]] = set()
    while todo:
        folder = todo.pop()
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for name in entries:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if st.st_uid == uid:
                found.append(path)
            elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))   # a folder anyone may write to: the uid may have, too
                todo.append(path)
    return found + [f"sysv:{kind}:{ident}" for kind, ident in sysv_objects(uid)]


def remove_leftovers(uid: int) -> list[str]:
    """Remove what ``uid`` left (``leftovers``), after its processes are gone; returns what it removed.
    A folder is removed whole, without following links (shutil.rmtree does not)."""
    removed = []
    for item in leftovers(uid):
        if item.startswith("sysv:"):
            _, kind, ident = item.split(":")
            subprocess.run(["ipcrm", _IPC[kind], ident], check=False, capture_output=True, timeout=30)
        elif os.path.isdir(item) and not os.path.islink(item):
            shutil.rmtree(item, ignore_errors=True)
        else:
            unlink(item)
        removed.append(item)
    return removed
