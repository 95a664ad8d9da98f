"""No network for the worker, whatever the mechanism: a seccomp filter on socket().

The worker installs it on itself (grader/isolation/child.py) before it imports learner code, under
either real mechanism, and every process it starts inherits it.  Under bubblewrap it adds to a
network namespace that holds nothing but its own loopback; under ``user``, which has no namespaces,
it is all that cuts the network.  The mechanism's probe (choice.py) runs it once inside a sandbox
to learn whether this kernel allows it, and the grader says so where it does not.
"""

from __future__ import annotations

import sys

_AF_UNIX, _AF_NETLINK = 1, 16
_SECCOMP = {  # machine -> (audit arch, socket's number, io_uring_setup's number)
    "x86_64": (0xC000003E, 41, 425),
    "aarch64": (0xC00000B7, 198, 425),
}


def forbid_network() -> bool:
    """Refuse, for this process and every process it starts, any socket but a local (AF_UNIX or
    netlink) one, and io_uring (which can open sockets without the socket() call).  A seccomp
    filter: learner code cannot remove it.  False where the kernel or the machine does not allow it.
    """
    import ctypes
    import platform
    spec = _SECCOMP.get(platform.machine())
    if sys.platform != "linux" or spec is None:
        return False
    arch, nr_socket, nr_io_uring = spec
    deny = 0x00050000 | 13                  # SECCOMP_RET_ERRNO | EACCES
    allow = 0x7FFF0000                      # SECCOMP_RET_ALLOW
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    # (code, jump if true, jump if false, k): jumps count the instructions to skip.
    program = [
        (ld, 0, 0, 4),                      # 0  the call's architecture
        (jeq, 1, 0, arch),                  # 1  native: go on; else (a 32-bit entry point) refuse
        (ret, 0, 0, deny),                  # 2
        (ld, 0, 0, 0),                      # 3  the call's number
        (jge, 6, 0, 0x40000000),            # 4  x32's numbers: refuse
        (jeq, 5, 0, nr_io_uring),           # 5  io_uring_setup: refuse
        (jeq, 1, 0, nr_socket),             # 6  socket(): look at its family
        (ret, 0, 0, allow),                 # 7  anything else
        (ld, 0, 0, 16),                     # 8  socket's first argument, the family
        (jeq, 2, 0, _AF_UNIX),              # 9
        (jeq, 1, 0, _AF_NETLINK),           # 10
        (ret, 0, 0, deny),                  # 11 (also the target of 4 and 5)
        (ret, 0, 0, allow),                 # 12
    ]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(program))(*[Filter(*i) for i in program])
    prog = Program(len(program), ctypes.cast(filters, ctypes.POINTER(Filter)))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:                      # PR_SET_NO_NEW_PRIVS
        return False
    return libc.prctl(22, 2, ctypes.byref(prog), 0, 0) == 0   # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
