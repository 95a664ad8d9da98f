"""The operating system's boundary around learner code.

The grader's worker (grader/worker.py) runs learner code in a process of its own.  This module
decides what that process is allowed to see and do, with the strongest mechanism the machine
has, and says which one it used:

    bubblewrap  ``bwrap`` (Debian's ``bubblewrap`` package) starts the worker in new mount, PID,
                network, IPC and UTS namespaces.  Its file system holds only what learner code
                needs, read-only: the system's programs and libraries, the Python installation,
                the workbook's ``kernels/`` without the reference, the grader modules the
                worker runs, and the submission's own files (a checkout inside one of the system
                folders bound whole, /opt say, is covered first).  ``/tmp`` and ``/dev/shm`` are
                private, size-capped and vanish with it.  There is no network but its own
                loopback, and no other process is visible.  Run by root, it also drops to a
                dedicated unprivileged uid with no capabilities (``setpriv``).
    user        root without namespaces (a Docker container such as Gradescope's): the worker
                runs as a dedicated unprivileged uid (``setpriv``), in a scratch folder of its own.
                The answer keys, the records and the grader's temporary files are made unreadable
                to it by their permissions while it grades (and given back after).  What its uid
                leaves where anyone may write, SysV IPC included, is removed when it ends.  The
                network is cut only by the seccomp filter below, where the kernel allows one.
    none        neither is possible (no bwrap, not root): the worker runs as you, behind the
                Python guard only.  Fine for grading your own work; never for someone else's.

Both real mechanisms add limits: processes, open files and the size of any file written (rlimits
set before learner code runs), memory of every kind in a cgroup where one can be made (shared
memory and tmpfs pages included) and, everywhere, the grader's own polling of the anonymous and
shared memory of every process of the worker.  When a worker ends, every process it left is
killed: the PID namespace goes with it, and a dedicated uid's processes are killed by uid.

``WORKBOOK_ISOLATION`` (or ``--isolation``) asks for one: ``auto`` (the default: the strongest
that works here), ``bubblewrap``, ``user`` or ``none``.  Asking for one that does not work here
is an error, never a silent downgrade.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Self

from grader import BATCH_OUT_ENV, BATCH_SUBMISSION_ENV
from kernels.loader import ROOT

ENV = "WORKBOOK_ISOLATION"
CHECKED_ENV = "WORKBOOK_ISOLATION_CHECKED"   # set by a batch for its gradings: the probe already ran
MECHANISMS = ("bubblewrap", "user", "none")
UID_BASE = 1_990_000_000          # dedicated uids: far above any real account
UID_SLOTS = 512
# The workbook files a worker may read: kernels/ without the reference, and what the worker runs.
WORKER_MODULES = ("__init__.py", "isolation/__init__.py", "isolation/child.py", "isolation/wire.py",
                  "isolation/guard.py", "isolation/limits.py", "isolation/harness.py", "isolation/seccomp.py")
ANSWER_KEYS = ("solutions", "tests", "grader/checks", "kernels/reference.py")
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")


class IsolationError(RuntimeError):
    """The isolation asked for cannot be had on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class Mechanism:
    name: str
    reason: str = ""          # why it was chosen, or why stronger ones were not
    seccomp: bool = True      # the worker's seccomp filter refuses network sockets (the probe says)

    @property
    def dedicated_uid(self) -> bool:
        return self.name == "user" or (self.name == "bubblewrap" and os.geteuid() == 0)

    def describe(self) -> str:
        what = {"bubblewrap": "bubblewrap sandbox (own file view, no network, own processes"
                              + (", unprivileged uid)" if self.dedicated_uid else ")"),
                "user": "a dedicated unprivileged user (setpriv; "
                        + ("no network sockets)" if self.seccomp else "the network is NOT cut: no seccomp here)"),
                "none": "none: learner code runs as you, behind the Python guard only"}[self.name]
        return what + (f" [{self.reason}]" if self.reason else "")


def requested() -> str:
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in ("auto",) + MECHANISMS:
        raise IsolationError(f"{ENV}={value!r}: expected auto, {', '.join(MECHANISMS)}")
    return value


def probe(name: str) -> str | None:
    """None when ``name`` works here; otherwise why not (one line)."""
    return _probe(name)[0]


