"""The sandbox's parts that need no class of attackers: choosing a mechanism, the seccomp filter."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from kernels.loader import ROOT

import pytest

from grader.isolation import caches, choice, private, sandbox, seccomp, view
from grader.isolation.mechanism import IsolationError, Mechanism

SOCKETS = """
import socket, sys
from grader.isolation import seccomp
assert seccomp.forbid_network()
for family in (socket.AF_INET, socket.AF_INET6):
    try:
        socket.socket(family, socket.SOCK_STREAM)
        sys.exit(f"family {family} was allowed")
    except PermissionError:
        pass
a, b = socket.socketpair()          # local sockets still work: multiprocessing needs them
a.sendall(b"x"); assert b.recv(1) == b"x"
import subprocess                   # and the filter holds in every process started after it
child = subprocess.run([sys.executable, "-c", "import socket; socket.socket()"], capture_output=True, text=True)
assert child.returncode != 0 and "Permission" in child.stderr, child.stderr
print("refused")
"""


@pytest.mark.skipif(seccomp._SECCOMP.get(__import__("platform").machine()) is None or sys.platform != "linux",
                    reason="the seccomp filter is written for Linux on x86-64 and arm64")
def test_the_seccomp_filter_refuses_network_sockets_only():
    done = subprocess.run([sys.executable, "-c", SOCKETS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "refused" in done.stdout, done.stderr


def test_asking_for_a_mechanism_is_checked(monkeypatch):
    monkeypatch.setenv(choice.ENV, "chroot")
    with pytest.raises(IsolationError, match="auto, bubblewrap, user, none"):
        choice.requested()
    monkeypatch.setattr(choice, "_probe", lambda name: ("not here", False) if name != "none" else (None, False))
    choice.choose.cache_clear()
    try:
        with pytest.raises(IsolationError, match="'bubblewrap' is not available here: not here"):
            choice.choose("bubblewrap")          # asked for by name: never a quiet downgrade
        chosen = choice.choose("auto")
        assert chosen.name == "none" and "bubblewrap: not here" in chosen.reason
        assert "Python guard only" in chosen.describe()
    finally:
        choice.choose.cache_clear()


def _mechanism_or_skip(name):
    try:
        return choice.choose(name)
    except IsolationError as exc:
        pytest.skip(str(exc))


WRITE_CACHE = """
import os, pathlib, sys
cache = pathlib.Path(os.environ["TRITON_CACHE_DIR"])
if sys.argv[1] == "write":
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "kernel.bin").write_text("compiled")
print((cache / "kernel.bin").read_text())
"""


@pytest.mark.parametrize("name", ["bubblewrap", "user"])
def test_a_compile_cache_outlives_one_worker_and_holds_nothing_else(name, tmp_path, request):
    mechanism = _mechanism_or_skip(name)
    import shutil
    import tempfile
    cache = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-test-cache-", dir=private.private_dir()))
    request.addfinalizer(lambda: shutil.rmtree(cache, ignore_errors=True))
    outside = tmp_path / "outside.txt"
    outside.write_text("the grader's")
    for step in ("write", "read"):
        box = sandbox.Sandbox(mechanism, view.View(readable=()), cache=cache)
        box.open()
        try:
            done = subprocess.run(box.command([sys.executable, "-c", WRITE_CACHE, step]), env=box.env(),
                                  cwd="/", capture_output=True, text=True, timeout=120)
        finally:
            box.close()
        assert done.returncode == 0 and done.stdout.strip() == "compiled", done.stderr
        assert box.env()["TRITON_CACHE_DIR"] != os.environ.get("TRITON_CACHE_DIR")
    assert (cache / "triton" / "kernel.bin").read_text() == "compiled"
    assert outside.read_text() == "the grader's"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving files to another group needs root")
def test_sharing_a_cache_between_worker_uids_follows_no_link(tmp_path):
    cache, outside = tmp_path / "cache", tmp_path / "outside.txt"
    cache.mkdir()
    outside.write_text("root's")
    outside.chmod(0o600)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret").write_text("root's")
    (cache / "link").symlink_to(outside)
    (cache / "dir_link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    os.link(outside, cache / "hard")            # a second name of a file that is not the worker's
    (cache / "triton").mkdir()
    (cache / "triton" / "k.bin").write_text("x")
    caches.share(cache)
    assert outside.stat().st_gid == 0 and stat.S_IMODE(outside.stat().st_mode) == 0o600
    assert (tmp_path / "elsewhere" / "secret").stat().st_gid == 0
    assert not (cache / "hard").exists() and (cache / "link").is_symlink()
    kernel, folder = (cache / "triton" / "k.bin").stat(), (cache / "triton").stat()
    assert kernel.st_gid == folder.st_gid == caches.CACHE_GID
    assert kernel.st_mode & 0o660 == 0o660 and stat.S_IMODE(folder.st_mode) == 0o2770


def test_workers_under_two_uids_share_one_compile_cache(tmp_path, request):
    """A grading's workers each have a uid of their own (the user mechanism) and one cache: what one
    compiles the other reads, and may replace."""
    mechanism = _mechanism_or_skip("user")
    import shutil
    import tempfile
    cache = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-test-cache-", dir=private.private_dir()))
    request.addfinalizer(lambda: shutil.rmtree(cache, ignore_errors=True))
    boxes = [sandbox.Sandbox(mechanism, view.View(readable=()), cache=cache) for _ in range(2)]
    try:
        for box in boxes:
            box.open()
        assert boxes[0].uid != boxes[1].uid
        for box, step in zip(boxes + boxes[:1], ("write", "write", "read")):
            done = subprocess.run(box.command([sys.executable, "-c", WRITE_CACHE, step]), env=box.env(),
                                  cwd="/", capture_output=True, text=True, timeout=120, umask=box.umask)
            assert done.returncode == 0 and done.stdout.strip() == "compiled", done.stderr
    finally:
        for box in boxes:
            box.close()


def test_only_your_own_files_get_a_compile_cache(monkeypatch, tmp_path):
    from grader import grade, stages
    seen = []

    class Stop(Exception):
        pass

    def runner(*args, cache=None, **kwargs):
        seen.append(cache)
        raise Stop

    monkeypatch.setattr(grade, "Runner", runner)
    monkeypatch.setattr(choice, "choose", lambda name=None: Mechanism("bubblewrap", seccomp=True))
    monkeypatch.delenv("WORKBOOK_PRIVATE", raising=False)
    stage = stages.find("stage1")
    folder = tmp_path / "someone"
    folder.mkdir()
    (folder / f"{stage.module}.py").write_text((ROOT / "solutions" / f"{stage.module}.py").read_text())
    for source in ("solutions", str(folder)):
        with pytest.raises(Stop):
            grade.grade_stage(stage, source, jobs=1)
    monkeypatch.setenv("WORKBOOK_PRIVATE", str(tmp_path))      # a batch's grading
    with pytest.raises(Stop):
        grade.grade_stage(stage, "solutions", jobs=1)
    assert seen == [caches.compile_cache("solutions"), None, None]
    with pytest.raises(ValueError, match="name must be"):
        caches.compile_cache(str(folder))


def test_a_probe_is_remembered_only_when_it_succeeded_and_only_from_a_file_of_our_own(monkeypatch, tmp_path):
    """A success skips the next grading's probe (seconds: it starts Python and torch); nothing else
    does: not a failure, not another boot's or Python's record, not a file others could write."""
    import json
    path = tmp_path / "probes.json"
    monkeypatch.setattr(choice, "_probes_file", lambda: path)
    monkeypatch.setattr(choice.shutil, "which", lambda _: "/usr/bin/x")
    calls, works = [], {"now": True}

    def fake_run(cmd, **kwargs):                # the probe's own sandboxed Python, as a working one answers
        calls.append(cmd)
        if not works["now"]:
            return subprocess.CompletedProcess(cmd, 1, b"", b"bwrap: no permission")
        return subprocess.CompletedProcess(cmd, 0, f"{os.__file__}\nTrue\n".encode(), b"")
    monkeypatch.setattr(choice.subprocess, "run", fake_run)

    def probe():
        choice._probe.cache_clear()
        return choice._probe("bubblewrap")

    try:
        assert probe() == (None, True) and len(calls) == 1
        written = path.stat().st_ino
        assert probe() == (None, True) and len(calls) == 1                # the second grading asked no one
        assert path.stat().st_ino == written                              # nor wrote the record again
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        path.unlink()
        works["now"] = False
        assert probe()[0] == probe()[0] == "a probe failed: bwrap: no permission"
        assert len(calls) == 3 and not path.exists()                     # a failure is probed every time
        works["now"] = True
        for spoil in ("mode", "key", "checkout"):
            key = choice._probe_key("bubblewrap")
            if spoil == "key":                                            # another boot, Python or grader code
                key = key.replace(key.split("|")[2], "another-boot")
            if spoil == "checkout":                                       # another copy of the workbook
                monkeypatch.setattr(choice, "ROOT", tmp_path / "elsewhere")
            path.write_text(json.dumps({key: True}))
            path.chmod(0o644 if spoil == "mode" else 0o600)               # a file others could have written
            calls.clear()
            assert probe() == (None, True) and len(calls) == 1, spoil
        if os.geteuid() == 0:                                             # a file another user owns
            path.write_text(json.dumps({choice._probe_key("bubblewrap"): True}))
            path.chmod(0o600)
            os.chown(path, 65534, 65534)
            calls.clear()
            assert probe() == (None, True) and len(calls) == 1, "owner"
    finally:
        choice._probe.cache_clear()
