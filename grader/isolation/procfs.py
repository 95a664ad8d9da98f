"""A worker's processes, memory and files, as the grader counts them: from /proc and the file system.

The runner polls a worker's memory ten times a second (``Sandbox.usage_mb``): the anonymous and
shared resident pages of every process below it and, for a dedicated uid, its files in /dev/shm and
its SysV shared memory, which outlive any process.  A uid's processes are found by the owner of
their /proc entries, its files by a walk that follows no link.  With no /proc (macOS) a worker is
its own process alone.
"""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:        # no /proc (macOS): the worker alone
        return [pid]
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def rss_kb(pid: int) -> int:
    """A process's anonymous and shared resident memory (a shared mapping counts too), in KiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("RssAnon:", "RssShmem:")))
    except (OSError, ValueError, IndexError):
        return 0


def processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def owned_files(top: str | None, uid: int, depth: int | None = None) -> list[str]:
    if not top or not os.path.isdir(top):
        return []
    found = []
    base = top.rstrip(os.sep).count(os.sep)
    for folder, dirs, files in os.walk(top):
        if depth is not None and folder.count(os.sep) - base >= depth:
            dirs[:] = []
        for name in dirs + files:
            path = os.path.join(folder, name)
            try:
                if os.lstat(path).st_uid == uid:
                    found.append(path)
            except OSError:
                pass
    return found


def files_mb(top: str | None, uid: int | None) -> int:
    total = 0
    for path in owned_files(top, uid) if uid is not None else []:
        try:
            st = os.lstat(path)
            total += st.st_blocks * 512
        except OSError:
            pass
    return total >> 20


def sysv_objects(uid: int) -> list[tuple[str, int]]:
    """(kind, id) of the SysV IPC objects ``uid`` owns or made, from /proc/sysvipc."""
    found = []
    for kind in ("shm", "sem", "msg"):
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()
        except OSError:
            continue
        if not lines:
            continue
        head = lines[0].split()
        for line in lines[1:]:
            row = dict(zip(head, line.split()))
            try:
                if uid in (int(row["uid"]), int(row["cuid"])):
                    found.append((kind, int(row[{"shm": "shmid", "sem": "semid", "msg": "msqid"}[kind]])))
            except (KeyError, ValueError):
                continue
    return found


def sysv_shm_mb(uid: int) -> int:
    """The memory of the SysV shared-memory segments ``uid`` owns: it outlives any process."""
    total = 0
    try:
        lines = Path("/proc/sysvipc/shm").read_text().splitlines()
    except OSError:
        return 0
    head = lines[0].split() if lines else []
    for line in lines[1:]:
        row = dict(zip(head, line.split()))
        try:
            if uid in (int(row["uid"]), int(row["cuid"])):
                total += int(row.get("rss", row["size"])) + int(row.get("swap", 0))
        except (KeyError, ValueError):
            continue
    return total >> 20