def _probe_key(name: str) -> str:
    """What a probe's success depends on, as one string: the mechanism, who asks, this boot, the
    Python that would run the worker, this module's code (which builds the worker's command), and
    the checkout and import path the worker reads its code from (a copy of the workbook in a folder
    the worker's user cannot read must be probed, and found wanting, on its own)."""
    import hashlib
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    exe = os.path.realpath(sys.executable)
    try:
        exe_time = os.stat(exe).st_mtime_ns
    except OSError:
        exe_time = 0
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return "|".join(map(str, (name, os.geteuid(), boot, exe, exe_time, sys.prefix, sys.version, code, ROOT,
                              os.environ.get("PYTHONPATH", ""))))


def _probes_file() -> Path:
    return private_dir() / "probes.json"


def _own_record(path: Path) -> dict:
    """The probes file's entries, if it is a regular file of ours that nobody else could have written."""
    import json
    try:
        st = path.lstat()
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return {}
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _remembered(name: str) -> tuple[None, bool] | None:
    """A probe of ``name`` that succeeded in this boot with this Python and this code: (None, seccomp)."""
    try:
        seccomp = _own_record(_probes_file()).get(_probe_key(name))
    except OSError:
        return None
    return (None, seccomp) if isinstance(seccomp, bool) else None


