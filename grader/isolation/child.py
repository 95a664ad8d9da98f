"""The worker: what runs inside the sandbox, as ``python -m grader.isolation.child FD_IN FD_OUT FD_CONFIG``.

The grader (grader/isolation/runner.py) starts it with two pipes for frames (requests in, replies
out) and a third that carries its config once (the stage, the snapshot's folder, the limits, the
folders the guard names), so that none of it is on a command line any local user may read.  It

1. asks Linux to kill it when the grader goes away, sets its rlimits (grader/isolation/limits.py)
   and, where the probe found it works, the seccomp filter (grader/isolation/seccomp.py);
2. imports torch and the workbook's kernels, puts up the guard (grader/isolation/guard.py) and
   says ``("booted",)``;
3. imports the stage file and says ``("ready", device)``, or ``("import-error", type, message,
   traceback)`` and ends;
4. then answers each request with the function's result, or the error it raised, encoded by
   grader/isolation/wire.py; inputs are checked for writes and outputs for stores past their
   ends (the guard), and a CUDA error ends the worker (exit status 3).

Its stdout and stderr are the grader's capped log: learner prints never reach the protocol.

The sandbox shows the worker this package, ``grader/__init__.py`` and ``kernels/`` (the
reference excepted), and nothing else of the workbook: what this module imports, at any depth,
stays within those, the standard library, torch, numpy and Triton (tests/test_isolation.py).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path

from grader.isolation import guard, seccomp, wire
from grader.isolation.guard import poisoned_allocations
from grader.isolation.limits import Limits
from grader.isolation.wire import CHUNK, FRAME, MESSAGE_CAP, NAME_CAP, TRACEBACK_CAP


def to_device(obj, device, depth: int = 0):
    """The grader's arguments on ``device`` (a walk of the grader's own data, bounded all the same)."""
    import torch
    if depth > wire.MAX_DEPTH:
        raise ValueError(f"the call's arguments are nested more than {wire.MAX_DEPTH} levels deep")
    if isinstance(obj, torch.Tensor):
        if obj.device == torch.device(device) or obj.is_contiguous():
            return obj.to(device)
        # A strided view (a slice, a transpose): move its whole storage and rebuild the view,
        # so the kernel sees the same strides and the same neighbouring memory as on the CPU.
        storage = torch.empty(0, dtype=obj.dtype).set_(obj.untyped_storage())
        return torch.as_strided(storage.to(device), obj.shape, obj.stride(), obj.storage_offset())
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device, depth + 1) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, depth + 1) for k, v in obj.items()}
    return obj


def to_cpu(obj):
    """``obj`` as the grader receives it from a worker: on the CPU, a dataclass as a dict of its fields."""
    return wire.decode(bytearray(wire.encode(obj)))


def _pack(obj) -> bytes:
    """A message of the worker, as the bytes of one frame's body (grader/isolation/wire.py)."""
    return wire.encode(obj)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when the grader goes away, however it goes."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid and os.getppid() != parent_pid:
        os._exit(1)


def _set_limits(limits: Limits, *, own_uid: bool) -> None:
    """The worker's rlimits, set before any learner code runs (which cannot raise them again)."""
    import resource

    def cap(which, value):
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NOFILE, limits.open_files)
    cap(resource.RLIMIT_FSIZE, limits.disk_mb << 20)
    if own_uid:  # counted per uid: only a uid of the worker's own makes it a per-worker limit
        cap(resource.RLIMIT_NPROC, limits.processes)


