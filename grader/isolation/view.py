"""What a bubblewrap worker's file system holds.

Read-only: the system's folders (/usr, /etc, /opt, ...), the Python installation, the workbook's
``kernels/`` without the reference, ``grader/__init__.py`` and this package, ``grader/isolation/``,
whole (the worker's own code; tests/test_isolation.py checks that the worker imports nothing else
of the workbook), and the folders a worker is given (the submission's snapshot, or a dedicated
uid's copy of it).  ``/tmp`` and ``/dev/shm`` are private, size-capped tmpfs.  A checkout or a
class's folder that lies inside a system folder bound whole gets an empty tmpfs over it first, so
that its answer keys, submissions and records are not seen through the system's bind.
"""

from __future__ import annotations

import glob
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kernels.loader import ROOT

_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")


@dataclass
class View:
    """The folders and files a worker may read, besides the system and the Python installation."""
    readable: tuple = ()                           # e.g. the submission's snapshot
    hidden: tuple = ()                             # folders it must not see even inside a system folder
    gpu: bool = field(default_factory=lambda: bool(glob.glob("/dev/nvidia*")))

    def python_roots(self) -> list[str]:
        roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
        exe = os.path.realpath(sys.executable)
        roots.add(os.path.dirname(os.path.dirname(exe)))
        return sorted(r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots))

    def workbook_paths(self) -> list[Path]:
        """What the worker reads of the workbook: ``kernels/`` without the reference, and the grader's
        isolation package whole, with the ``grader/__init__.py`` it sits in."""
        files = [p for p in sorted((ROOT / "kernels").glob("*.py")) if p.name != "reference.py"]
        return files + [ROOT / "grader" / "__init__.py", ROOT / "grader" / "isolation"]

    def covered(self) -> list[str]:
        """The workbook and the ``hidden`` folders that lie inside a system folder bound whole (a checkout
        under /opt, /usr or /etc): each gets an empty tmpfs over it, so that its answer keys, submissions
        and records are not seen through the system's bind; what the worker needs is bound again on top."""
        system = [s for s in _SYSTEM if os.path.isdir(s) and not os.path.islink(s)]
        found = set()
        for path in (ROOT, *self.hidden):
            real = os.path.realpath(path)
            if any(_under(real, s) for s in system):
                found.add(real)
        return sorted(p for p in found if not any(p != o and _under(p, o) for o in found))


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def bind_args(view: View, *, tmp_mb: int, shm_mb: int, copies: dict | None = None) -> list[str]:
    """bwrap's options for ``view``; ``copies`` maps a readable folder to the copy bound in its place."""
    args: list[str] = []
    for path in _SYSTEM:
        if os.path.islink(path):        # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
             "--perms", "1777", "--size", str(shm_mb << 20), "--tmpfs", "/dev/shm"]
    covers = view.covered()
    # A venv inside the workbook is bound whole; of the rest of the workbook, only the paths listed.
    binds = [*view.python_roots(), *map(str, view.workbook_paths()), *map(str, view.readable)]
    # A bind that holds a covered folder goes first (the cover hides what it must of it); all others after.
    first = [b for b in binds if any(_under(c, os.path.realpath(b)) for c in covers)]
    later = [b for b in binds if b not in first]
    made: set[str] = set()

    def folders_on_the_way(paths) -> None:     # readable (bwrap would make them 0700)
        for path in paths:
            for parent in reversed(Path(path).parents[:-1]):
                p = str(parent)
                inside = [c for c in covers if _under(p, c)]
                exists = any(_under(p, s) for s in _SYSTEM) and not (inside and p not in inside)
                if p not in made and not exists:
                    args.extend(["--perms", "0755", "--dir", p])
                    made.add(p)

    def bind(paths) -> None:
        for path in paths:
            args.extend(["--ro-bind", str((copies or {}).get(path, path)), path])

    folders_on_the_way(first)
    bind(first)
    for cover in covers:
        args += ["--perms", "0755", "--size", str(1 << 20), "--tmpfs", cover]
    folders_on_the_way(later)
    bind(later)
    if view.gpu:
        for dev in sorted(glob.glob("/dev/nvidia*")):
            args += ["--dev-bind", dev, dev]
        args += ["--ro-bind", "/sys", "/sys"]
    return args
