"""What learner code may spend: time per check and per stage, memory, and printed output.

Each limit has a default, an environment variable, and an option of ``python -m grader``:

    per check   WORKBOOK_CHECK_TIMEOUT  --check-timeout  one check, all its learner calls together; unset,
                                                         each call gets a share of the stage's time (below)
    per stage   WORKBOOK_STAGE_TIMEOUT  --stage-timeout  all the checks of one stage together (600 s):
                                                         a hanging submission costs at most this
    memory      WORKBOOK_MEMORY_MB      --memory-mb      the worker's resident memory (8 GiB; less on a
                                                         machine with under 10 GiB of RAM)
    output      WORKBOOK_OUTPUT_KB      --output-kb      what learner code may print (1024 KiB)
    processes   WORKBOOK_PROCESSES      --processes      processes and threads at once (256), where the
                                                         worker has a uid of its own
    disk        WORKBOOK_DISK_MB        --disk-mb        the worker's scratch space, and any one file (2048)
    open files  WORKBOOK_OPEN_FILES     --open-files     file descriptors at once (1024)

A call that runs out of time fails its check ("timeout"); a worker that goes over its memory
or prints past the cap is stopped and the check fails ("crash") with that reason.  So is a worker
whose reply to a call is larger than ``reply_bytes`` allows for that call.

With no per-check limit given, each learner call of a check may take the check's own ``timeout``
(180 s) or an equal share of the stage's time, whichever is less: ``stage_timeout * workers /
checks`` (66.7 s for stage 1's nine checks on one worker), at least ``CHECK_FLOOR`` seconds
(``Limits.for_stage``).  A call that hangs ends its check, so a function that hangs costs each
check that calls it one share, and the checks after them still have theirs.  (A fixed 180 s per
call let four hanging checks use up a 600 s stage and leave stage 1's attention checks "not run".)
The share bounds each call, not the check, so starting a worker (importing torch, seconds on a busy
machine) is never charged to a check.  The floor keeps a cold compile on a GPU inside one call's
share (the slowest check in docs/verdicts.md spent 15 s compiling); on the CPU the interpreter
compiles nothing, so the floor is small there and a short ``--stage-timeout`` stays short.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

ENV = {"check_timeout": "WORKBOOK_CHECK_TIMEOUT", "stage_timeout": "WORKBOOK_STAGE_TIMEOUT",
       "memory_mb": "WORKBOOK_MEMORY_MB", "output_kb": "WORKBOOK_OUTPUT_KB", "processes": "WORKBOOK_PROCESSES",
       "disk_mb": "WORKBOOK_DISK_MB", "open_files": "WORKBOOK_OPEN_FILES"}


#: The least time a call gets when the stage's time is shared out (``Limits.for_stage``): on a GPU a
#: call may compile its kernels cold; in the CPU interpreter nothing compiles.
CHECK_FLOOR = {"gpu": 60.0, "cpu": 5.0}


def _ram_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):
        return 16 * 1024


def default_memory_mb(jobs: int = 1) -> int:
    """8 GiB, or less where ``jobs`` workers sharing this machine's RAM would not fit (never under 1 GiB)."""
    return max(1024, min(8192, int(0.8 * _ram_mb()) // max(1, jobs)))


@dataclass(frozen=True)
class Limits:
    check_timeout: float | None = None    # None: each call gets at most call_timeout
    stage_timeout: float = 600.0
    memory_mb: int = 8192
    output_kb: int = 1024
    processes: int = 256
    disk_mb: int = 2048
    open_files: int = 1024
    call_timeout: float | None = None     # set by for_stage where check_timeout is None: each call's share

    @classmethod
    def from_env(cls, *, jobs: int = 1, **overrides) -> "Limits":
        """Defaults (for ``jobs`` gradings at once), then WORKBOOK_* variables, then ``overrides`` not None."""
        values: dict = {"memory_mb": default_memory_mb(jobs)}
        for name, var in ENV.items():
            if os.environ.get(var):
                values[name] = float(os.environ[var]) if "timeout" in name else int(os.environ[var])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

    def for_stage(self, checks: int, workers: int = 1, *, gpu: bool = False) -> "Limits":
        """These limits for grading ``checks`` checks on ``workers`` workers: with no per-check limit given,
        ``call_timeout``, each call's share of the stage, ``stage_timeout * workers / checks`` seconds, at least
        ``CHECK_FLOOR`` (more on a GPU, where kernels compile); a check's own shorter ``timeout`` still holds."""
        if self.check_timeout is not None or checks < 1:
            return self
        share = self.stage_timeout * max(1, workers) / checks
        return replace(self, call_timeout=round(max(share, CHECK_FLOOR["gpu" if gpu else "cpu"]), 1))

    def env(self) -> dict[str, str]:
        """These limits as WORKBOOK_* variables, for a grader started in another process."""
        return {var: str(getattr(self, name)) for name, var in ENV.items() if getattr(self, name) is not None}


# A reply holds the call's outputs, which are about the size of its inputs (o is q's size, dq, dk and
# dv those of q, k and v).  The grader holds a reply in its own memory while it reads it, so a cap
# set by the worker's memory limit would let one grading cost twice that limit: the cap is sized by
# the call instead, with a floor for plans, numbers and the outputs of small inputs.
REPLY_FLOOR_MB = 16
REPLY_FACTOR = 4          # times the bytes of the call's input tensors


def reply_bytes(input_bytes: int, memory_mb: int) -> int:
    """The most a worker's reply to one call whose input tensors hold ``input_bytes`` may hold:
    REPLY_FACTOR times those bytes plus REPLY_FLOOR_MB, and never more than an eighth of the
    worker's memory limit (nor less than the floor)."""
    floor = REPLY_FLOOR_MB << 20
    return min(max(floor, (memory_mb << 20) // 8), floor + REPLY_FACTOR * input_bytes)


def add_limit_options(parser) -> None:
    """The limits as options of an argparse parser: --check-timeout, --stage-timeout, --memory-mb, --output-kb."""
    parser.add_argument("--check-timeout", type=float, metavar="S", help="seconds for one check, all its calls")
    parser.add_argument("--stage-timeout", type=float, metavar="S", help="seconds for all the checks of a stage")
    parser.add_argument("--memory-mb", type=int, metavar="MB", help="the worker's memory limit")
    parser.add_argument("--output-kb", type=int, metavar="KB", help="how much learner code may print")
    parser.add_argument("--processes", type=int, metavar="N", help="processes and threads learner code may run")
    parser.add_argument("--disk-mb", type=int, metavar="MB", help="scratch space learner code may write")
    parser.add_argument("--open-files", type=int, metavar="N", help="files learner code may hold open")


def limit_overrides(args) -> dict:
    """The options of ``add_limit_options`` as ``Limits.from_env`` overrides (None: not given)."""
    return {k: getattr(args, k) for k in ENV}
