"""What a check is, and the helpers checks are written with.

A check is a plain function ``def name(ctx: Ctx)`` registered with ``@check(points=...)``.
It builds inputs in the grader's process, calls learner code through ``ctx.learner``
(which runs it in the worker), and judges the result with ``ctx.close`` / ``ctx.expect``
(attention with grader/checks/attention.py).
It passes by returning and fails by raising ``CheckFailed`` with a message that teaches.

    @check(points=2, hint="rescale the running sum whenever the running max grows")
    def rows_longer_than_a_block(ctx):
        x = ctx.randn(4, 300)
        y = ctx.learner.softmax(x)
        ctx.close(y, reference.softmax(x), reference.softmax(x, compute_dtype=x.dtype), name="softmax")
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable

from kernels import runtime, tolerance

import torch

from grader.isolation.outcomes import LearnerError, WorkerDied


class CheckFailed(AssertionError):
    """A check's verdict: the learner's code is wrong, and the message says how.

    ``diagnosis`` names the known mistake that explains the numbers (grader/diagnose/), when one does.
    """

    def __init__(self, message: str, diagnosis: str = "", also: tuple[str, ...] = ()):
        super().__init__(message)
        self.diagnosis, self.also = diagnosis, tuple(also)


class CheckSkipped(Exception):
    """The check cannot run on this machine (a tool it needs is missing): reported "not run", with the reason."""


@dataclass
class Check:
    name: str
    fn: Callable
    points: int = 1
    gpu: bool = False          # needs a CUDA GPU; reported "not run" without one
    timeout: float = 180.0     # seconds for one learner call, compile included
    hint: str = ""             # the usual cause, shown when the check fails
    doc: str = ""
    hidden: bool = False       # counts in the grade; never released, never named to the learner
    validation: bool = False   # judges bad-input handling only: no points while the code it calls has holes
    sm: int = 0                # the oldest GPU it runs on, as sm_XY (80: mma.sync.m16n8k16, cp.async); "not run" below
    given: bool = False        # the given code alone passes it: no points while the code it exercises has holes


_REGISTRY: dict[str, list[Check]] = {}


HIDDEN_PACKAGE = "grader.checks.hidden"


def check(*, points: int = 1, gpu: bool = False, timeout: float = 180.0, hint: str = "", hidden: bool = False,
          validation: bool = False, sm: int = 0, given: bool = False):
    """Register a check in the list of its module (one module of checks per stage).

    A ``validation`` check only asks that bad input be refused; the wrapper's given code already
    does most of that, so the check earns its points only once the functions it calls have no
    unfilled TODO left (see grader/holes.py).  A ``given`` check judges something the given code does
    by itself (a schedule, a build): it too earns its points only once the learner functions it
    exercises (``ctx.exercises``, or those it calls) have no unfilled TODO left.

    Hidden checks (``hidden=True``) live in ``grader/checks/hidden/stageN.py``, a folder that
    ``python -m grader release --to`` never copies; the two must agree, so a hidden check can
    never sit in a file that ships, nor a visible one in a file that does not.
    """
    def register(fn):
        in_hidden_file = fn.__module__.startswith(HIDDEN_PACKAGE + ".")
        if hidden != in_hidden_file:
            raise ValueError(f"check {fn.__name__} in {fn.__module__}: hidden checks, and only they, belong in "
                             f"grader/checks/hidden/stageN.py (with @check(hidden=True))")
        doc = (fn.__doc__ or "").strip().splitlines()
        c = Check(fn.__name__, fn, points, gpu, timeout, hint, doc[0] if doc else fn.__name__, hidden, validation, sm,
                  given)
        _REGISTRY.setdefault(fn.__module__, []).append(c)
        return fn
    return register


def checks_of(module) -> list[Check]:
    return list(_REGISTRY.get(module.__name__, []))


def session_seed() -> int:
    """Fresh inputs each run; ``WORKBOOK_SEED`` repeats a failing run exactly."""
    env = os.environ.get("WORKBOOK_SEED")
    return int(env) if env else secrets.randbelow(2**31)


class _Learner:
    def __init__(self, runner, timeout, deadline=None):
        self._runner, self._timeout, self._deadline = runner, timeout, deadline
        self._called: set[str] = set()      # the learner functions this check has called

    def __getattr__(self, fn_name):
        if fn_name.startswith("_"):
            raise AttributeError(fn_name)

        def call(*args, **kwargs):
            self._called.add(fn_name)
            timeout = self._timeout
            if self._deadline is not None:
                timeout = min(timeout, self._deadline - time.monotonic())
                if timeout <= 0:
                    raise WorkerDied("out of time before this call (the check's or the stage's time limit)",
                                     timed_out=True)
            return self._runner.call(fn_name, *args, timeout=timeout, **kwargs)
        return call


@dataclass
class Ctx:
    """Everything a check needs: a learner proxy, fresh random inputs, and judgements."""
    runner: object
    seed: int
    timeout: float = 180.0           # for each learner call
    deadline: float | None = None    # time.monotonic() by which the whole check must be done
    generator: torch.Generator = field(init=False)
    margins: list = field(init=False)  # (name, error / allowed) of every judgement made: the sweep reads them

    def __post_init__(self):
        self.generator = torch.Generator().manual_seed(self.seed)
        self.learner = _Learner(self.runner, self.timeout, self.deadline)
        self.margins = []

    def record(self, report: tolerance.Report, name: str) -> None:
        """Keep a judgement's margin (error / allowed), which the sweep reads."""
        if report.allowed > 0:
            self.margins.append((name, report.max_error / report.allowed))

    def exercises(self, *fn_names: str) -> None:
        """Count learner functions as exercised by this check without calling them (a build of the .cu
        they launch, a schedule they walk): an unfilled TODO they reach makes the check ``todo``."""
        self.learner._called.update(fn_names)

    @property
    def stage(self) -> str:
        """The module of the stage whose code this check runs ("stage1_online_softmax")."""
        return getattr(self.runner, "stage", "") or ""

    def headline(self, found) -> str:
        """A diagnosis as a message's first line: "likely cause, TODO(1c): ...", naming the hole it is in."""
        from grader import diagnose
        return diagnose.headline(found, self.stage, self.called)

    @property
    def called(self) -> set[str]:
        """Names of the learner functions this check has called so far."""
        return set(self.learner._called)

    # -- inputs ---------------------------------------------------------------------------
    def randn(self, *shape: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
        """Fresh standard-normal numbers (never zeros), on the CPU of the grader's process.

        On a GPU without bfloat16 (a T4), asking for bfloat16 stops the check: "not run"."""
        if dtype == torch.bfloat16 and runtime.ON_GPU and not runtime.has_bfloat16():
            major, minor = runtime.capability()
            self.skip(f"needs bfloat16, which an sm_80 or newer GPU has; this GPU is sm_{major}{minor}")
        return (torch.randn(*shape, generator=self.generator) * scale).to(dtype)

    def uniform(self, *shape: int, low: float, high: float, dtype=torch.float32) -> torch.Tensor:
        return (torch.rand(*shape, generator=self.generator) * (high - low) + low).to(dtype)

    # -- judgements -----------------------------------------------------------------------
    def fail(self, message: str, *, diagnosis: str = ""):
        raise CheckFailed(message, diagnosis)

    def skip(self, reason: str):
        """Stop here and report the check "not run" with ``reason`` (e.g. "nvcc not found")."""
        raise CheckSkipped(reason)

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise CheckFailed(message)

    def close(self, out, ref, baseline, *, name: str, factor: float = tolerance.OUTPUT_FACTOR,
              floor: float | None = None, dims=None, row_dim=None, block_m=None, explain=None) -> None:
        """Fail unless ``out`` is within the tolerance rule of the float64 ``ref`` (see kernels.tolerance).

        ``explain(allowed)``, when given, names the likely mistake of a wrong ``out`` (a grader.diagnose
        function bound to the inputs); its cause comes first in the message.
        """
        report = tolerance.compare(out, ref, baseline, name=name, factor=factor, floor=floor, dims=dims,
                                   row_dim=row_dim, block_m=block_m)
        self.record(report, name)
        if report.ok:
            return
        if explain is not None:
            from grader import diagnose
            found = diagnose.safely(explain, report.allowed)
            if found:
                raise CheckFailed(f"{self.headline(found)}\n{report.message}", found.cause, found.also)
        raise CheckFailed(report.message)

    def close_softmax(self, out, x, ref, baseline, *, name: str, block=None, dims=("r", "c"), extra=None) -> None:
        """``close`` for a row softmax of ``x``, naming the likely mistake first when it is wrong."""
        report = tolerance.compare(out, ref, baseline, name=name, dims=dims)
        self.record(report, name)
        if report.ok:
            return
        from grader import diagnose
        found = diagnose.safely(diagnose.softmax, out, x, allowed=report.allowed, block=block)
        numbers = report.message + (f"; {extra(out)}" if extra else "")
        if found:
            raise CheckFailed(f"{self.headline(found)}\n{numbers}", found.cause)
        raise CheckFailed(numbers)

    def expect_dtype(self, out, dtype, *, name: str) -> None:
        if not isinstance(out, torch.Tensor):
            raise CheckFailed(f"{name}: expected a tensor, got {type(out).__name__}")
        if out.dtype != dtype:
            raise CheckFailed(f"{name}: expected dtype {dtype}, got {out.dtype}")

    def expect_error(self, fn_name: str, *args, errors=("ValueError", "TypeError"), mentions=(), why: str = "",
                     **kwargs) -> None:
        """Fail unless calling learner ``fn_name`` raises one of ``errors`` naming each word in ``mentions``."""
        try:
            getattr(self.learner, fn_name)(*args, **kwargs)
        except LearnerError as exc:
            if exc.type_name == "NotImplementedError":
                raise
            if exc.type_name not in errors:
                raise CheckFailed(f"{why}: expected {' or '.join(errors)}, got {exc.type_name}: {exc.message[:300]}")
            missing = [m for m in mentions if m not in exc.message]
            if missing:
                raise CheckFailed(f"{why}: the {exc.type_name} should name {', '.join(map(repr, missing))}; "
                                  f"its message was {exc.message[:300]!r}")
            return
        raise CheckFailed(f"{why}: expected {' or '.join(errors)}, but the call returned normally")
