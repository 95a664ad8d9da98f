"""The grader's side of the worker: start it, call learner functions in it, and trust nothing it says.

The grader's process builds inputs, computes the reference and compares; learner code only
ever runs in a worker, a fresh Python (``python -m grader.isolation.child``: child.py) started
in a sandbox (sandbox.py) of the mechanism choice.py picks: bubblewrap, a dedicated user, or
none.  The two speak over two pipes, one frame (wire.py: an 8-byte length, then that many bytes)
per message:

    grader -> worker   pickle of ("call", function name, args, kwargs)   (the grader's own data)
    worker -> grader   wire.py's encoding of ("ok", result, s), ("misbehaved", message, s) or
                       ("error", type, message, traceback, s), s the seconds Triton spent compiling

Arguments travel as plain pickles, never as shared memory, so nothing the worker does to its
inputs can reach the grader's tensors.  Learner code runs in the worker and can write anything to
its pipe, so the grader trusts nothing that comes back:

* every read and write on the pipes has the call's deadline (non-blocking pipes, poll): a
  worker that sends part of a reply and stops, or stops reading its requests, times out as a hang
  does, and is killed;
* a reply may hold at most ``limits.reply_bytes`` (sized by the call's inputs, far below the
  worker's memory limit); the grader reads a frame's length before its body, and stops a worker
  that announces more without reading any of it;
* a frame that arrives while the grader is sending a request, or before it has sent one, was
  not asked for: the worker is stopped and the check fails, so an extra reply per call cannot
  fill the pipe until both sides wait on each other;
* replies are read by wire.py, which runs no code and bounds every walk of the value (parts,
  depth, string lengths, tensor bytes), and every string of an error (the type's name, the
  message, the traceback) is cut to a fixed length before it reaches a record.

The worker's limits (grader/isolation/limits.py) are enforced from here:

* time: each call has a deadline; past it the worker is killed and the check fails "timeout".
* memory: a cgroup caps memory of every kind where the sandbox can make one, and the grader
  polls the anonymous and shared memory of every process of the worker (RssAnon + RssShmem in
  /proc) ten times a second and stops it above the limit.  Not RLIMIT_AS: CUDA reserves a virtual
  address space far larger than any limit worth setting.  On the CPU the worker also sets
  RLIMIT_DATA a little above the limit, so an absurd allocation fails at once with an error; on a
  GPU it does not, as the CUDA driver's own mappings count against it.
* processes, open files, file size: rlimits the worker sets before it imports learner code.
* output: learner prints go to a pipe that a thread here drains into a log (``output_tail``);
  past the cap the worker is stopped, so ``while True: print(...)`` costs neither disk nor time.

The worker dies with the grader (PR_SET_PDEATHSIG, bwrap's --die-with-parent), and when it
ends, every process it started is killed (its PID namespace, or its dedicated uid).  A worker
that crashes, hangs, misbehaves in these ways or hits a CUDA error is stopped, and a fresh one is
started for the next call.  How a call can end, as the grader reports it, is in
grader/isolation/outcomes.py.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from kernels.loader import ROOT

from grader.isolation import choice, wire
from grader.isolation.limits import Limits, reply_bytes
from grader.isolation.outcomes import ImportFailed, LearnerError, Misbehaved, WorkerDied, describe_value
from grader.isolation.private import private_dir
from grader.isolation.sandbox import Sandbox
from grader.isolation.view import View
from grader.isolation.wire import CHUNK, FRAME, MESSAGE_CAP, NAME_CAP, TRACEBACK_CAP

_OUTPUT_CAP = 64 * 1024  # bytes of the learner's printed output kept for messages
_BOOT_TIMEOUT = 120.0    # starting the worker: torch and the workbook's own modules, no learner code yet
_POLL = 0.1              # seconds between checks of the worker's health and memory
_HELLO_BYTES = 1 << 20   # the most a message that is not a call's reply may hold ("booted", "ready", import errors)


class Runner:
    """Calls functions of one stage module in a sandboxed worker process, restarting it when needed.

    ``private`` folders are ones learner code may not read (in a batch: the other submissions);
    ``protected`` ones it may not write (the batch's output).  The sandbox shows the worker
    neither; the guard names them in its early messages.
    """

    def __init__(self, stage: str, source: str, *, log_dir: str | os.PathLike | None = None,
                 limits: Limits | None = None, private=(), protected=(), mechanism=None, cache=None):
        self.stage = stage
        self.source = str(Path(source).resolve()) if str(source) not in ("stages", "solutions") else str(source)
        self.limits = limits or Limits.from_env()
        self._private, self._protected = tuple(map(str, private)), tuple(map(str, protected))
        self.mechanism = mechanism or choice.choose()
        self.cache = cache          # a compile cache kept between gradings (caches.compile_cache)
        self._sandbox = None
        self._proc = None
        self._conn = None
        self._drain = None
        self._death = None          # why the grader stopped the worker, when it did
        self._lock = threading.Lock()
        log_dir = Path(log_dir) if log_dir else private_dir()
        self.log_path = str(log_dir / f"{os.getpid()}-log-{stage}-{id(self)}.txt")
        self.description = ""
        self.last_call: tuple[str, str] | None = None   # (function, what it returned), for messages
        self.start_seconds = 0.0       # spent starting workers (Python, torch, the stage file), in all
        self.compile_seconds = 0.0     # spent by Triton compiling kernels during calls, in all, as workers say

    # -- process management -------------------------------------------------------------
    def _start(self, timeout: float) -> None:
        if self._sandbox is None:
            self._sandbox = Sandbox(
                self.mechanism, View(readable=(str(loader_dir(self.source)),), hidden=self._private + self._protected),
                memory_mb=self.limits.memory_mb, processes=self.limits.processes, disk_mb=self.limits.disk_mb,
                cache=self.cache)
            self._sandbox.open()
        to_worker_r, to_worker_w = os.pipe()
        from_worker_r, from_worker_w = os.pipe()
        log_r, log_w = os.pipe()
        config_r, config_w = os.pipe()
        self._death = None
        folder = str(loader_dir(self.source))
        seen_as = self._sandbox.worker_path(folder)      # a copy of its own, for a worker of its own uid
        source = seen_as if seen_as != folder else self.source
        config = {"stage": self.stage, "source": source, "limits": asdict(self.limits),
                  "parent_pid": 0 if self.mechanism.name == "bubblewrap" else os.getpid(),
                  "private": self._private, "protected": self._protected,
                  "own_uid": self._sandbox.uid is not None,
                  "cut_network": self.mechanism.name != "none" and self.mechanism.seccomp}
        # The config names the submission's folders: through a pipe, not the command line anyone may read.
        threading.Thread(target=_write_all, args=(config_w, json.dumps(config).encode()), daemon=True).start()
        argv = [sys.executable, "-m", "grader.isolation.child", str(to_worker_r), str(from_worker_w), str(config_r)]
        try:
            self._proc = subprocess.Popen(
                self._sandbox.command(argv), cwd=ROOT if self.mechanism.name != "bubblewrap" else "/",
                env=self._sandbox.env(), stdin=subprocess.DEVNULL, stdout=log_w, stderr=log_w,
                pass_fds=(to_worker_r, from_worker_w, config_r), start_new_session=True, umask=self._sandbox.umask)
        finally:
            for fd in (to_worker_r, from_worker_w, log_w, config_r):
                os.close(fd)
        self._conn = _GraderPipes(to_worker_w, from_worker_r)
        self._drain = threading.Thread(target=self._drain_output, args=(log_r, self._proc), daemon=True)
        self._drain.start()
        try:
            kind, *rest = self._message(_BOOT_TIMEOUT, phase="starting the worker (importing torch)")
            if kind == "booted":
                kind, *rest = self._message(timeout, phase="importing the stage file")
        except WorkerDied as exc:
            raise ImportFailed("crash" if not exc.timed_out else "TimeoutError", exc.reason,
                               timed_out=exc.timed_out) from None
        if kind == "import-error" and len(rest) == 3 and all(isinstance(x, str) for x in rest):
            type_name, message, tb = rest
            self._end_worker()
            raise ImportFailed(*_capped(type_name, message, tb))
        if kind != "ready" or len(rest) != 1 or not isinstance(rest[0], str):
            self._end_worker()
            raise ImportFailed("Misbehaved", "the worker sent the grader a message it did not ask for while the "
                                             "stage file was imported: stage code must not write to the worker's pipes")
        self.description = wire.cut(rest[0], NAME_CAP)

    def _drain_output(self, log_r: int, proc) -> None:
        """Copy what the worker prints into the log, up to the cap; past it, stop the worker."""
        cap, total = self.limits.output_kb * 1024, 0
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with open(fd, "wb") as log:
            while True:
                try:
                    chunk = os.read(log_r, 1 << 16)
                except OSError:
                    break
                if not chunk:
                    break
                if total < cap:
                    log.write(chunk[:cap - total])
                    log.flush()
                total += len(chunk)
                if total > cap:
                    self._stop(proc, f"printed more than {self.limits.output_kb} KiB, the grader's cap on output: "
                                     "print less (not inside a loop over blocks, not from inside a kernel)")
        os.close(log_r)

    def _stop(self, proc, reason: str | None = None) -> None:
        with self._lock:
            if reason and self._death is None and proc is self._proc:
                self._death = reason
            if proc.returncode is None:  # not reaped yet, so its pid and process group are still its own
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    pass
                try:
                    proc.kill()
                except OSError:
                    pass

    def _exit_code(self):
        """The worker's exit status; bwrap reports a child killed by signal N as 128 + N."""
        code = self._proc.returncode
        if self.mechanism.name == "bubblewrap" and code is not None and code > 128:
            return -(code - 128)
        return code

    _MEMORY_HINT = "is a tensor much larger than the inputs, or are tensors kept alive inside a loop?"

    def _watch_limits(self) -> None:
        limit = self.limits.memory_mb
        if self._sandbox.usage_mb(self._proc.pid) > limit:
            self._stop(self._proc, f"used more than {limit} MiB of memory (shared memory included), the grader's "
                                   f"limit: {self._MEMORY_HINT}")
        elif self._sandbox.disk_mb_used() > self.limits.disk_mb:
            self._stop(self._proc, f"wrote more than {self.limits.disk_mb} MiB of files, the grader's limit")

    def _end_worker(self) -> None:
        """Stop the worker and everything it started; the sandbox stays for the next one."""
        if self._proc is not None:
            self._stop(self._proc)
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        if self._sandbox is not None:
            self._sandbox.kill_all()
        if self._conn is not None:
            self._conn.close()
        if self._drain is not None:
            self._drain.join(2)  # the log is complete once the worker's end of the pipe is closed
        self._proc = self._conn = self._drain = None

    def close(self) -> None:
        self._end_worker()
        if self._sandbox is not None:
            self._sandbox.close()
            self._sandbox = None
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def output_tail(self, limit: int = 2000) -> str:
        """The end of what learner code printed (capped)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - min(limit, _OUTPUT_CAP)))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _message(self, timeout: float, *, phase: str) -> tuple:
        """A message of the worker while it starts ("booted", "ready" or "import-error"), as a tuple."""
        try:
            message = wire.decode(self._receive(time.monotonic() + timeout, timeout, _HELLO_BYTES, phase=phase))
        except wire.Refused as exc:
            self._end_worker()
            raise ImportFailed("Misbehaved", f"the worker {exc} while the stage file was imported: stage code "
                                             "must not write to the worker's pipes") from None
        if not (isinstance(message, tuple) and message and isinstance(message[0], str)):
            message = ("",)
        return message

    # -- the pipes: every wait is bounded by the call's deadline -------------------------------
    def _timed_out(self, timeout: float, phase: str, detail: str = "") -> WorkerDied:
        self._end_worker()
        return WorkerDied(f"timed out after {timeout:.0f} s during {phase}{detail}: an infinite loop, "
                          "a kernel that never finishes, or sizes too large", timed_out=True)

    def _died(self) -> WorkerDied:
        reason = self._death or _describe_exit(self._exit_code(), self._sandbox.out_of_memory())
        self._end_worker()
        return WorkerDied(reason)

    def _pipe_closed(self, deadline: float) -> WorkerDied:
        """The worker's end of its reply pipe closed: it is exiting (say why), or its code closed it."""
        until = min(deadline, time.monotonic() + 2.0)
        while self._proc.poll() is None and time.monotonic() < until:
            time.sleep(0.02)
        if self._proc.poll() is not None:
            return self._died()
        self._end_worker()
        return WorkerDied("the worker closed its pipe to the grader without replying: stage code must not "
                          "close or write to the worker's pipes")

    def _watch(self, last: float, *, ended: bool = True) -> float:
        """Every _POLL seconds, the worker's memory and disk; with ``ended``, raise if it has ended."""
        now = time.monotonic()
        if now - last < _POLL:
            return last
        self._watch_limits()
        if ended and self._proc.poll() is not None:
            raise self._died()
        return now

    def _send(self, data: bytes, deadline: float, timeout: float) -> None:
        """One request frame, written as the worker reads it, before ``deadline``.

        The worker writes only after it has read a whole request, so anything that arrives from it
        meanwhile (or before) was not asked for: learner code writing to the pipe.  Left there, such
        frames would fill the pipe until the worker waits to write while the grader waits to send."""
        fd_in, fd_out = self._conn.fds
        parts = [memoryview(FRAME.pack(len(data))), memoryview(data)]
        last = time.monotonic()
        while parts:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(timeout, "sending the call's inputs to the worker",
                                      ", which stopped reading them")
            readable, writable = self._conn.wait(min(left, _POLL), write=True)
            if readable:
                try:
                    early = os.read(fd_in, 1)
                except BlockingIOError:
                    early = None
                if early == b"":
                    raise self._pipe_closed(deadline)
                if early:
                    self._end_worker()
                    raise Misbehaved("wrote to the grader's pipe when the grader had not asked for anything (one "
                                     "more reply than it was asked for): stage code must not write to the "
                                     "worker's pipes; the worker was stopped")
            if writable:
                try:
                    sent = os.write(fd_out, parts[0][:CHUNK])
                except BlockingIOError:
                    sent = 0
                except OSError:              # a broken pipe: the worker has ended
                    raise self._pipe_closed(deadline) from None
                parts[0] = parts[0][sent:]
                if not parts[0]:
                    parts.pop(0)
            last = self._watch(last)

    def _read(self, n: int, deadline: float, timeout: float, phase: str, *, started: bool) -> bytearray:
        """Exactly ``n`` bytes of the worker's reply pipe, before ``deadline``."""
        fd_in = self._conn.fds[0]
        buf = bytearray(n)
        view, pos, last = memoryview(buf), 0, time.monotonic()
        while pos < n:
            left = deadline - time.monotonic()
            if left <= 0:
                detail = "; the worker had sent part of a reply and stopped" if started or pos else ""
                raise self._timed_out(timeout, phase, detail)
            readable, _ = self._conn.wait(min(left, _POLL), write=False)
            if readable:
                try:
                    got = os.readv(fd_in, [view[pos:pos + CHUNK]])
                except BlockingIOError:
                    got = None
                if got == 0:
                    raise self._pipe_closed(deadline)
                pos += got or 0
            last = self._watch(last, ended=not readable)     # what a worker sent before it ended is read first
        return buf

    def _receive(self, deadline: float, timeout: float, cap: int, *, phase: str = "the call") -> bytearray:
        """The body of the worker's next frame; one longer than ``cap`` bytes is never read."""
        (n,) = FRAME.unpack(self._read(FRAME.size, deadline, timeout, phase, started=False))
        if n > cap:
            self._end_worker()
            raise WorkerDied(f"returned a result of {n / 2**20:.0f} MiB, more than the {cap / 2**20:.0f} MiB the "
                             "grader accepts for this call: a result should be the size of its outputs")
        return self._read(n, deadline, timeout, phase, started=True)

    # -- calls ----------------------------------------------------------------------------
    def call(self, fn_name: str, *args, timeout: float = 120.0, **kwargs):
        """Call ``fn_name(*args, **kwargs)`` in the worker; return its result on the CPU."""
        if self._proc is None:
            began = time.monotonic()
            try:
                self._start(timeout)
            finally:
                self.start_seconds += time.monotonic() - began
        deadline = time.monotonic() + timeout
        request = pickle.dumps(("call", fn_name, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        self._send(request, deadline, timeout)
        cap = reply_bytes(_tensor_bytes((args, kwargs)), self.limits.memory_mb)
        try:
            reply = wire.decode(self._receive(deadline, timeout, cap))
        except wire.Refused as exc:
            raise Misbehaved(str(exc)) from None
        if not (isinstance(reply, tuple) and reply and isinstance(reply[0], str)
                and len(reply) == {"ok": 3, "misbehaved": 3, "error": 5}.get(reply[0])
                and all(isinstance(x, str) for x in reply[1:-1] if reply[0] != "ok")):
            raise Misbehaved("sent the grader a reply it did not ask for")       # learner code writing to the pipe
        kind, *rest, compiling = reply
        if isinstance(compiling, float) and 0.0 <= compiling < 1e5:       # what a worker says; learner code runs there
            self.compile_seconds += compiling
        if kind == "ok":
            self.last_call = (fn_name, describe_value(rest[0]))
            return rest[0]
        if kind == "misbehaved":
            raise Misbehaved(wire.cut(rest[0], MESSAGE_CAP))
        raise LearnerError(*_capped(*rest))


def _capped(type_name: str, message: str, tb: str) -> tuple[str, str, str]:
    """An error's strings as the worker sent them, each cut to what a record keeps (the end of a traceback)."""
    return wire.cut(type_name, NAME_CAP), wire.cut(message, MESSAGE_CAP), tb[-TRACEBACK_CAP:]


def _tensor_bytes(obj) -> int:
    """The bytes of the tensors in the grader's own arguments ``obj`` (nested lists, tuples, dicts)."""
    import torch
    total, stack = 0, [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, (list, tuple, dict)) and depth < wire.MAX_DEPTH:
            stack.extend((y, depth + 1) for y in (x.values() if isinstance(x, dict) else x))
    return total


def loader_dir(source: str) -> Path:
    from kernels import loader
    return loader.source_dir(source)


def _describe_exit(code, out_of_memory: bool = False) -> str:
    if out_of_memory:
        return ("the worker was stopped for using more memory than the grader's limit (shared memory included): "
                + Runner._MEMORY_HINT)
    if code is None:
        return "the worker process stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {"SIGSEGV": "a segmentation fault (an out-of-bounds access in compiled code)",
                "SIGBUS": "a bus error (a misaligned or out-of-bounds access in compiled code)",
                "SIGABRT": "an abort (os.abort, a failed C++ assertion or a device-side assert)",
                "SIGKILL": "killed (out of memory, or the time limit)"}.get(name, name)
        return f"the worker crashed: {hint}"
    if code == 3:
        return "the worker hit a CUDA error (an illegal memory access?) and was restarted"
    return f"the worker exited with status {code} (sys.exit or os._exit in stage code?)"


class _GraderPipes:
    """The grader's end of a worker's two pipes, both non-blocking: Runner bounds each wait on them."""

    def __init__(self, fd_out: int, fd_in: int):
        for fd in (fd_out, fd_in):
            os.set_blocking(fd, False)
        self.fds = (fd_in, fd_out)

    def wait(self, timeout: float, *, write: bool) -> tuple[bool, bool]:
        """Within ``timeout`` seconds: whether the reply pipe can be read (or has closed) and, with
        ``write``, whether the request pipe can be written (or has closed).  poll, not select: any
        descriptor number will do."""
        poller = select.poll()
        poller.register(self.fds[0], select.POLLIN)
        if write:
            poller.register(self.fds[1], select.POLLOUT)
        events = dict(poller.poll(max(0.0, timeout) * 1000))
        return bool(events.get(self.fds[0])), bool(events.get(self.fds[1]))

    def close(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _write_all(fd: int, data: bytes) -> None:
    """Write ``data`` to the pipe ``fd`` and close it (a worker that died before reading it: nothing)."""
    try:
        with open(fd, "wb") as f:
            f.write(data)
    except OSError:
        pass
