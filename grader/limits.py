"""What learner code may spend: time per check and per stage, memory, and printed output.

Each limit has a default, an environment variable, and an option of ``python -m grader``:

    per check   WORKBOOK_CHECK_TIMEOUT  --check-timeout  one check, all its learner calls together; unset,
                                                         each call gets its check's own ``timeout`` (180 s)
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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

ENV = {"check_timeout": "WORKBOOK_CHECK_TIMEOUT", "stage_timeout": "WORKBOOK_STAGE_TIMEOUT",
       "memory_mb": "WORKBOOK_MEMORY_MB", "output_kb": "WORKBOOK_OUTPUT_KB", "processes": "WORKBOOK_PROCESSES",
       "disk_mb": "WORKBOOK_DISK_MB", "open_files": "WORKBOOK_OPEN_FILES"}


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
    check_timeout: float | None = None    # None: each call gets its check's ``timeout``
    stage_timeout: float = 600.0
    memory_mb: int = 8192
    output_kb: int = 1024
    processes: int = 256
    disk_mb: int = 2048
    open_files: int = 1024

    @classmethod
    def from_env(cls, *, jobs: int = 1, **overrides) -> "Limits":
        """Defaults (for ``jobs`` gradings at once), then WORKBOOK_* variables, then ``overrides`` not None."""
        values: dict = {"memory_mb": default_memory_mb(jobs)}
        for name, var in ENV.items():
            if os.environ.get(var):
                values[name] = float(os.environ[var]) if "timeout" in name else int(os.environ[var])
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)

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
