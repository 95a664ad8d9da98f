"""``python -m grader stage3 --compare``: your code beside the reference, hole by hole.

It works in a learner's edition once the instructor has published the stage
(``published/stageN.holes.json``, which grader/publishing/publish.py writes): after the grading
table, each TODO shows what you wrote there, what the reference wrote, and the checks that
exercise it with their statuses.  Before publication it says so.
"""

from __future__ import annotations

import ast
import json
import textwrap
from pathlib import Path

from kernels.loader import ROOT

from grader.edition_info import PUBLISHED
from grader.isolation import files


def callers(text: str) -> dict[str, set[str]]:
    """Top-level function -> the public functions that call it, directly or through others."""
    tree = ast.parse(text)
    calls = {node.name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
             for node in tree.body if isinstance(node, ast.FunctionDef)}
    reach: dict[str, set[str]] = {}
    for public in (name for name in calls if not name.startswith("_")):
        seen, todo = set(), [public]
        while todo:
            fn = todo.pop()
            if fn in seen or fn not in calls:
                continue
            seen.add(fn)
            todo.extend(calls[fn])
        for fn in seen:
            reach.setdefault(fn, set()).add(public)
    return reach


def _your_code(lines: list[str], label: str, after: str) -> list[str] | None:
    """The lines a learner wrote for the hole labelled ``label``: after its TODO comment, up to the
    line that follows the hole in the released file."""
    for i, line in enumerate(lines):
        stripped = line.strip()
        if label in line and stripped.startswith(("#", "//")):
            j = i + 1
            while j < len(lines) and lines[j].strip().startswith(("#", "//")):
                j += 1
            for k in range(j, min(len(lines), j + 400)):
                if after and lines[k].strip() == after.strip():
                    while k > j and not lines[k - 1].strip():
                        k -= 1
                    return lines[j:k]
            return None
    return None


def _box(title: str, lines: list[str]) -> list[str]:
    body = textwrap.dedent("\n".join(lines)).splitlines() or ["(nothing)"]
    return [f"    {title}"] + [f"      | {ln}" for ln in body]


def compare(stage, result, folder: Path, *, root: Path = ROOT) -> str:
    """The hole-by-hole comparison for ``stage``, graded as ``result`` from ``folder``."""
    holes_path = root / PUBLISHED / f"{stage.name}.holes.json"
    if not holes_path.is_file():
        return (f"{stage.name}'s reference solution is not published yet: your instructor publishes it once the "
                "stage is due, and then --compare shows it beside your code.")
    entries = json.loads(holes_path.read_text())
    public_callers: dict[str, set[str]] = {}
    for name in {e["file"] for e in entries if e["file"].endswith(".py")}:
        public_callers.update(callers((root / PUBLISHED / name).read_text()))
    out = [f"{stage.name}: your code beside the reference (published/{stage.module}.py; the note: "
           f"published/{stage.name}.md)"]
    for entry in entries:
        try:
            data = files.read_plain(Path(folder) / entry["file"])
        except files.UnsafeFile as exc:
            data, why = None, str(exc)
        else:
            why = f"{entry['file']} is not in {folder}"
        label, fn = entry["todo"], entry["function"]
        reach = public_callers.get(fn, set()) | ({fn} if fn and not fn.startswith("_") else set())
        touching = [r for r in result.results if not r.hidden
                    and (label in r.message or reach & set(getattr(r, "calls", []) or []))]
        checks = ", ".join(f"{r.name} {r.status}" for r in touching) or "no check reached it"
        where = f" in {fn}" if fn else ""
        out.append("")
        out.append(f"  {label}{where}  [{entry['file']}]  checks: {checks}")
        if data is None:
            out.append(f"    (your file: {why})")
            yours = None
        else:
            yours = _your_code(data.decode(errors="replace").splitlines(), label, entry["after"])
        out += _box("yours:", yours) if yours is not None else (
            ["    yours: (could not find this hole in your file: its TODO comment or the line after it changed)"]
            if data is not None else [])
        out += _box("reference:", entry["reference"].splitlines())
    return "\n".join(out)
