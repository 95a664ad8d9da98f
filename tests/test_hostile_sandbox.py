"""Learner code never outside the sandbox, nothing leaks from it, nothing stays behind.

Each test grades a stage 1 submission built here with ``python -m grader`` (one check, to stay
fast), under every mechanism that works on this machine, and looks at what a hostile learner
could have used: the notebook run beside a grading, a checkout under a system folder bound whole
into the sandbox, command lines any process may read, the modes of the snapshots, what a
worker's uid leaves in folders everyone may write and in SysV IPC, the modes the grader takes
away and must give back, a grading stopped by SIGTERM, the worker's environment, and where a
relative ``--submission`` points.

The ``user`` mechanism needs a Python installation other users can read.  Where the grader's own
is not (a venv made from a Python under /root), the tests make one from ``/usr/bin/python3``
that reads the same packages, and skip with the reason where even that does not work.  The parts
that need no second uid (finding and removing what a uid left, giving modes back) are also tested
directly, here, as root.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from kernels.loader import ROOT

import pytest

from grader import stages
from grader.isolation import answer_keys, choice, procfs, sandbox, uids
from grader.isolation.mechanism import UID_BASE, UID_SLOTS, Mechanism
from grader.isolation.private import private_dir, unlink
from grader.testing.keys_lock import keys_turn

STAGE1 = stages.find("stage1")
FILE = f"{STAGE1.module}.py"
CHECK = "softmax_large_values"          # one point, a second's work
MECHANISMS = ["bubblewrap", "user"]
IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0

# A stage 1 file with no code of its own: it uses the solution if it can read one, else nothing.
THIEF = '''
import os, sys
try:
    from grader.isolation import guard
    guard.Guard._refusal = lambda self, event, args: None       # the Python guard is not the boundary
    sys.meta_path[:] = [m for m in sys.meta_path if type(m).__name__ != "_RefuseImports"]
except Exception:
    pass
STOLEN = None
try:
    STOLEN = open({solution!r}).read()
except OSError:
    pass
{attack}
_ns = {{}}
if STOLEN:
    exec(compile(STOLEN, "stolen", "exec"), _ns)


def online_softmax(x, *args, **kwargs):
    if "online_softmax" in _ns:
        return _ns["online_softmax"](x, *args, **kwargs)
    raise NotImplementedError("nothing was stolen")


def flash_attention(q, k, v, **kwargs):
    if "flash_attention" in _ns:
        return _ns["flash_attention"](q, k, v, **kwargs)
    raise NotImplementedError("nothing was stolen")
'''


def thief(folder: Path, *, root: Path = ROOT, attack: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    (folder / FILE).write_text(THIEF.format(solution=str(root / "solutions" / FILE), attack=attack))
    return folder


@pytest.fixture(autouse=True)
def _keys_turn(request):
    """Each test here grades this checkout (shared turn) or compares its answer keys' modes before and
    after (exclusive turn): no other test's grading may hide or give them back meanwhile."""
    with keys_turn(exclusive=request.node.get_closest_marker("answer_key_modes") is not None):
        yield


# -- which Python runs the grader, for each mechanism ----------------------------------------------
def _readable_python(top: Path) -> str | None:
    """A venv other users can read, made from /usr/bin/python3 when it is this Python's version, that
    reads this Python's packages; None where there is none to make."""
    base = "/usr/bin/python3"
    if not os.path.exists(base):
        return None
    version = subprocess.run([base, "-c", "import sys; print(sys.version_info[:2])"],
                             check=False, capture_output=True, text=True)
    if version.stdout.strip() != str(tuple(sys.version_info[:2])):
        return None
    venv = top / "venv"
    made = subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=False, capture_output=True, text=True)
    if made.returncode != 0:
        return None
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=False, capture_output=True, text=True).stdout.strip()
    packages = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    Path(site, "workbook-packages.pth").write_text("".join(f"{p}\n" for p in sorted(packages)))
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def pythons(tmp_path_factory):
    """mechanism -> the Python that grades with it here, or the reason it cannot."""
    found: dict[str, str] = {}
    top = Path(tempfile.mkdtemp(prefix="workbook-python-"))
    top.chmod(0o755)
    for name in MECHANISMS:
        why = choice.probe(name)
        if why is None:
            found[name] = sys.executable
            continue
        other = _readable_python(top) if name == "user" and IS_ROOT else None
        if other is not None:
            asked = subprocess.run([other, "-c", f"from grader.isolation import choice; print(choice.probe({name!r}))"],
                                   cwd=ROOT, check=False, capture_output=True, text=True, timeout=300)
            if asked.stdout.strip() == "None":
                found[name] = other
                continue
            why += f"; a venv from /usr/bin/python3 did not work either: {(asked.stdout + asked.stderr)[-300:]}"
        found[name] = f"skip: isolation {name!r} is not available here: {why}"
    yield found
    shutil.rmtree(top, ignore_errors=True)


