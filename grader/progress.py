"""``python -m grader`` with no stage: one line per stage, grading the ones you have started."""

from __future__ import annotations

from grader import stages
from grader.grade import format_result, grade_stage
from kernels import runtime


def progress(source: str = "stages") -> int:
    from grader import edition
    print(f"Flash Attention Workbook: progress ({source}/) on {runtime.describe()}", flush=True)
    print(f"{edition.describe()}\n", flush=True)
    rows, details, ok = [], [], True
    for stage in stages.STAGES:
        result = grade_stage(stage, source)
        if result.status == "not started":
            state = "not started"
        elif result.status == "import error":
            state, ok = "does not import", False
            details.append(format_result(stage, result))
        else:
            not_run = sum(r.status == "not run" for r in result.results)
            state = f"{result.score}/{result.max_score} points"
            state += f" ({not_run} GPU-only not run)" if not_run else ""
            if not result.ok:
                ok = False
                details.append(format_result(stage, result))
            else:
                state += "  done"
        rows.append((stage, state))
    for stage, state in rows:
        print(f"  {stage.name:<7} {stage.title:<66} {state}")
    if details:
        print("\n" + "\n\n".join(details))
    print("\nnext: open the first stage that is not done in notebooks/ and run python -m grader stageN")
    return 0 if ok else 1
