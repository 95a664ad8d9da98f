"""What grading a stage produces, and how a terminal shows it.

``CheckResult`` is one check's verdict and ``StageResult`` a stage's; both round-trip through JSON
(``to_dict``/``from_dict``) for the progress cache, a batch's records and ``--format json``.
``format_result`` draws the table a learner reads, wrapped to the terminal, with the score line
under it (the statuses are described in grader/grade.py).
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from dataclasses import asdict, dataclass, field

from grader import COMMAND
from grader.stages import Stage

PASSING = ("pass",)


@dataclass
class CheckResult:
    name: str
    points: int
    earned: int
    status: str
    message: str = ""
    seconds: float = 0.0
    hidden: bool = False
    diagnosis: str = ""         # the known mistake that explains a FAIL (grader/diagnose/), if one does
    also: list[str] = field(default_factory=list)   # causes these inputs cannot tell from it
    calls: list[str] = field(default_factory=list)   # learner functions the check called


@dataclass
class StageResult:
    stage: str
    source: str
    status: str                 # "graded", "not started", "import error"
    results: list[CheckResult] = field(default_factory=list)
    seed: int = 0
    device: str = ""
    seconds: float = 0.0
    isolation: str = ""         # the mechanism learner code ran under (grader/isolation/)
    workers: int = 1            # worker processes that took the checks in turn

    @property
    def score(self) -> int:
        return sum(r.earned for r in self.results)

    @property
    def max_score(self) -> int:
        """The points of the checks that can run here: a check "not run" (no GPU, or a tool missing) counts
        neither way, so a learner's score and max_score mean the same on every machine that graded it."""
        return sum(r.points for r in self.results if r.status != "not run")

    @property
    def ok(self) -> bool:
        """Everything that ran passed (checks not run here do not count either way)."""
        return self.status == "graded" and all(r.status in PASSING + ("not run",) for r in self.results)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(score=self.score, max_score=self.max_score)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StageResult":
        fields = {k: d[k] for k in ("stage", "source", "status", "seed", "device", "seconds", "isolation", "workers")
                  if k in d}
        return cls(**fields, results=[CheckResult(**r) for r in d.get("results", [])])



_MARK = {"pass": "pass", "FAIL": "FAIL", "todo": "todo", "crash": "crash", "timeout": "timeout",
         "not run": "not run"}


def hidden_summary(results: list[CheckResult]) -> str:
    """All a learner learns of hidden checks: how many, and the points they earned."""
    hidden = [r for r in results if r.hidden]
    if not hidden:
        return ""
    n = len(hidden)
    return (f"{n} hidden check{'s' if n != 1 else ''}: {sum(r.earned for r in hidden)}/"
            f"{sum(r.points for r in hidden if r.status != 'not run')} points")


def _seconds(r: CheckResult) -> str:
    return "" if r.status == "not run" else f"{r.seconds:.1f} s"


def terminal_width() -> int:
    """The terminal's width in columns ($COLUMNS first, as shutil reads it), 100 when there is none."""
    return max(60, shutil.get_terminal_size((100, 24)).columns)


def _wrapped(message: str, width: int) -> list[str]:
    """A message's lines, each part between newlines wrapped to ``width``; a part that shows code (indented
    by four spaces, as a syntax error's line and its caret are) is kept as it is."""
    out = []
    for part in (message or "").split("\n"):
        if part.startswith("    ") and part.strip():
            out.append(part)
        else:
            out += textwrap.wrap(part.strip(), width=width) or [""]
    return out or [""]


#: Below this many columns for the message beside a check, its message goes under the check's line instead.
_MESSAGE_MIN = 50


def format_result(stage: Stage, result: StageResult, *, width: int | None = None) -> str:
    """The stage's table, wrapped to ``width`` columns (the terminal's when not given)."""
    width = width or terminal_width()
    lines = [f"{stage.name}: {stage.title}  [{result.source}]"
             + (f"  (learner code isolated by {result.isolation})" if result.isolation else "")]
    if result.status == "not started":
        missing = any("does not exist" in r.message for r in result.results)
        lines.append(f"  not started: {result.source}/{stage.module}.py "
                     f"{'does not exist' if missing else 'is as released'}. Open notebooks/{stage.notebook}, "
                     f"fill in its TODOs, then run: {COMMAND} {stage.name}")
        return "\n".join(lines)
    if result.status == "import error":              # one cause, shown once, not once per check
        message = result.results[0].message if result.results else "the file could not be imported"
        body = _wrapped(message, width - 4)
        lines += [f"  {body[0]}"] + [f"    {b}" for b in body[1:]]
        lines.append(f"  none of its {len(result.results)} checks ran: fix that line, then run: "
                     f"{COMMAND} {stage.name}")
        return "\n".join(lines)
    shown = [r for r in result.results if not r.hidden]
    name_w = max([len(r.name) for r in shown] + [5])
    beside = width - name_w - 33 >= _MESSAGE_MIN     # room for the message beside the check, else under it
    lines.append(f"  {'check':<{name_w}}  points  status      time" + ("  message" if beside else ""))
    pad = " " * (name_w + 31) if beside else "      "
    for r in shown:
        pts = f"{r.earned}/{r.points}"
        body = _wrapped(r.message, width - len(pad) - 2)
        row = f"  {r.name:<{name_w}}  {pts:>6}  {_MARK[r.status]:<7}  {_seconds(r):>6}"
        if beside:
            lines.append(f"{row}  {body[0]}".rstrip())
            lines += [f"  {pad}{b}" for b in body[1:]]
        else:
            lines.append(row)
            lines += [f"  {pad}{b}" for b in body if b]
    if hidden_summary(result.results):
        lines.append(f"  {hidden_summary(result.results)}")
    lines.append("  " + score_line(result))
    workers = f" on {result.workers} workers" if result.workers > 1 else ""
    lines.append(f"  {result.seconds:.1f} s{workers}; inputs seed {result.seed} "
                 f"(WORKBOOK_SEED={result.seed} repeats them)")
    return "\n".join(lines)


def score_line(result: StageResult) -> str:
    """Points earned out of the points that can run here; GPU points pending, and other not-run ones, apart."""
    here = [r for r in result.results if r.status != "not run"]
    text = f"score {sum(r.earned for r in here)}/{sum(r.points for r in here)} (the points that run here)"
    gpu = [r for r in result.results if r.status == "not run" and "CUDA GPU" in r.message]
    other = [r for r in result.results if r.status == "not run" and r not in gpu]
    if gpu:
        text += (f"; {sum(r.points for r in gpu)} GPU points pending "
                 f"({', '.join(r.name if not r.hidden else 'hidden' for r in gpu)}: they run on a CUDA GPU)")
    if other:
        text += (f"; {sum(r.points for r in other)} points not run here "
                 f"({', '.join(r.name for r in other)}: see why above)")
    return text


def print_result(stage: Stage, result: StageResult) -> None:
    print(format_result(stage, result))
    sys.stdout.flush()
