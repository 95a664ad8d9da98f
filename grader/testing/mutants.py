"""Deliberately wrong solutions, made by editing the real one, that a stage's checks must reject.

A test that cannot fail is worthless.  Each stage lists its mutants in ``tests/wrong/stageN.py``::

    MUTANTS = [
        Mutant("no_rescale", "forgets to rescale acc when the max grows",
               edits=[("acc = acc * alpha[..., None] + p @ vj", "acc = acc + p @ vj")],
               caught_by=["attention_matches_reference"], diagnosis="acc_not_rescaled"),
    ]

``diagnosis`` is the cause (a name of ``grader.diagnose.CAUSES``) the failing checks must name first; a mutant
caught by a check whose own message is specific (a plan, a count of visited blocks) leaves it "".
Each edit replaces text that must occur exactly once in the solution, so a mutant breaks
loudly (instead of silently testing nothing) when the solution changes under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kernels.loader import ROOT
from kernels.solution_file import expand_file


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str
    edits: list[tuple[str, str]]
    caught_by: list[str] = field(default_factory=list)   # checks that reject it (on a GPU: at least one)
    file: str = ".py"                                    # which of the stage's files to edit
    diagnosis: str = ""    # the cause grader.diagnose must name for it; "" where a check's own message does

    def __post_init__(self):
        from grader import diagnose
        if self.diagnosis and self.diagnosis not in diagnose.CAUSES:
            raise ValueError(f"mutant {self.name!r}: grader.diagnose knows no cause {self.diagnosis!r}")


def build(stage, mutant: Mutant, dest: Path) -> Path:
    """Write the stage's solution files with the mutant's edits applied into ``dest``.

    The edits apply to the expanded solution (kernels/solution_file.py), so a mutant may edit code
    the stage takes from an earlier one as given code."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in stage.files():
        text = expand_file(ROOT / "solutions" / name)
        if name.endswith(mutant.file):
            for old, new in mutant.edits:
                count = text.count(old)
                if count != 1:
                    raise ValueError(f"mutant {mutant.name!r}: {old!r} occurs {count} times in solutions/{name}; "
                                     "expected exactly once (update the mutant to match the solution)")
                text = text.replace(old, new)
        (dest / name).write_text(text)
    return dest


def copy_solution(stage, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in stage.files():
        (dest / name).write_text(expand_file(ROOT / "solutions" / name))
    return dest
