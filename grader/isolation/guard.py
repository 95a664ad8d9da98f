"""Defences the worker puts up around learner code.

Verdicts never depend on these: inputs, the float64 reference and the comparison all live in the
grader's process, which never imports learner code.  What runs here gives learner code that reaches
for the answers a message that says why, and turns quiet misbehaviour into a message.

Before the stage file is imported (``install``):

* An audit hook (``sys.addaudithook``; once installed it cannot be removed) refuses
  - reading the answer keys: ``solutions/``, ``tests/`` (its wrong solutions quote the solutions),
    ``grader/checks/`` (hidden checks live there), ``kernels/reference.py``, and, in a batch,
    the other learners' submissions;
  - writing to the workbook itself, to the Python installation (a patched ``torch`` or a ``.pth``
    file would reach the next learner's grader) and to the batch's output;
  - signalling the grader, forking, and opening another process's ``/proc`` entries (its memory).
* A meta-path finder refuses modules found in those folders, so ``import solutions.x`` fails with
  a message that says why instead of a file error.
* ``kernels.reference`` (the answer key) is replaced by a stand-in whose every name raises.

Around every call (``poisoned_allocations``, ``snapshot_inputs``):

* Outputs made with ``torch.empty`` and friends are NaN-poisoned, and placed between two 64 KiB
  canary regions: a store past either end of an output changes a canary and fails the check.
* The inputs are copied before the call and compared after it: a kernel must not write to them.

A store further than 64 KiB from an output, or past a buffer no ``torch.empty*`` call made (a
``torch.zeros`` one), is not seen here. On the CPU it corrupts the heap: a crash if it is lucky
(the check fails "crash", and faulthandler names the stage-code line), nothing visible if not. On a
GPU it lands silently in another tensor of the caching allocator, or outside every allocation,
which is an illegal memory access: a CUDA error, and the check fails "crash". ``python -m grader
stageN --sanitize`` runs compute-sanitizer, which sees every such access, on a GPU.

None of this is the isolation boundary: code that makes raw system calls (ctypes, a compiled
extension) or opens files relative to a directory descriptor (``dir_fd=``) gets past an audit
hook.  The boundary is the operating system's: the sandbox (grader/isolation/sandbox.py) starts
the worker where the answer keys are not there to read.  What stays here are early, friendly
messages, and the checks on inputs and outputs above.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import site
import sys
import tempfile
import threading
import types
import weakref
from contextlib import contextmanager
from pathlib import Path

# -- files, imports and signals ---------------------------------------------------------------
_READ_EVENTS = {"open", "os.listdir", "os.scandir"}
_COPY_EVENTS = {"shutil.copyfile", "os.link", "os.symlink"}
_WRITE_EVENTS = {"os.remove", "os.rmdir", "os.rename", "os.truncate", "os.chmod", "os.chown", "os.mkdir", "os.utime",
                 "shutil.rmtree", "shutil.move", "os.setxattr", "os.removexattr", *_COPY_EVENTS}
_PROCESS_EVENTS = {"os.kill", "os.killpg", "os.fork", "os.forkpty"}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _norm(path) -> str | None:
    if isinstance(path, int):
        return None
    try:
        return os.path.realpath(os.path.join(os.getcwd(), os.fsdecode(os.fspath(path))))
    except (TypeError, ValueError, OSError):
        return None


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class Guard:
    """Which paths learner code may not read (``private``) or write (``protected``)."""

    def __init__(self, root: Path, *, readable=(), private=(), protected=()):
        root = Path(root).resolve()
        self.private = {str(root / "solutions"): "the reference solutions",
                        str(root / "tests"): "the workbook's tests",
                        str(root / "grader" / "checks"): "the grader's checks",
                        str(root / "kernels" / "reference.py"): "the float64 reference (the answer key)"}
        self.private.update({_norm(p): "another submission, or the grader's own files" for p in private})
        self.readable = [_norm(p) for p in readable]
        keep = {_norm(tempfile.gettempdir()), _norm(Path.home())}
        roots = [root, sys.prefix, sys.base_prefix, sys.exec_prefix, site.getusersitepackages(),
                 *site.getsitepackages(), *protected]
        # A root that holds the temporary folder or the home folder ("/", say) is not protected:
        # learner code, Triton and the CUDA build all write there.
        self.protected = sorted({p for p in map(_norm, roots) if p and not any(_under(k, p) for k in keep)})
        self.writable = [str(root / "build"), str(root / ".grader-cache")]
        self._busy = threading.local()  # the hook's own file calls must not re-enter it

    def read_refusal(self, path: str) -> str | None:
        if any(_under(path, r) for r in self.readable):
            return None
        for place, what in self.private.items():
            if _under(path, place):
                return what
        if path.startswith("/proc/") and path.split("/")[2].isdigit() and path.split("/")[2] != str(os.getpid()):
            return "another process"
        return None

    def write_refusal(self, path: str) -> str | None:
        if any(_under(path, w) for w in self.writable):
            return None
        if any(_under(path, p) for p in self.protected):
            return "the workbook, the Python installation or the grader's output"
        return None

    def audit(self, event: str, args: tuple) -> None:
        if event not in _READ_EVENTS and event not in _WRITE_EVENTS and event not in _PROCESS_EVENTS:
            return
        if getattr(self._busy, "on", False):
            return
        self._busy.on = True
        try:
            refusal = self._refusal(event, args)
        finally:
            self._busy.on = False
        if refusal:
            raise PermissionError(f"the grader does not let stage code {refusal}")

    def _refusal(self, event: str, args: tuple) -> str | None:
        if event in ("os.fork", "os.forkpty"):
            return "fork (use the torch and Triton APIs; the grader runs your code in its own process)"
        if event in ("os.kill", "os.killpg"):
            target, me = args[0], os.getpid()
            if event == "os.killpg":
                return None if target == os.getpgid(0) else "signal other process groups"
            return None if target in (0, me) or target == -os.getpgid(0) else "signal other processes"
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                      (isinstance(flags, int) and bool(flags & _WRITE_FLAGS))
            reads, writes = ([], [path]) if writing else ([path], [])
        elif event in _COPY_EVENTS:  # (source, destination): the source is only read
            reads, writes = [args[0]], [args[1]]
        elif event in _WRITE_EVENTS:
            reads, writes = [], [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
        else:
            reads, writes = [args[0]], []
        for p in filter(None, map(_norm, reads)):
            what = self.read_refusal(p)
            if what:
                return f"read {p}: that is {what}"
        for p in filter(None, map(_norm, writes)):
            what = self.read_refusal(p) or self.write_refusal(p)
            if what:
                return f"write {p}: that is {what}"
        return None


class _RefuseImports(importlib.abc.MetaPathFinder):
    """``import solutions...``, ``import tests...``: refused, with the reason."""

    def __init__(self, guard: Guard):
        self.guard = guard

    _NAMED = {"solutions": "the reference solutions", "tests": "the workbook's tests",
              "grader.checks": "the grader's checks"}

    def find_spec(self, fullname, path=None, target=None):
        for name, what in self._NAMED.items():  # inside a sandbox they are not there at all: say why
            if fullname == name or fullname.startswith(name + "."):
                raise ImportError(f"the grader does not let stage code import {fullname}: that is {what}",
                                  name=fullname)
        if path is not None and not any(self.guard.read_refusal(_norm(p) or "") for p in path):
            return None  # a submodule of a package outside the private folders: nothing to look up
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            return None
        places = list(spec.submodule_search_locations or []) + ([spec.origin] if spec.has_location else [])
        for place in filter(None, map(_norm, places)):
            what = self.guard.read_refusal(place)
            if what:
                raise ImportError(f"the grader does not let stage code import {fullname}: that is {what}",
                                  name=fullname)
        return None


def _lock_reference() -> None:
    """Put a stand-in for ``kernels.reference`` (the answer key) whose every name raises."""
    import kernels

    class Refused(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            raise PermissionError(f"kernels.reference.{name} is the grader's answer key; stage code may not "
                                  "use it: compute the result yourself")

    stand_in = Refused("kernels.reference")
    sys.modules["kernels.reference"] = stand_in
    kernels.reference = stand_in


def _env_paths(name: str) -> list[str]:
    return [p for p in os.environ.get(name, "").split(os.pathsep) if p]


def install(root: Path, *, readable=(), private=(), protected=()) -> Guard:
    """Put up the file, import and reference defences in this (the worker's) process.

    ``WORKBOOK_PRIVATE`` and ``WORKBOOK_PROTECT`` (os.pathsep-separated) add folders to
    ``private`` and ``protected``: ``python -m grader batch`` names the submissions and its output.
    """
    guard = Guard(root, readable=readable, private=[*private, *_env_paths("WORKBOOK_PRIVATE")],
                  protected=[*protected, *_env_paths("WORKBOOK_PROTECT")])
    _lock_reference()
    sys.meta_path.insert(0, _RefuseImports(guard))
    sys.addaudithook(guard.audit)
    return guard


# -- around each call -------------------------------------------------------------------------
_PAD_BYTES = 64 * 1024
_CANARY = 0xA5


def _guardable(t, kwargs) -> bool:
    """Real memory only: not a fake tensor that torch.compile allocates while it traces (canaries
    kept on it would later be read through ops a fake tensor cannot run), nor any other subclass."""
    import torch
    return (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type != "meta" and t.numel() > 0
            and not t.is_complex() and not kwargs.get("requires_grad") and not kwargs.get("pin_memory"))


def _with_canaries(t, how: str, guards: list, empty):
    """``t``'s shape and strides, inside a buffer with canary bytes on either side."""
    import torch
    size = t.element_size()
    pad, span = _PAD_BYTES // size, t.untyped_storage().nbytes() // size
    base = empty(span + 2 * pad, dtype=t.dtype, device=t.device)
    base.view(torch.uint8).fill_(_CANARY)
    view = base.as_strided(t.size(), t.stride(), pad)
    guards.append((weakref.ref(view), pad * size, span * size, how))
    return view


@contextmanager
def poisoned_allocations(guards: list | None = None):
    """Make torch.empty, empty_like, empty_strided and Tensor.new_empty return NaN-filled floats.

    With a list ``guards``, each such tensor also gets canary regions around it (see
    ``check_canaries``), recorded in that list.
    """
    import torch
    originals = {name: getattr(torch, name) for name in ("empty", "empty_like", "empty_strided")}
    new_empty = torch.Tensor.new_empty

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool and t.numel():
            t.fill_(-7777)
        return t

    def wrap(fn, how):
        def allocate(*args, **kwargs):
            t = fn(*args, **kwargs)
            if guards is not None and _guardable(t, kwargs):
                t = _with_canaries(t, how, guards, originals["empty"])
            return poison(t)
        return allocate

    def install(plain: bool):
        for name, fn in originals.items():
            setattr(torch, name, fn if plain else wrap(fn, name))
        torch.Tensor.new_empty = new_empty if plain else (
            lambda self, *a, **kw: wrap(new_empty, "Tensor.new_empty")(self, *a, **kw))

    try:
        install(plain=False)
        _INSTALLED.append(install)
        yield
    finally:
        _INSTALLED.pop()
        install(plain=True)


_INSTALLED: list = []       # poisoned_allocations' installers, innermost last


@contextmanager
def plain_allocations():
    """Inside ``poisoned_allocations``: torch's own allocators for a while, then the poisoned ones again.

    For ``torch.library.opcheck`` (grader/isolation/harness.py), which compares an operator's outputs
    with its fake implementation's, storage offsets included: an output inside a canary buffer is a
    view at an offset, and every operator would fail that comparison.
    """
    if not _INSTALLED:
        yield
        return
    _INSTALLED[-1](plain=True)
    try:
        yield
    finally:
        _INSTALLED[-1](plain=False)


def check_canaries(guards: list) -> str | None:
    """A message if a store landed just before or after an output that is still alive."""
    import torch
    for ref, pad, span, how in guards:
        view = ref()
        if view is None or view._base is None:
            continue  # a temporary the code has already dropped
        raw = view._base.view(torch.uint8)
        if view.numel():  # a resize_ may have grown the tensor: what it covers now is its own
            last = view.storage_offset() + sum((n - 1) * st for n, st in zip(view.shape, view.stride()))
            span = max(span, (last + 1) * view.element_size() - pad)
        before = (raw[:pad] != _CANARY).nonzero()
        after = (raw[pad + span:] != _CANARY).nonzero()
        if before.numel() or after.numel():
            where = []
            if after.numel():
                where.append(f"{after.numel()} bytes past its end (up to {int(after.max()) + 1} bytes beyond)")
            if before.numel():
                where.append(f"{before.numel()} bytes before its start (up to {pad - int(before.min())} bytes before)")
            return (f"wrote outside an output: {' and '.join(where)}, in the {tuple(view.shape)} "
                    f"{str(view.dtype).replace('torch.', '')} tensor made by torch.{how}. A store without a "
                    "bounds mask, or a loop that runs one block too far? Memory past a tensor belongs to "
                    "other tensors, so such a store corrupts them.")
    return None


def snapshot_inputs(fn, args, kwargs) -> list:
    """(name, tensor, copy) for every tensor argument, nested ones included."""
    import torch
    try:
        named = list(inspect.signature(fn).bind(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):
        named = [(f"argument {i + 1}", a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []

    def walk(label, obj):
        if isinstance(obj, torch.Tensor):
            out.append((label, obj, obj.detach().clone()))
        elif isinstance(obj, (list, tuple)):
            for i, x in enumerate(obj):
                walk(f"{label}[{i}]", x)
        elif isinstance(obj, dict):
            for k, x in obj.items():
                walk(f"{label}[{k!r}]", x)

    for label, obj in named:
        walk(label, obj)
    return out


def changed_inputs(fn_name: str, snapshots: list) -> str | None:
    """A message naming the first input the call wrote to, or None."""
    import torch
    for label, t, copy in snapshots:
        if t.shape != copy.shape or t.dtype != copy.dtype:
            return (f"{fn_name} changed its input {label} in place (from {tuple(copy.shape)} {copy.dtype} to "
                    f"{tuple(t.shape)} {t.dtype}); inputs belong to the caller: leave them as they are")
        a, b = t.detach().reshape(-1), copy.reshape(-1)
        same = a == b
        if a.is_floating_point():
            same |= a.isnan() & b.isnan()
        bad = (~same).nonzero()
        if bad.numel():
            index = tuple(int(i) for i in torch.unravel_index(bad[0, 0], t.shape)) if t.ndim else ()
            return (f"{fn_name} wrote to its input {label}: {bad.numel()} of {a.numel()} elements changed, the "
                    f"first at index {index}. Inputs belong to the caller: write results to a new tensor "
                    "(an in-place op such as mul_, or a store through the input's pointer?)")
    return None