def _write_record(path: Path, record: dict) -> None:
    """Replace ``path`` with the JSON of ``record``, mode 0600, at once (a reader sees old or new)."""
    import json
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with open(fd, "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, path)


def _remember(name: str, seccomp: bool) -> None:
    try:
        path = _probes_file()
        key = _probe_key(name)
        boot = key.split("|")[2]
        known = {k: v for k, v in _own_record(path).items() if k.split("|")[2:3] == [boot]}   # this boot's only
        known[key] = seccomp
        _write_record(path, known)
    except OSError:
        pass                                    # no record: the next grading probes again


@lru_cache(maxsize=None)
def _probe(name: str) -> tuple[str | None, bool]:
    """(why ``name`` does not work here, or None; whether its worker's seccomp filter cuts the network).

    A probe starts a sandboxed Python that imports torch: seconds, before every grading.  A success
    is remembered (in the grader's private folder) until the machine reboots or the Python or this
    module changes; a failure is probed again every time, so a fix is seen at once."""
    if name == "none":
        return None, False
    if sys.platform != "linux":
        return f"needs Linux (this is {sys.platform})", False
    if name == "user" and os.geteuid() != 0:
        return "needs root, to start the worker as another user", False
    if shutil.which("setpriv") is None and (name == "user" or os.geteuid() == 0):
        return "setpriv (util-linux) is not installed", False
    if name == "bubblewrap" and shutil.which("bwrap") is None:
        return "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)", False
    if (remembered := _remembered(name)) is not None:
        return remembered
    uid = UID_BASE + UID_SLOTS  # a probe uid outside the slots workers use
    import os as stdlib_os  # the probe's Python must find the same standard library as the grader's
    # Inside bubblewrap the answer keys must not be there at all, wherever the workbook is checked out.
    keys = [str(ROOT / p) for p in ANSWER_KEYS] if name == "bubblewrap" else []
    script = ("import os, torch, kernels.runtime\nfrom grader.isolation.seccomp import forbid_network\n"
              f"seen = [p for p in {keys!r} if os.path.exists(p)]\n"
              "assert not seen, f'the sandbox shows the answer keys: {seen}'\n"
              "print(os.__file__)\nprint(forbid_network())")
    box = Sandbox(Mechanism(name), View(readable=()), uid=uid)
    try:
        done = subprocess.run(box.command([sys.executable, "-c", script]), capture_output=True, timeout=120, cwd=ROOT,
                              env=_worker_env(home="/tmp", uid=uid))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"could not start a probe: {exc}", False
    finally:
        box.remove_files()
    if done.returncode != 0:
        err = done.stderr.decode(errors="replace").strip().splitlines()
        return f"a probe failed: {err[-1] if err else f'exit status {done.returncode}'}", False
    lines = done.stdout.decode().split()
    if not lines or lines[0] != stdlib_os.__file__:
        return (f"the Python installation ({sys.base_prefix}) is not readable by an unprivileged user: make the "
                "venv from a Python other users can read (e.g. /usr/bin/python3)"), False
    seccomp = lines[-1] == "True"
    _remember(name, seccomp)                    # a remembered success is not written again
    return None, seccomp


@lru_cache(maxsize=None)
def choose(name: str | None = None) -> Mechanism:
    """The mechanism to grade with: ``name``, or $WORKBOOK_ISOLATION, or the strongest that works."""
    name = name or requested()
    checked = os.environ.get(CHECKED_ENV, "")
    if name != "auto" and checked.split(":")[0] == name:      # a batch's grading: its probe already ran
        return Mechanism(name, seccomp=checked.endswith(":seccomp"))
    if name != "auto":
        why, seccomp = _probe(name)
        if why:
            raise IsolationError(f"isolation {name!r} is not available here: {why}")
        return Mechanism(name, seccomp=seccomp)
    missing = []
    for candidate in MECHANISMS:
        why, seccomp = _probe(candidate)
        if why is None:
            return Mechanism(candidate, "; ".join(missing), seccomp=seccomp)
        missing.append(f"{candidate}: {why}")
    raise AssertionError("'none' always works")


def add_isolation_option(parser) -> None:
    parser.add_argument("--isolation", choices=("auto",) + MECHANISMS,
                        help=f"how learner code is kept apart (default: ${ENV}, else auto: the strongest here)")


def use_isolation_option(args) -> None:
    if getattr(args, "isolation", None):
        os.environ[ENV] = args.isolation
        choose.cache_clear()


def checked_env(mechanism: Mechanism) -> dict[str, str]:
    """What a batch hands its gradings so that they do not probe again."""
    return {ENV: mechanism.name, CHECKED_ENV: mechanism.name + (":seccomp" if mechanism.seccomp else "")}


# -- what the worker may read ---------------------------------------------------------------------
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

    def workbook_files(self) -> list[Path]:
        files = [p for p in sorted((ROOT / "kernels").glob("*.py")) if p.name != "reference.py"]
        return files + [ROOT / "grader" / name for name in WORKER_MODULES]

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


def _bind_args(view: View, *, tmp_mb: int, shm_mb: int, copies: dict | None = None) -> list[str]:
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
    # A venv inside the workbook is bound whole; of the rest of the workbook, only the files listed.
    binds = [*view.python_roots(), *map(str, view.workbook_files()), *map(str, view.readable)]
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


def _share(folder: Path, gid: int = CACHE_GID) -> None:
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


def _cache_env(cache: str) -> dict[str, str]:
    return dict(TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
                TORCH_EXTENSIONS_DIR=f"{cache}/torch_extensions", CUDA_CACHE_PATH=f"{cache}/nv",
                WORKBOOK_CACHE=f"{cache}/workbook")         # stage 4's CUDA builds (kernels/cuda_build.py)


#: Workers do not autotune: kernels.tuning.AUTOTUNE_ENV, set to 0 (that module needs Triton to import).
NO_AUTOTUNE = {"WORKBOOK_AUTOTUNE": "0"}


#: A batch's submissions and records (grader/isolation/guard.py reads them in the grader, never in a worker).
_CLASS_PATHS = ("WORKBOOK_PRIVATE", "WORKBOOK_PROTECT", BATCH_SUBMISSION_ENV, BATCH_OUT_ENV)


def _worker_env(*, home: str | None, uid: int | None) -> dict[str, str]:
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
            self.uid, self._uid_lock = _claim_uid()
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
            _share(self.cache)
        if self.uid is not None and self.mechanism.name != "none":
            for folder in map(str, self.view.readable):
                if os.path.isdir(folder) and not os.path.islink(folder):
                    self.copies[folder] = _copy_for(folder, self.uid)
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
                       *_bind_args(self.view, tmp_mb=self.disk_mb, shm_mb=self.memory_mb, copies=self.copies),
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
        env = _worker_env(home=self.home(), uid=self.uid)
        if self.cache is not None and self.mechanism.name != "none":
            env.update(_cache_env(CACHE_MOUNT if self.mechanism.name == "bubblewrap" else str(self.cache)))
        return env

    def usage_mb(self, pid: int) -> int:
        """Memory of every kind the worker holds now: its processes' anonymous and shared pages, the
        cgroup's count where there is one, and (for a dedicated uid) its files in /dev/shm."""
        total = sum(_rss_kb(p) for p in _descendants(pid)) // 1024
        if self.cgroup is not None:
            total = max(total, self.cgroup.usage_mb())
        if self.uid is not None and self.mechanism.name == "user":
            total += _files_mb("/dev/shm", self.uid) + _sysv_shm_mb(self.uid)
        return total

    def disk_mb_used(self) -> int:
        return _files_mb(self.scratch, self.uid) if self.scratch and self.uid is not None else 0

    def out_of_memory(self) -> bool:
        return self.cgroup is not None and self.cgroup.ran_out()

    def kill_all(self) -> None:
        """Kill every process the worker left, however it was started."""
        if self.uid is not None:
            for _ in range(3):  # kill(-1) as the uid: every process of that uid, in one call
                subprocess.run(["setpriv", f"--reuid={self.uid}", f"--regid={self.uid}", "--clear-groups",
                                "kill", "-KILL", "-1"], capture_output=True, timeout=30)
                if not _processes_of(self.uid):
                    break
                time.sleep(0.05)
        if self.cgroup is not None:
            self.cgroup.kill()

    def remove_files(self) -> None:
        """Remove what this sandbox wrote for the worker: bwrap's options, the worker's copies."""
        for path in self._made:
            _unlink(path)
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


def _claim_uid() -> tuple[int, int]:
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
        if _processes_of(uid):  # a grader that was killed left them: they go first
            subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "kill", "-KILL", "-1"],
                           capture_output=True, timeout=30)
        remove_leftovers(uid)   # and what they left, before the uid serves anyone else
        return uid, fd
    raise IsolationError(f"all {UID_SLOTS} worker uids are in use")


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
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() and not target.is_symlink() else _unlink(target)


