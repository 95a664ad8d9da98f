"""A cgroup for each worker: memory of every kind, and processes.

Where this process may make one (cgroup v2, or v1's memory and pids controllers), each worker runs
in a cgroup of its own: its memory limit counts shared memory and tmpfs pages that per-process
counts miss, with no swap; a pids limit caps its processes; its memory events say whether it ran
out; and killing every process in it ends whatever the worker left.  ``WORKBOOK_NO_CGROUP`` turns
them off.  Where none can be made, the grader's polling (procfs.py) and the worker's rlimits stand
alone.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


class CGroup:
    """A cgroup (v1 or v2) for one worker, where this process may make one; None where it may not."""

    def __init__(self, dirs: dict[str, Path], version: int):
        self.dirs, self.version = dirs, version

    @classmethod
    def make(cls, memory_mb: int, processes: int) -> "CGroup | None":
        if os.environ.get("WORKBOOK_NO_CGROUP") or not os.path.isdir("/sys/fs/cgroup"):
            return None
        name = f"workbook-{os.getpid()}-{time.monotonic_ns()}"
        limit = str(memory_mb << 20)
        made: dict[str, Path] = {}
        try:
            if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):   # v2, unified
                here = _own_cgroup("")
                d = Path("/sys/fs/cgroup") / here.lstrip("/") / name
                d.mkdir()
                made["unified"] = d
                (d / "memory.max").write_text(limit)
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(processes))
                return cls(made, 2)
            for ctl in ("memory", "pids"):
                d = Path("/sys/fs/cgroup") / ctl / _own_cgroup(ctl).lstrip("/") / name
                d.mkdir()
                made[ctl] = d
            mem = made["memory"]
            (mem / "memory.limit_in_bytes").write_text(limit)
            if (mem / "memory.memsw.limit_in_bytes").exists():
                (mem / "memory.memsw.limit_in_bytes").write_text(limit)
            (made["pids"] / "pids.max").write_text(str(processes))
            return cls(made, 1)
        except OSError:
            for d in made.values():
                _rmdir(d)
            return None

    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def _memory_dir(self) -> Path:
        return self.dirs["unified" if self.version == 2 else "memory"]

    def usage_mb(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        try:
            return int((self._memory_dir() / name).read_text()) >> 20
        except (OSError, ValueError):
            return 0

    def ran_out(self) -> bool:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self._memory_dir() / name).read_text()
        except OSError:
            return False
        counts = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
        return int(counts.get("oom_kill", 0) or 0) > 0 or (self.version == 2 and int(counts.get("max", 0) or 0) > 0
                                                          and int(counts.get("oom", 0) or 0) > 0)

    def pids(self) -> list[int]:
        found = set()
        for d in self.dirs.values():
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return sorted(found)

    def kill(self) -> None:
        for _ in range(20):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.05)

    def remove(self) -> None:
        self.kill()
        for d in self.dirs.values():
            for _ in range(50):
                if _rmdir(d):
                    break
                time.sleep(0.05)


def _own_cgroup(controller: str) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctls, path = line.rstrip("\n").split(":", 2)
            if (controller == "" and ctls == "") or controller in ctls.split(","):
                return path
    raise OSError(f"no {controller or 'unified'} cgroup")


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False
