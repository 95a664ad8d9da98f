"""Which isolation mechanism grades here: asked for, probed, remembered, chosen.

``WORKBOOK_ISOLATION`` (or ``--isolation``) asks for one: ``auto`` (the default: the strongest
that works here), ``bubblewrap``, ``user`` or ``none``.  Asking for one that does not work here
is an error, never a silent downgrade.

A probe starts a sandboxed Python as a worker would be started, which imports torch and the
workbook's kernels, finds no answer key in sight (under bubblewrap), and installs the seccomp filter
if it can.  That takes seconds, so a success is remembered in the grader's private folder
(private.py) until the machine reboots or what it depends on changes; a failure is probed again
every time, so that a fix is seen at once.  A batch probes once and hands its gradings the answer
(``checked_env``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

from kernels.loader import ROOT

from grader.isolation.answer_keys import ANSWER_KEYS
from grader.isolation.mechanism import MECHANISMS, UID_BASE, UID_SLOTS, IsolationError, Mechanism
from grader.isolation.private import own_record, private_dir, write_record
from grader.isolation.sandbox import Sandbox, worker_env
from grader.isolation.view import View

ENV = "WORKBOOK_ISOLATION"
CHECKED_ENV = "WORKBOOK_ISOLATION_CHECKED"   # set by a batch for its gradings: the probe already ran


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
    Python that would run the worker, this package's code (which builds the worker's command, and is
    what the worker runs), and the checkout and import path the worker reads its code from (a copy of
    the workbook in a folder the worker's user cannot read must be probed, and found wanting, on its
    own)."""
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
    package = sorted(Path(__file__).parent.glob("*.py"))
    code = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in package)).hexdigest()[:16]
    return "|".join(map(str, (name, os.geteuid(), boot, exe, exe_time, sys.prefix, sys.version, code, ROOT,
                              os.environ.get("PYTHONPATH", ""))))


def _probes_file() -> Path:
    return private_dir() / "probes.json"


def _remembered(name: str) -> tuple[None, bool] | None:
    """A probe of ``name`` that succeeded in this boot with this Python and this code: (None, seccomp)."""
    try:
        seccomp = own_record(_probes_file()).get(_probe_key(name))
    except OSError:
        return None
    return (None, seccomp) if isinstance(seccomp, bool) else None


def _remember(name: str, seccomp: bool) -> None:
    try:
        path = _probes_file()
        key = _probe_key(name)
        boot = key.split("|")[2]
        known = {k: v for k, v in own_record(path).items() if k.split("|")[2:3] == [boot]}   # this boot's only
        known[key] = seccomp
        write_record(path, known)
    except OSError:
        pass                                    # no record: the next grading probes again


@lru_cache(maxsize=None)
def _probe(name: str) -> tuple[str | None, bool]:
    """(why ``name`` does not work here, or None; whether its worker's seccomp filter cuts the network).

    A probe starts a sandboxed Python that imports torch: seconds, before every grading.  A success
    is remembered (in the grader's private folder) until the machine reboots or the Python or this
    package changes; a failure is probed again every time, so a fix is seen at once."""
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
                              env=worker_env(home="/tmp", uid=uid))
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
