"""Tests that hide this checkout's answer keys, and tests that set or compare their modes, take turns.

A grading with the ``user`` mechanism takes every permission of other users from the answer keys
and gives them back when the last grading of the checkout ends (grader/isolation/answer_keys.py).
A test that puts the modes back by hand, or records them to compare later, must not do so while
another test's grading (another pytest-xdist worker) has them hidden: put back, they would let
that grading's worker read the solutions; recorded, they would be the hidden ones.

So tests that grade this checkout hold :func:`keys_turn` shared, and tests that touch or compare
the modes hold it exclusive.  The lock is a file of the tests' own, not the grader's, which must
stay free to decide who gives the modes back.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kernels.loader import ROOT


def _lock_path() -> Path:
    name = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"workbook-tests-answer-keys-{name}.lock"


class KeysTurn:
    """An flock on the tests' lock file of this checkout, taken shared or exclusive, and changed."""

    def __init__(self) -> None:
        self._fd = os.open(_lock_path(), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def take(self, *, exclusive: bool) -> None:
        import fcntl
        fcntl.flock(self._fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextmanager
def keys_turn(*, exclusive: bool) -> Iterator[KeysTurn]:
    """Hold this checkout's turn: shared to grade it, exclusive to set or compare its keys' modes."""
    turn = KeysTurn()
    try:
        turn.take(exclusive=exclusive)
        yield turn
    finally:
        turn.close()
