"""Run learner code in a process of its own.

The grader's process builds inputs, computes the reference and compares; learner code only
ever runs here, in a worker started with ``spawn``.  The two speak over a pipe:

    grader -> worker   ("call", function name, args, kwargs)      (pickle: the grader's data)
    worker -> grader   torch.save bytes of ("ok", result) or ("error", type, message, traceback)

Results come back through ``torch.load(weights_only=True)``, which only rebuilds tensors and
plain containers, so a hostile worker cannot run code in the grader.  Outputs the learner's
wrapper allocates with ``torch.empty`` and friends are poisoned with NaN first, so an element
the kernel never writes shows up as NaN instead of as whatever was in memory.

A worker that crashes, hangs past its time limit or hits a CUDA error is killed and a fresh
one is started for the next call.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

_OUTPUT_CAP = 64 * 1024  # bytes of the learner's printed output kept for messages


class LearnerError(Exception):
    """An exception raised by learner code, carried back from the worker."""

    def __init__(self, type_name: str, message: str, tb: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.tb = type_name, message, tb


class WorkerDied(Exception):
    """The worker crashed (segfault, abort, exit) or was killed after its time limit."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.reason, self.timed_out = reason, timed_out


class ImportFailed(LearnerError):
    """The stage file could not be imported (syntax error, failing import, ...)."""


def _to_device(obj, device):
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _to_cpu(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu").clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


@contextmanager
def poisoned_allocations():
    """Make torch.empty, empty_like, empty_strided and Tensor.new_empty return NaN-filled floats."""
    import torch
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    new_empty = torch.Tensor.new_empty

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool and t.numel():
            t.fill_(-7777)
        return t

    def wrap(fn):
        return lambda *a, **kw: poison(fn(*a, **kw))

    try:
        for name, fn in originals.items():
            setattr(torch, name, wrap(fn))
        torch.Tensor.new_empty = lambda self, *a, **kw: poison(new_empty(self, *a, **kw))
        yield
    finally:
        for name, fn in originals.items():
            setattr(torch, name, fn)
        torch.Tensor.new_empty = new_empty


def _pack(obj) -> bytes:
    import torch
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _worker_main(conn, stage: str, source: str, log_path: str) -> None:
    # Learner prints go to a log file, never into the protocol or the grader's table.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    try:
        from kernels import loader, runtime
        import torch
        module = loader.load_stage(stage, source)
        conn.send_bytes(_pack(("ready", runtime.describe())))
    except BaseException as exc:  # noqa: BLE001 - any import failure is reported, not raised
        conn.send_bytes(_pack(("import-error", type(exc).__name__, str(exc), traceback.format_exc(limit=-6))))
        return
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        _, fn_name, args, kwargs = request
        fatal = False
        try:
            fn = getattr(module, fn_name, None)
            if fn is None:
                raise AttributeError(f"the stage file has no function {fn_name!r}")
            args, kwargs = _to_device(args, runtime.DEVICE), _to_device(kwargs, runtime.DEVICE)
            with poisoned_allocations():
                result = fn(*args, **kwargs)
            if runtime.ON_GPU:
                torch.cuda.synchronize()
            reply = ("ok", _to_cpu(result))
        except BaseException as exc:  # noqa: BLE001
            text = str(exc)
            fatal = "CUDA error" in text or "illegal memory access" in text or isinstance(exc, (SystemExit, KeyboardInterrupt))
            reply = ("error", type(exc).__name__, text[:4000], traceback.format_exc(limit=-4)[-4000:])
        try:
            payload = _pack(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. a result torch.save cannot store
            payload = _pack(("error", "TypeError", f"could not send the result back: {exc}", ""))
        conn.send_bytes(payload)
        if fatal:
            sys.stdout.flush()
            os._exit(3)


class Runner:
    """Calls functions of one stage module in a worker process, restarting it when needed."""

    def __init__(self, stage: str, source: str, *, log_dir: str | os.PathLike | None = None):
        self.stage, self.source = stage, str(source)
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        log_dir = Path(log_dir or os.environ.get("TMPDIR", "/tmp"))
        self.log_path = str(log_dir / f"workbook-{stage}-{os.getpid()}-{id(self)}.log")
        self.description = ""

    # -- process management -------------------------------------------------------------
    def _start(self, timeout: float) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_worker_main, args=(child, self.stage, self.source, self.log_path),
                                       daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        kind, *rest = self._receive(timeout, starting=True)
        if kind == "import-error":
            type_name, message, tb = rest
            self.close()
            raise ImportFailed(type_name, message, tb)
        self.description = rest[0]

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
        if self._conn is not None:
            self._conn.close()
        self._proc = self._conn = None

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

    def _receive(self, timeout: float, *, starting: bool = False):
        import torch
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                what = "starting the stage (importing it)" if starting else "the call"
                raise WorkerDied(f"timed out after {timeout:.0f} s during {what}: an infinite loop, "
                                 "a kernel that never finishes, or sizes too large", timed_out=True)
            try:
                ready = self._conn.poll(min(left, 0.5))
            except (OSError, EOFError):
                ready = False
            if ready:
                try:
                    data = self._conn.recv_bytes()
                except (EOFError, OSError):
                    pass
                else:
                    return torch.load(io.BytesIO(data), weights_only=True)
            if not self._proc.is_alive():
                code = self._proc.exitcode
                self.close()
                raise WorkerDied(_describe_exit(code))

    # -- calls ----------------------------------------------------------------------------
    def call(self, fn_name: str, *args, timeout: float = 120.0, **kwargs):
        """Call ``fn_name(*args, **kwargs)`` in the worker; return its result on the CPU."""
        if self._proc is None:
            self._start(timeout)
        try:
            self._conn.send(("call", fn_name, args, kwargs))
        except (BrokenPipeError, OSError):
            code = self._proc.exitcode if self._proc else None
            self.close()
            raise WorkerDied(_describe_exit(code))
        kind, *rest = self._receive(timeout)
        if kind == "ok":
            return rest[0]
        type_name, message, tb = rest
        raise LearnerError(type_name, message, tb)


def _describe_exit(code) -> str:
    if code is None:
        return "the worker process stopped answering"
    if code < 0:
        import signal
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {"SIGSEGV": "a segmentation fault (an out-of-bounds access in compiled code)",
                "SIGABRT": "an abort (os.abort, a failed C++ assertion or a device-side assert)",
                "SIGKILL": "killed (out of memory, or the time limit)"}.get(name, name)
        return f"the worker crashed: {hint}"
    if code == 3:
        return "the worker hit a CUDA error (an illegal memory access?) and was restarted"
    return f"the worker exited with status {code} (sys.exit or os._exit in stage code?)"
