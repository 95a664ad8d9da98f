"""Workers forked from a process that imported torch once: for tests that grade many files and
are about the checks, not the sandbox.

Starting a worker is mostly importing torch: about 2.5 s of a core each time on a 2-core machine.
tests/test_wrong_solutions.py grades about 80 wrong solutions in its slow part, one worker each,
so that import was most of the sweep.  Inside ``forked_workers()`` a worker the runner starts
without isolation (mechanism "none") is instead forked from a multiprocessing forkserver that
imported torch, numpy and Triton once, and runs the worker's own code (``child._worker_main``)
with what the runner gave it: the same pipes, config, environment, working folder and umask, in a
session of its own, in the runner's cgroup where there is one.  Rlimits, the guard, the stage
import and every call are the worker's as ever; the grader's side (grader/isolation/runner.py)
does not change.  What a forked worker lacks is the sandbox, so ``forked_workers`` insists on
mechanism "none": the isolation suites (tests/test_hostile*.py, test_sandbox.py) and the quick
run's wrong solutions, graded in the sandbox, are what test isolation.

The one difference a worker can see: the forkserver, not the grader, is its parent, so it asks to
be killed with the forkserver (which ends with the process that started it).
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import subprocess
import sys
import types
from multiprocessing import reduction

from grader.isolation import choice, runner

PRELOAD = ["torch", "numpy", "triton"]
CHILD_MODULE = "grader.isolation.child"

_context = None


def _forkserver():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


class _Fd:
    """An fd handed to the forked child: duplicated into it when the process object is pickled."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


def _worker(fd_in, fd_out, fd_config, log, env, cwd, umask, procs_files) -> None:
    """The forked child: the runner's session, folder, environment and output, then the worker."""
    os.setsid()
    for path in procs_files:                      # the runner's cgroup, as its shell wrapper would enter it
        with open(path, "w") as f:
            f.write(str(os.getpid()))
    os.chdir(cwd)
    os.umask(umask)
    os.environ.clear()
    os.environ.update(env)
    for target in (1, 2):
        os.dup2(log, target)
    os.close(log)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    from grader.isolation import child
    from grader.isolation.limits import Limits
    with open(fd_config, "rb") as f:
        config = json.loads(f.read())
    child._worker_main(child._Pipes(fd_in, fd_out), config["stage"], config["source"], Limits(**config["limits"]),
                       os.getppid(), tuple(config["private"]), tuple(config["protected"]),
                       own_uid=config["own_uid"], cut_network=config.get("cut_network", False))


class _Process:
    """A forked worker seen as the runner sees a ``subprocess.Popen``."""

    def __init__(self, process, args):
        self._process, self.args = process, args
        self.pid = process.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not self._process.is_alive():
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def kill(self):
        if self.poll() is None:
            self._process.kill()


def _split(argv: list[str]) -> tuple[list[str], list[str]] | None:
    """``(cgroup procs files, the worker's three fds)`` of a worker's command, or None for another one."""
    files: list[str] = []
    if argv[:2] == ["/bin/sh", "-c"] and "enter-cgroup" in argv and "--" in argv:
        files = argv[argv.index("enter-cgroup") + 1:argv.index("--")]
        argv = argv[argv.index("--") + 1:]
    if len(argv) == 6 and argv[1:3] == ["-m", CHILD_MODULE]:
        return files, argv[3:]
    return None


def popen(argv, *, cwd=None, env=None, stdout=None, stderr=None, umask=-1, **kwargs):
    """``subprocess.Popen`` for the runner: a worker's command is forked, any other is run."""
    found = _split(list(argv))
    if found is None:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, umask=umask, **kwargs)
    if stdout != stderr or not isinstance(stdout, int):
        raise ValueError("a worker's stdout and stderr are one pipe")
    files, fds = found
    mask = os.umask(0)
    os.umask(mask)
    process = _forkserver().Process(target=_worker, daemon=True, args=(
        *(_Fd(int(fd)) for fd in fds), _Fd(stdout), dict(env if env is not None else os.environ),
        str(cwd or os.getcwd()), umask if umask >= 0 else mask, files))
    process.start()
    return _Process(process, argv)


@contextlib.contextmanager
def forked_workers():
    """Within this block, the runner's workers (mechanism "none" only) are forked, not started."""
    if choice.choose().name != "none":
        raise RuntimeError("forked workers have no sandbox: grade with WORKBOOK_ISOLATION=none")
    saved = runner.subprocess
    runner.subprocess = types.SimpleNamespace(**{**{k: getattr(subprocess, k) for k in dir(subprocess)
                                                    if not k.startswith("__")}, "Popen": popen})
    try:
        yield
    finally:
        runner.subprocess = saved
