"""How a call of learner code in the worker can end, as the grader's checks see it.

The runner (grader/isolation/runner.py) turns what the worker sent, or how it ended, into one of
these exceptions, or into the value it returned; ``describe_value`` says in a few words what that
value was, for messages.  The checks and the grading catch them without needing the runner.
"""

from __future__ import annotations

from grader.isolation import wire


class LearnerError(Exception):
    """An exception raised by learner code, carried back from the worker."""

    def __init__(self, type_name: str, message: str, tb: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name, self.message, self.tb = type_name, message, tb


class Misbehaved(LearnerError):
    """The call returned, but wrote to its inputs or past its outputs, or returned what the grader refuses."""

    def __init__(self, message: str):
        super().__init__("Misbehaved", message)


class WorkerDied(Exception):
    """The worker crashed (segfault, abort, exit) or was stopped (time, memory or output limit)."""

    def __init__(self, reason: str, timed_out: bool = False):
        super().__init__(reason)
        self.reason, self.timed_out = reason, timed_out


class ImportFailed(LearnerError):
    """The stage file could not be imported (syntax error, failing import, a crash or hang at import, ...)."""

    def __init__(self, type_name: str, message: str, tb: str = "", *, timed_out: bool = False):
        super().__init__(type_name, message, tb)
        self.timed_out = timed_out


def describe_value(value) -> str:
    """What a learner function returned, in a few words: "a tuple of 3 (tensor (2, 4, 8) float32, ...)".

    It looks two levels deep and at four items of each, whatever the value holds."""
    import torch

    def one(v) -> str:
        if isinstance(v, torch.Tensor):
            return f"tensor {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
        if isinstance(v, (tuple, list)):
            return f"a {wire.cut(type(v).__name__, 40)} of {len(v)}"
        return "None" if v is None else f"a {wire.cut(type(v).__name__, 40)}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(one(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{one(value)} ({inner})"
    return one(value)