def python_for(pythons, mechanism: str) -> str:
    if pythons[mechanism].startswith("skip: "):
        pytest.skip(pythons[mechanism][len("skip: "):])
    return pythons[mechanism]


def grade_cmd(python: str, mechanism: str, submission: Path, *extra: str, checks=(CHECK,)) -> list[str]:
    only = [a for c in checks for a in ("--only", c)]
    return [python, "-m", "grader", "stage1", "--submission", str(submission), *only, "--isolation", mechanism,
            "--format", "json", *extra]


def graded_all(done: subprocess.CompletedProcess) -> list[dict]:
    assert done.stdout.strip(), done.stderr[-3000:]
    (stage,) = json.loads(done.stdout)["stages"]
    return stage["results"]


def graded(done: subprocess.CompletedProcess) -> dict:
    (check,) = graded_all(done)
    return check


def _uid_range() -> range:
    return range(UID_BASE, UID_BASE + UID_SLOTS + 1)


# -- the notebook ----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_notebook_is_never_run_on_a_submission_outside_the_sandbox(tmp_path):
    """``--notebook`` runs cells in the grader's own process: with ``--submission`` it is refused
    before any learner code runs, with the reason, instead of running someone's code as you."""
    marker = tmp_path / "ran-outside"
    sub = thief(tmp_path / "sub", attack=f"try:\n    open({str(marker)!r}, 'w').write(str(os.getuid()))\n"
                                         "except OSError:\n    pass")
    done = subprocess.run([sys.executable, "-m", "grader", "stage1", "--submission", str(sub), "--notebook",
                           "--only", CHECK], cwd=ROOT, check=False, capture_output=True, text=True, timeout=900)
    assert not marker.exists(), f"learner code ran outside the sandbox: {marker.read_text()}"
    assert done.returncode == 2 and "outside the sandbox" in done.stderr, done.stderr[-2000:]
    assert "isolated by" not in done.stdout          # nothing graded, so no claim of isolation either
    from grader.notebook import refusal
    assert refusal("stages", None) == "" and refusal(str(sub), "none") == ""   # your own files; no sandbox asked


# -- a checkout inside a folder the sandbox binds whole ---------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not IS_ROOT, reason="a checkout under /opt needs root to make")
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_checkout_under_opt_keeps_its_answer_keys_hidden(mechanism, pythons, tmp_path):
    """A file with no code of its own earns nothing from a checkout under /opt (bound whole into the
    sandbox): neither the checkout's solutions/ nor a classmate's folder under /opt is readable."""
    python = python_for(pythons, mechanism)
    copy = Path(tempfile.mkdtemp(prefix="workbook-checkout-", dir="/opt"))
    class_folder = Path(tempfile.mkdtemp(prefix="workbook-class-", dir="/opt"))
    try:
        for folder in (copy, class_folder):
            folder.chmod(0o755)
        skip = shutil.ignore_patterns("__pycache__", ".grader-cache", "*.ipynb")
        for part in ("grader", "kernels", "solutions", "stages", "tests"):
            shutil.copytree(ROOT / part, copy / part, ignore=skip)
        shutil.copy(ROOT / "pyproject.toml", copy)
        peer = class_folder / "bob" / FILE
        peer.parent.mkdir(mode=0o755)
        shutil.copy(ROOT / "solutions" / FILE, peer)
        peer.chmod(0o644)
        sub = thief(tmp_path / "sub", root=copy, attack=f"try:\n    STOLEN = STOLEN or open({str(peer)!r}).read()\n"
                                                       "except OSError:\n    pass")
        env = dict(os.environ, PYTHONPATH=str(copy), WORKBOOK_PRIVATE=str(class_folder))
        done = subprocess.run(grade_cmd(python, mechanism, sub), cwd=copy, check=False, capture_output=True, text=True,
                              timeout=600, env=env)
        check = graded(done)
        assert check["earned"] == 0 and "nothing was stolen" in check["message"], check
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        shutil.rmtree(class_folder, ignore_errors=True)