def _copy_for(folder: str, uid: int) -> str:
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


# -- what a dedicated uid leaves behind -----------------------------------------------------------
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
    return found + [f"sysv:{kind}:{ident}" for kind, ident in _sysv_objects(uid)]


def _sysv_objects(uid: int) -> list[tuple[str, int]]:
    """(kind, id) of the SysV IPC objects ``uid`` owns or made, from /proc/sysvipc."""
    found = []
    for kind in _IPC:
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


def _sysv_shm_mb(uid: int) -> int:
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
            _unlink(item)
        removed.append(item)
    return removed


# -- answer keys out of reach of a dedicated uid --------------------------------------------------
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
        with _locked(record.with_suffix(".state")):
            modes = _own_record(record)
            for path in _answer_key_paths(self.extra):
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if st.st_mode & 0o077 and not stat.S_ISLNK(st.st_mode):
                    modes.setdefault(str(path), stat.S_IMODE(st.st_mode))
                    _write_record(record, modes)      # recorded before it is changed: a kill loses nothing
                    os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077)
        return self

    def __exit__(self, *exc) -> None:
        import fcntl
        if self._fd is None:
            return
        record, _ = _keys_files()
        try:
            with _locked(record.with_suffix(".state")):
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
    for path, mode in _own_record(record).items():
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISLNK(st.st_mode) and isinstance(mode, int):
            os.chmod(path, (stat.S_IMODE(st.st_mode) & ~0o077) | (mode & 0o077))
            changed.append(path)
    _unlink(str(record))
    return changed


class _locked:
    """An exclusive lock on ``path`` (made 0600) for the length of a ``with`` block."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        os.close(self.fd)


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


# -- cgroups: memory of every kind, and processes ------------------------------------------------
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


# -- processes and files, from /proc and the file system -----------------------------------------
def _descendants(pid: int) -> list[int]:
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


def _rss_kb(pid: int) -> int:
    """A process's anonymous and shared resident memory (a shared mapping counts too), in KiB."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith(("RssAnon:", "RssShmem:")))
    except (OSError, ValueError, IndexError):
        return 0


def _processes_of(uid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid == uid:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def _owned_files(top: str | None, uid: int, depth: int | None = None) -> list[str]:
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


def _files_mb(top: str | None, uid: int | None) -> int:
    total = 0
    for path in _owned_files(top, uid) if uid is not None else []:
        try:
            st = os.lstat(path)
            total += st.st_blocks * 512
        except OSError:
            pass
    return total >> 20


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