class _Pipes:
    """The worker's end: requests come in on one pipe, replies go out on the other, a frame each."""

    def __init__(self, fd_in: int, fd_out: int):
        self._in, self._out = fd_in, fd_out

    def _read(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, pos = memoryview(buf), 0
        while pos < n:
            got = os.readv(self._in, [view[pos:pos + CHUNK]])
            if not got:
                raise EOFError("the grader closed the pipe")
            pos += got
        return buf

    def recv_bytes(self) -> bytearray:
        (n,) = FRAME.unpack(self._read(FRAME.size))
        return self._read(n)

    def send_bytes(self, data) -> None:
        for part in (FRAME.pack(len(data)), data):
            view = memoryview(part)
            while view:
                view = view[os.write(self._out, view[:CHUNK]):]


def _traceback_of(exc: BaseException, stage: str, others: int = 3) -> str:
    """The traceback of ``exc`` and of the exceptions it came from, each keeping every frame of the
    stage file and its ``others`` innermost other frames.  A Triton error is raised deep inside
    triton.language and re-raised at the launch, so the kernel line that caused it can sit many
    frames above either end; the last few frames alone would point at the launch."""
    head = traceback.TracebackException.from_exception(exc)
    seen, part = set(), head
    while part is not None and id(part) not in seen:
        seen.add(id(part))
        frames = list(part.stack)
        part.stack = traceback.StackSummary.from_list(
            [f for i, f in enumerate(frames) if i >= len(frames) - others or f.filename.endswith(f"{stage}.py")])
        part = part.__cause__ or (None if part.__suppress_context__ else part.__context__)
    return "".join(head.format())[-6000:]


def _count_compiles() -> list[float]:
    """A one-element list that adds up the seconds Triton spends compiling kernels (not loading them
    from its cache) in this process, for the grader's record of each check's own time: a cold cache's
    compiles are gone at the next grading, so they must not decide which check starts first."""
    seconds = [0.0]
    try:
        import triton
        compilation = triton.knobs.compilation
    except (ImportError, AttributeError):
        return seconds                                   # a Triton without compile listeners: nothing counted
    earlier = compilation.listener

    def listener(**event):
        times = event.get("times")
        if not event.get("cache_hit") and times is not None:
            seconds[0] += times.total / 1e6              # microseconds
        if earlier is not None:
            earlier(**event)
    compilation.listener = listener
    return seconds


def _start_cuda(device) -> None:
    """Create CUDA's context and cuBLAS's handle on ``device`` now, while the worker starts, so that
    the time recorded for its first check is that check's own.  A failure here is left for the first
    check to meet and report, as it would without this."""
    import torch
    try:
        x = torch.ones(8, 8, device=device)
        (x @ x).sum().item()
    except Exception:  # reported by the check that needs the GPU
        pass


def _worker_main(conn, stage: str, source: str, limits: Limits, parent_pid: int,
                 private: tuple = (), protected: tuple = (), own_uid: bool = False, cut_network: bool = False) -> None:
    _die_with_parent(parent_pid)
    # stdout and stderr are the grader's capped log: learner prints never reach the protocol.
    import faulthandler
    import resource
    faulthandler.enable()  # a segfault prints the Python line it happened on
    root = Path(__file__).resolve().parents[2]     # the workbook: grader/isolation/child.py
    sys.path.insert(0, str(root))
    try:
        _set_limits(limits, own_uid=own_uid)
        if cut_network and not seccomp.forbid_network():
            raise RuntimeError("the grader could not install its seccomp filter, which it found working before")
        from kernels import loader, runtime

        import torch
        if runtime.ON_GPU:
            _start_cuda(runtime.DEVICE)
        if not runtime.ON_GPU:
            cap = (limits.memory_mb + 2048) * 2**20
            resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
        guard.install(root, readable=[loader.source_dir(source)], private=private, protected=protected)
        conn.send_bytes(_pack(("booted",)))
        compiling = _count_compiles()
        module = loader.load_stage(stage, source)
        conn.send_bytes(_pack(("ready", runtime.describe())))
    except BaseException as exc:  # any import failure is reported, not raised
        conn.send_bytes(_pack(("import-error", wire.cut(type(exc).__name__, NAME_CAP), str(exc)[:MESSAGE_CAP],
                               traceback.format_exc(limit=-12)[-TRACEBACK_CAP:])))
        return
    while True:
        try:
            _, fn_name, args, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        fatal = False
        compiling[0] = 0.0
        try:
            fn = getattr(module, fn_name, None)
            if fn is None:
                raise AttributeError(f"the stage file has no function {fn_name!r}")
            helper = kwargs.pop("_harness", None)        # a grader call around fn (grader/isolation/harness.py)
            if helper is not None:
                from grader.isolation import harness
                fn = harness.bind(fn, helper)
            args, kwargs = to_device(args, runtime.DEVICE), to_device(kwargs, runtime.DEVICE)
            inputs = guard.snapshot_inputs(fn, args, kwargs)
            outputs: list = []
            with poisoned_allocations(outputs):
                result = fn(*args, **kwargs)
            if runtime.ON_GPU:
                torch.cuda.synchronize()
            problem = guard.check_canaries(outputs) or guard.changed_inputs(fn_name, inputs)
            # encoded here, so that a CUDA error met copying the result back is fatal like any other
            payload = _pack(("misbehaved", problem, compiling[0]) if problem else ("ok", result, compiling[0]))
        except wire.Refused as exc:       # a result of a type, a size or a shape the grader does not accept
            payload = _pack(("misbehaved", str(exc), compiling[0]))
        except BaseException as exc:
            text = str(exc)
            fatal = ("CUDA error" in text or "illegal memory access" in text
                     or isinstance(exc, (SystemExit, KeyboardInterrupt)))
            payload = _pack(("error", wire.cut(type(exc).__name__, NAME_CAP), text[:MESSAGE_CAP],
                             _traceback_of(exc, stage)[-TRACEBACK_CAP:], compiling[0]))
        for stream in (sys.stdout, sys.stderr):  # so the log holds this call's prints before its verdict
            try:
                stream.flush()
            except Exception:  # learner code may have replaced or closed them
                pass
        conn.send_bytes(payload)
        if fatal:
            os._exit(3)


def _child_main(argv: list[str]) -> None:
    """``python -m grader.isolation.child FD_IN FD_OUT FD_CONFIG``: the worker, as the sandbox starts it."""
    with open(int(argv[2]), "rb") as f:
        fd_in, fd_out, config = int(argv[0]), int(argv[1]), json.loads(f.read())
    limits = Limits(**config["limits"])
    _worker_main(_Pipes(fd_in, fd_out), config["stage"], config["source"], limits, config["parent_pid"],
                 tuple(config["private"]), tuple(config["protected"]), own_uid=config["own_uid"],
                 cut_network=config.get("cut_network", False))


if __name__ == "__main__":
    _child_main(sys.argv[1:])