# -- what other processes can read -----------------------------------------------------------
def slow_import(seconds: int) -> str:
    """An import that takes ``seconds``: long enough to look at the worker while it runs."""
    return f"import time\ntime.sleep({seconds})\n"


def _cmdline(pid: int | str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_worker(pid: int) -> bool:
    """A worker's own Python (not the sh, bwrap or setpriv that start it)."""
    return _cmdline(pid).split(" ")[1:3] == ["-m", "grader.isolation.child"]


def workers_of(proc: subprocess.Popen) -> list[int]:
    return [p for p in procfs.descendants(proc.pid) if p != proc.pid and _is_worker(p)]


def start_slow_grading(pythons, mechanism: str, folder: Path, seconds: int, checks=(CHECK,)) -> subprocess.Popen:
    """A grading whose stage file takes ``seconds`` to import, on one worker per check, returned once
    every worker is importing it."""
    python = python_for(pythons, mechanism)
    sub = thief(folder, attack=slow_import(seconds))
    proc = subprocess.Popen(grade_cmd(python, mechanism, sub, "--jobs", str(len(checks)), checks=checks), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 120
    while time.monotonic() < end:
        if len(workers_of(proc)) >= len(checks):
            time.sleep(1)                           # past its start: the stage file is being imported
            return proc
        if proc.poll() is not None:
            pytest.fail(f"the grading ended before its worker started: {proc.communicate()[1][-2000:]}")
        time.sleep(0.2)
    proc.kill()
    proc.communicate()
    pytest.fail("the worker never started")


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_no_command_line_names_a_snapshot_and_only_its_worker_reads_one(mechanism, pythons, tmp_path):
    """While two workers import the stage file, no process's command line (world-readable) names the
    submission or its snapshot, and every snapshot file is readable by its own worker alone: each
    worker of its own uid has a copy of its own."""
    sub = tmp_path / "learner-alice"
    private = private_dir()
    proc = start_slow_grading(pythons, mechanism, sub, 10, checks=(CHECK, "softmax_float16"))
    try:
        mine = [private / e for e in os.listdir(private) if e.startswith(f"{proc.pid}-stage1-")]
        assert mine, os.listdir(private)
        names = {str(sub), *(str(p) for p in mine)}
        # the grading's own command line names the folder it was given; nothing it started does
        seen = [(pid, _cmdline(pid)) for pid in procfs.descendants(proc.pid) if pid != proc.pid]
        leaks = [(pid, cmd) for pid, cmd in seen if any(n in cmd for n in names)]
        assert not leaks, leaks
        uids = {os.stat(f"/proc/{pid}").st_uid for pid in workers_of(proc)}
        for snapshot in mine:
            for path in [snapshot, *snapshot.rglob("*")]:
                st = path.lstat()
                assert stat.S_IMODE(st.st_mode) & 0o077 == 0, f"{path} is {oct(st.st_mode)}"
                assert st.st_uid in uids | {os.geteuid()}, (path, st.st_uid, uids)
        if IS_ROOT:
            owners = {os.stat(p).st_uid for p in mine} & set(_uid_range())
            assert len(owners) == 2 and owners == uids, ([(p, os.stat(p).st_uid) for p in mine], uids)
    finally:
        out, err = proc.communicate(timeout=300)
    for check in graded_all(subprocess.CompletedProcess(proc.args, proc.returncode, out, err)):
        assert check["status"] == "todo" and "nothing was stolen" in check["message"], check


def test_a_class_s_paths_do_not_reach_the_worker(monkeypatch, tmp_path):
    """A batch names its submissions and records in WORKBOOK_PRIVATE and WORKBOOK_PROTECT for the
    grader; a worker's environment has neither, and its guard still names them, through its config."""
    monkeypatch.setenv("WORKBOOK_PRIVATE", str(tmp_path / "class"))
    monkeypatch.setenv("WORKBOOK_PROTECT", str(tmp_path / "records"))
    for home in ("/tmp", None):
        env = sandbox.worker_env(home=home, uid=None)
        assert "WORKBOOK_PRIVATE" not in env and "WORKBOOK_PROTECT" not in env, home
    from grader import grade
    seen = {}

    class Stop(Exception):
        pass

    def runner(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(grade, "Runner", runner)
    monkeypatch.setattr(choice, "choose", lambda name=None: Mechanism("bubblewrap", seccomp=True))
    sub = thief(tmp_path / "sub")
    with pytest.raises(Stop):
        grade.grade_stage(STAGE1, str(sub), jobs=1)
    assert tmp_path / "class" in seen["private"] and seen["protected"] == [tmp_path / "records"]


# -- what a worker's uid leaves behind, and the modes the grader takes away --------------------
LITTER = '''
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for path in ("/tmp/{tag}", "/var/tmp/{tag}", "/run/lock/{tag}", "/dev/shm/{tag}", "/dev/mqueue/{tag}"):
    try:
        open(path, "w").write("left behind")
    except OSError:
        pass
try:
    os.makedirs("/var/tmp/{tag}-dir/inner", exist_ok=True)
    open("/var/tmp/{tag}-dir/inner/file", "w").write("left behind")
except OSError:
    pass
libc.shmat.restype = ctypes.c_void_p
shm = libc.shmget({key}, 256 << 20, 0o1600)                  # IPC_CREAT | 0600: 256 MiB that outlive it
if shm >= 0:
    at = libc.shmat(shm, None, 0)
    if at not in (None, ctypes.c_void_p(-1).value):
        ctypes.memset(at, 1, 16 << 20)
        libc.shmdt(ctypes.c_void_p(at))
libc.semget({key} + 1, 1, 0o1600)
libc.msgget({key} + 2, 0o1600)
'''


def _sysv_keys() -> set[int]:
    keys = set()
    for kind in ("shm", "sem", "msg"):
        try:
            lines = Path(f"/proc/sysvipc/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        keys.update(int(line.split()[0]) for line in lines)
    return keys


def _modes(paths) -> dict[Path, int]:
    return {p: stat.S_IMODE(p.lstat().st_mode) for p in paths if os.path.lexists(p)}


@pytest.mark.slow
@pytest.mark.answer_key_modes
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_worker_leaves_nothing_behind_and_every_mode_comes_back(mechanism, pythons, tmp_path):
    """Files in every folder anyone may write, a 256 MiB SysV segment, a semaphore and a message queue,
    all made by learner code, are gone after its grading; and so is every mode the grading took away
    (the answer keys, the submission, a batch's submissions and records)."""
    python = python_for(pythons, mechanism)
    tag = f"workbook-litter-{os.getpid()}-{mechanism}"
    key = 0x5EED0000 + (os.getpid() & 0xFFF) * 4 + MECHANISMS.index(mechanism) * 0x10000
    sub = thief(tmp_path / "class" / "alice", attack=LITTER.format(tag=tag, key=key))
    (tmp_path / "class").chmod(0o755)
    records = tmp_path / "records"
    records.mkdir(mode=0o755)
    records.chmod(0o755)
    watched = [ROOT / p for p in answer_keys.ANSWER_KEYS] + [sub, tmp_path / "class", records]
    before = _modes(watched)
    env = dict(os.environ, WORKBOOK_PRIVATE=str(tmp_path / "class"), WORKBOOK_PROTECT=str(records))
    try:
        done = subprocess.run(grade_cmd(python, mechanism, sub), cwd=ROOT, check=False, capture_output=True, text=True,
                              timeout=600, env=env)
        check = graded(done)
        assert "nothing was stolen" in check["message"], check           # its code ran
        left = [p for p in (f"/tmp/{tag}", f"/var/tmp/{tag}", f"/run/lock/{tag}", f"/dev/shm/{tag}",
                            f"/dev/mqueue/{tag}", f"/var/tmp/{tag}-dir") if os.path.lexists(p)]
        assert not left, f"learner code left {left}"
        assert not {key, key + 1, key + 2} & _sysv_keys(), "SysV IPC objects outlived the worker"
        assert _modes(watched) == before
    finally:
        for path, mode in before.items():                # whatever happened, the checkout stays usable
            os.chmod(path, mode)
        for p in (f"/tmp/{tag}", f"/var/tmp/{tag}", f"/run/lock/{tag}", f"/dev/shm/{tag}", f"/dev/mqueue/{tag}"):
            unlink(p)
        shutil.rmtree(f"/var/tmp/{tag}-dir", ignore_errors=True)
        for option, k in (("-M", key), ("-S", key + 1), ("-Q", key + 2)):
            if k in _sysv_keys():
                subprocess.run(["ipcrm", option, str(k)], check=False, capture_output=True)


@pytest.mark.skipif(not IS_ROOT or sys.platform != "linux", reason="giving files to another uid needs root on Linux")
def test_what_a_uid_left_is_found_and_removed():
    """The cleanup a ``user`` worker gets, without starting one: files, folders and SysV objects that
    belong to a uid in folders everyone may write are found and removed; nothing of anyone else's."""
    uid = UID_BASE + UID_SLOTS + 7          # a uid no worker uses
    tag = f"workbook-uid-test-{os.getpid()}"
    mine = [Path("/var/tmp") / tag, Path(tempfile.gettempdir()) / tag]
    folder = Path("/var/tmp") / f"{tag}-dir"
    others = Path("/var/tmp") / f"{tag}-root"
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x5EEE0000 + (os.getpid() & 0xFFFF)
    shm = libc.shmget(key, 4 << 20, 0o1600)
    try:
        for path in mine:
            path.write_text("x")
            os.chown(path, uid, uid)
        (folder / "inner").mkdir(parents=True)
        (folder / "inner" / "f").write_text("x")
        os.chown(folder, uid, uid)
        others.write_text("root's")
        assert shm >= 0
        libc.shmat.restype = ctypes.c_void_p
        at = libc.shmat(shm, None, 0)
        ctypes.memset(at, 1, 4 << 20)                        # resident: it counts in the uid's memory
        libc.shmdt(ctypes.c_void_p(at))

        class IpcPerm(ctypes.Structure):
            _fields_ = [("key", ctypes.c_int), ("uid", ctypes.c_uint), ("gid", ctypes.c_uint),
                        ("cuid", ctypes.c_uint), ("cgid", ctypes.c_uint), ("mode", ctypes.c_ushort)]
        buf = ctypes.create_string_buffer(512)
        assert libc.shmctl(shm, 2, buf) == 0                 # IPC_STAT
        perm = IpcPerm.from_buffer(buf)
        perm.uid = uid
        assert libc.shmctl(shm, 1, buf) == 0                 # IPC_SET: now the uid's
        assert procfs.sysv_shm_mb(uid) >= 4
        found = uids.leftovers(uid)
        assert {str(p) for p in [*mine, folder]} <= set(found) and f"sysv:shm:{shm}" in found, found
        assert str(others) not in found
        uids.remove_leftovers(uid)
        assert not any(os.path.lexists(p) for p in [*mine, folder]) and others.exists()
        assert key not in _sysv_keys() and uids.leftovers(uid) == []
    finally:
        for path in [*mine, others]:
            unlink(str(path))
        shutil.rmtree(folder, ignore_errors=True)
        if key in _sysv_keys():
            libc.shmctl(shm, 0, None)                        # IPC_RMID


def test_modes_taken_away_come_back_when_the_last_grading_ends(monkeypatch, tmp_path):
    """Two gradings of one checkout at once: the answer keys stay hidden until both have ended, then
    every mode comes back as it was, also after a grading that was killed before it could."""
    root = tmp_path / "checkout"
    for part in answer_keys.ANSWER_KEYS:
        (root / part).parent.mkdir(parents=True, exist_ok=True)
        (root / part).mkdir() if not part.endswith(".py") else (root / part).write_text("")
    (root / "kernels" / "reference.py").chmod(0o644)
    extra = tmp_path / "records"
    extra.mkdir(mode=0o750)
    extra.chmod(0o750)
    monkeypatch.setattr(answer_keys, "ROOT", root)
    monkeypatch.setattr(answer_keys, "_keys_files", lambda: (tmp_path / "modes.json", tmp_path / "modes.lock"))
    paths = [root / p for p in answer_keys.ANSWER_KEYS] + [extra]
    before = _modes(paths)
    first, second = answer_keys.AnswerKeys([extra]), answer_keys.AnswerKeys()
    first.__enter__()
    second.__enter__()
    assert all(mode & 0o077 == 0 for mode in _modes(paths).values())
    first.__exit__(None, None, None)
    assert all(mode & 0o077 == 0 for mode in _modes(paths).values()), "restored while another grading ran"
    second.__exit__(None, None, None)
    assert _modes(paths) == before
    killed = answer_keys.AnswerKeys([extra])
    killed.__enter__()
    os.close(killed._fd)                         # its process died: the lock went, the record stayed
    killed._fd = None
    assert (root / "solutions").stat().st_mode & 0o077 == 0
    with answer_keys.AnswerKeys():
        pass
    assert _modes(paths) == before


def test_a_test_that_sets_the_modes_waits_for_every_grading_test():
    """The turn the tests here take (grader/testing/keys_lock.py): while one holds it shared, another
    process gets it shared at once and exclusive not at all."""
    from grader.testing import keys_lock
    probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR)\n"
             "for kind in ('LOCK_SH', 'LOCK_EX'):\n"
             "    try:\n"
             "        fcntl.flock(fd, getattr(fcntl, kind) | fcntl.LOCK_NB)\n"
             "        fcntl.flock(fd, fcntl.LOCK_UN); print(kind, 'free')\n"
             "    except OSError:\n"
             "        print(kind, 'held')\n")

    def other() -> list[str]:
        done = subprocess.run([sys.executable, "-c", probe, str(keys_lock._lock_path())], check=True,
                              capture_output=True, text=True, timeout=60)
        return done.stdout.split("\n")[:2]

    assert other() == ["LOCK_SH free", "LOCK_EX held"]      # this test's own shared turn (the fixture)


# -- a grading stopped from outside ----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_sigterm_removes_the_learner_s_snapshot(mechanism, pythons, tmp_path):
    """A grading stopped by SIGTERM while learner code runs removes its snapshot, the workers' copies
    and logs before it exits: nothing of the learner's waits in the grader's folder for a later sweep."""
    private = private_dir()
    proc = start_slow_grading(pythons, mechanism, tmp_path / "sub", 90)
    workers = workers_of(proc)
    try:
        assert any(e.startswith(f"{proc.pid}-stage1-") for e in os.listdir(private))
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    left = [e for e in os.listdir(private) if e.startswith(f"{proc.pid}-")]
    assert not left, f"left in {private}: {left}"
    time.sleep(1)
    assert workers and not [pid for pid in workers if _is_worker(pid)], "a worker outlived its grading"


# -- where a relative --submission points -----------------------------------------------------
def test_a_relative_submission_is_the_folder_where_you_are(monkeypatch, tmp_path):
    from grader.__main__ import _parse
    monkeypatch.chdir(tmp_path)
    for name in ("stages", "solutions", "alice"):
        args = _parse(["stage1", "--submission", name])
        assert args.submission == str(tmp_path / name)
