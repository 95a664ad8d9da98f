"""The isolation mechanisms: what each keeps learner code from, and what it needs.

The grader's worker (grader/isolation/child.py) runs learner code in a process of its own.  A
mechanism decides what that process is allowed to see and do; grader/isolation/choice.py takes the
strongest that works on this machine, and every grading says which one it used:

    bubblewrap  ``bwrap`` (Debian's ``bubblewrap`` package) starts the worker in new mount, PID,
                network, IPC and UTS namespaces.  Its file system holds only what learner code
                needs, read-only: the system's programs and libraries, the Python installation,
                the workbook's ``kernels/`` without the reference, the grader's isolation package
                (what the worker runs), and the submission's own files (a checkout inside one of
                the system folders bound whole, /opt say, is covered first: view.py).  ``/tmp``
                and ``/dev/shm`` are private, size-capped and vanish with it.  There is no
                network but its own loopback, and no other process is visible.  Run by root, it
                also drops to a dedicated unprivileged uid with no capabilities (``setpriv``).
    user        root without namespaces (a Docker container such as Gradescope's): the worker
                runs as a dedicated unprivileged uid (``setpriv``, uids.py), in a scratch folder
                of its own.  The answer keys, the records and the grader's temporary files are
                made unreadable to it by their permissions while it grades (and given back
                after: answer_keys.py).  What its uid leaves where anyone may write, SysV IPC
                included, is removed when it ends.  The network is cut only by the seccomp filter
                (seccomp.py), where the kernel allows one.
    none        neither is possible (no bwrap, not root): the worker runs as you, behind the
                Python guard only.  Fine for grading your own work; never for someone else's.

What both real mechanisms add, the limits and the clean-up, is in sandbox.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

MECHANISMS = ("bubblewrap", "user", "none")
UID_BASE = 1_990_000_000          # dedicated uids: far above any real account
UID_SLOTS = 512


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
