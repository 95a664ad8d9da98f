"""The sandbox's parts that need no class of attackers: choosing a mechanism, the seccomp filter."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grader import sandbox
from kernels.loader import ROOT

SOCKETS = """
import socket, sys
from grader import sandbox
assert sandbox.forbid_network()
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


@pytest.mark.skipif(sandbox._SECCOMP.get(__import__("platform").machine()) is None or sys.platform != "linux",
                    reason="the seccomp filter is written for Linux on x86-64 and arm64")
def test_the_seccomp_filter_refuses_network_sockets_only():
    done = subprocess.run([sys.executable, "-c", SOCKETS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "refused" in done.stdout, done.stderr


def test_asking_for_a_mechanism_is_checked(monkeypatch):
    monkeypatch.setenv(sandbox.ENV, "chroot")
    with pytest.raises(sandbox.IsolationError, match="auto, bubblewrap, user, none"):
        sandbox.requested()
    monkeypatch.setattr(sandbox, "_probe", lambda name: ("not here", False) if name != "none" else (None, False))
    sandbox.choose.cache_clear()
    try:
        with pytest.raises(sandbox.IsolationError, match="'bubblewrap' is not available here: not here"):
            sandbox.choose("bubblewrap")          # asked for by name: never a quiet downgrade
        chosen = sandbox.choose("auto")
        assert chosen.name == "none" and "bubblewrap: not here" in chosen.reason
        assert "Python guard only" in chosen.describe()
    finally:
        sandbox.choose.cache_clear()
