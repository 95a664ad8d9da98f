"""One worker's sandbox: the command that starts it, its environment, uid, cgroup and scratch folder.

A ``Sandbox`` puts together what the mechanism (mechanism.py) needs for one worker process:
bubblewrap's options (the file system of view.py), read from a file only the grader can read; a
dedicated uid (uids.py), entered with ``setpriv``; a cgroup (cgroups.py); a scratch folder and the
worker's copies of its folders; and a clean environment, in which nothing of the grader's own
(tokens, a batch's paths) reaches the worker.  The runner (runner.py) starts the worker with its
``command``, ``env`` and ``umask``, asks it for the worker's memory and disk, and closes it.

Both real mechanisms add limits: processes, open files and the size of any file written (rlimits
set before learner code runs), memory of every kind in a cgroup where one can be made (shared
memory and tmpfs pages included) and, everywhere, the grader's own polling of the anonymous and
shared memory of every process of the worker.  When a worker ends, every process it left is
killed: the PID namespace goes with it, and a dedicated uid's processes are killed by uid.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from kernels.loader import ROOT

from grader import BATCH_OUT_ENV, BATCH_SUBMISSION_ENV
from grader.isolation.caches import CACHE_GID, CACHE_MOUNT, CACHE_UMASK, cache_env, share
from grader.isolation.cgroups import CGroup
from grader.isolation.mechanism import Mechanism
from grader.isolation.private import private_dir, unlink
from grader.isolation.procfs import descendants, files_mb, processes_of, rss_kb, sysv_shm_mb
from grader.isolation.uids import claim_uid, copy_for, remove_leftovers
from grader.isolation.view import View, bind_args

#: Workers do not autotune: kernels.tuning.AUTOTUNE_ENV, set to 0 (that module needs Triton to import).
NO_AUTOTUNE = {"WORKBOOK_AUTOTUNE": "0"}


#: A batch's submissions and records (grader/isolation/guard.py reads them in the grader, never in a worker).
_CLASS_PATHS = ("WORKBOOK_PRIVATE", "WORKBOOK_PROTECT", BATCH_SUBMISSION_ENV, BATCH_OUT_ENV)


def worker_env(*, home: str | None, uid: int | None) -> dict[str, str]:
    """A clean environment: nothing of the grader's own (tokens, paths to records) reaches the worker.

    With no home of its own (no isolation: your own machine) the worker keeps your environment,
    and with it your compile caches.  Either way it does not autotune (kernels/tuning.py): a check
    needs a right answer, not the fastest tile, and timing every tile of a table is most of a cold
    grading's compiling."""
    if home is None:                # a class's paths reach the worker only through its guard's config
        return {**{k: v for k, v in os.environ.items() if k not in _CLASS_PATHS}, "PYTHONUNBUFFERED": "1",
                **NO_AUTOTUNE}
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH",
            "CUDA_HOME", "CUDA_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "WORKBOOK_SEED", "TORCH_CUDA_ARCH_LIST",
            "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(NO_AUTOTUNE, HOME=home, TMPDIR=home, USER="learner",
               LOGNAME="learner", PYTHONDONTWRITEBYTECODE="1", PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1",
               TRITON_CACHE_DIR=f"{home}/.triton", XDG_CACHE_HOME=f"{home}/.cache")
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    return env


# -- one worker's sandbox -------------------------------------------------------------------------
class Sandbox:
    """Everything one worker process runs inside: command line, environment, uid, cgroup, scratch."""

    def __init__(self, mechanism: Mechanism, view: View, *, memory_mb: int = 8192, processes: int = 256,
                 disk_mb: int = 2048, uid: int | None = None, cache: Path | None = None):
        self.mechanism, self.view = mechanism, view
        self.cache = cache          # a compile cache of compile_cache()'s, written by the worker
        self.memory_mb, self.processes, self.disk_mb = memory_mb, processes, disk_mb
        self._uid_lock = None
        self.uid = uid
        if self.uid is None and mechanism.dedicated_uid:
            self.uid, self._uid_lock = claim_uid()
        self.cgroup = None
        self.scratch: str | None = None
        self.copies: dict[str, str] = {}   # a readable folder -> the worker's own copy of it (a dedicated uid)
        self._made: list[str] = []         # files made for the grader (bwrap's options): removed on close

    def home(self) -> str | None:
        """The worker's home and temporary folder: a tmpfs inside bubblewrap, a scratch folder of
        its own for a dedicated uid, and yours (None) without isolation."""
        if self.mechanism.name == "bubblewrap":
            return "/tmp"
        return self.scratch

    def open(self) -> None:
        if self.mechanism.name != "bubblewrap" and self.uid is not None:
            parent = private_dir()
            self.scratch = tempfile.mkdtemp(prefix=f"{os.getpid()}-scratch-", dir=parent)
            os.chown(self.scratch, self.uid, self.uid)
            os.chmod(self.scratch, 0o700)
        if self.cache is not None and self.uid is not None:
            share(self.cache)
        if self.uid is not None and self.mechanism.name != "none":
            for folder in map(str, self.view.readable):
                if os.path.isdir(folder) and not os.path.islink(folder):
                    self.copies[folder] = copy_for(folder, self.uid)
        self.cgroup = CGroup.make(self.memory_mb, self.processes)

    def worker_path(self, folder: str) -> str:
        """Where the worker finds the readable ``folder``: its own copy's path for a dedicated uid without
        bubblewrap, else the same path (bubblewrap binds the copy there)."""
        folder = str(folder)
        return self.copies.get(folder, folder) if self.mechanism.name == "user" else folder

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` wrapped so that it runs inside this sandbox."""
        cmd: list[str] = []
        if self.cgroup is not None:
            cmd += ["/bin/sh", "-c", 'for f do [ "$f" = -- ] && break; echo $$ > "$f" || exit 97; done; '
                    'while [ "$1" != -- ]; do shift; done; shift; exec "$@"', "enter-cgroup",
                    *self.cgroup.procs_files(), "--"]
        if self.mechanism.name == "bubblewrap":
            # Not root: a user namespace lets bwrap make the others; the worker stays your uid.
            users = ["--unshare-user"] if os.geteuid() != 0 else []
            options = ["--die-with-parent", "--new-session", *users, "--unshare-pid", "--unshare-net",
                       "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "workbook",
                       *bind_args(self.view, tmp_mb=self.disk_mb, shm_mb=self.memory_mb, copies=self.copies),
                       *(["--bind", str(self.cache), CACHE_MOUNT] if self.cache is not None else []),
                       "--chdir", str(ROOT)]
            # The options name the submission's folders: any process may read a command line
            # (/proc/PID/cmdline), so bwrap reads them from its standard input (--args 0), a file only
            # the grader can read, and the worker gets /dev/null as its own.
            cmd += ["/bin/sh", "-c", 'exec <"$1"; shift; exec "$@"', "with-options", self._options_file(options),
                    "bwrap", "--args", "0", "--", "/bin/sh", "-c", 'exec "$@" </dev/null', "worker"]
        if self.uid is not None:
            groups = [f"--groups={CACHE_GID}"] if self.cache is not None else ["--clear-groups"]
            cmd += ["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", *groups, "--no-new-privs",
                    "--inh-caps=-all", "--bounding-set=-all", "--"]
        return cmd + list(argv)

    def _options_file(self, options: list[str]) -> str:
        fd, path = tempfile.mkstemp(prefix=f"{os.getpid()}-bwrap-", dir=private_dir())     # 0600, the grader's
        with open(fd, "wb") as f:
            f.write(b"".join(o.encode() + b"\0" for o in options))
        self._made.append(path)
        return path

    @property
    def umask(self) -> int:
        """The worker's umask: with a cache that several uids share, what it writes stays theirs to use."""
        return CACHE_UMASK if self.cache is not None and self.uid is not None else -1

    def env(self) -> dict[str, str]:
        env = worker_env(home=self.home(), uid=self.uid)
        if self.cache is not None and self.mechanism.name != "none":
            env.update(cache_env(CACHE_MOUNT if self.mechanism.name == "bubblewrap" else str(self.cache)))
        return env

    def usage_mb(self, pid: int) -> int:
        """Memory of every kind the worker holds now: its processes' anonymous and shared pages, the
        cgroup's count where there is one, and (for a dedicated uid) its files in /dev/shm."""
        total = sum(rss_kb(p) for p in descendants(pid)) // 1024
        if self.cgroup is not None:
            total = max(total, self.cgroup.usage_mb())
        if self.uid is not None and self.mechanism.name == "user":
            total += files_mb("/dev/shm", self.uid) + sysv_shm_mb(self.uid)
        return total

    def disk_mb_used(self) -> int:
        return files_mb(self.scratch, self.uid) if self.scratch and self.uid is not None else 0

    def out_of_memory(self) -> bool:
        return self.cgroup is not None and self.cgroup.ran_out()

    def kill_all(self) -> None:
        """Kill every process the worker left, however it was started."""
        if self.uid is not None:
            for _ in range(3):  # kill(-1) as the uid: every process of that uid, in one call
                subprocess.run(["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                                "kill", "-KILL", "-1"], capture_output=True, timeout=30)
                if not processes_of(self.uid):
                    break
                time.sleep(0.05)
        if self.cgroup is not None:
            self.cgroup.kill()

    def remove_files(self) -> None:
        """Remove what this sandbox wrote for the worker: bwrap's options, the worker's copies."""
        for path in self._made:
            unlink(path)
        self._made = []
        for copy in self.copies.values():
            shutil.rmtree(copy, ignore_errors=True)
        self.copies = {}

    def close(self) -> None:
        self.kill_all()
        if self.uid is not None and self.mechanism.name == "user":
            remove_leftovers(self.uid)
        self.remove_files()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        if self._uid_lock is not None:
            os.close(self._uid_lock)
            self._uid_lock = None
