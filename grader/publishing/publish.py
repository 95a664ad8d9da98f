"""``python -m grader publish stage2[,stage3] --to DIR``: reference solutions, stage by stage.

Publishing a stage adds to a learner's edition (grader/publishing/bundle.py) what a learner needs to learn
from the reference once the stage is due:

    published/<stage file>           the solution, its markers removed (and the .cu, for stage 4)
    published/stageN.md              the instructor's note (solutions/notes/stageN.md): what the
                                     reference does differently from the simplest correct answer
    published/stageN.holes.json      each hole's reference code and where it sits, for --compare
    notebooks/NN_name.solution.ipynb the stage's notebook with the outputs of a solution run

It refuses, and writes nothing, where the result would give away a stage that is not due: a stage
whose solution holds (as given code) the answers of a stage that is neither published nor shipped
as given code, or anything the edition audit refuses.  A stage beyond the edition's ``--through``
may be published (a worked example, say) as long as it gives nothing else away.

A learner's working copy takes a publication as it takes an update (grader/publishing/update.py):
a file the learner changed keeps its content and the published version is written beside it as
``<name>.new``.  What the learner wrote is theirs: it is neither searched nor a reason to refuse,
though a solved hole holds the answers of its stage.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

from kernels.loader import ROOT
from kernels.solution_file import BEGIN, END, expand_file, label_above, sha, strip_markers

from grader import edition_info, stages
from grader.publishing import edition, release

FOLDER = edition_info.PUBLISHED


class PublishError(RuntimeError):
    pass


def holes(text: str) -> list[dict]:
    """Each solution block of a solution file: its TODO label, the reference code, the lines
    around it that stay in the learner's file (to find the hole there), and its function."""
    lines = text.splitlines()
    owners = _functions(strip_markers(text))
    found, out_line = [], 0       # out_line: line number in the marker-free text
    i = 0
    while i < len(lines):
        if not BEGIN.match(lines[i]):
            out_line += 1
            i += 1
            continue
        j = i + 1
        while not END.match(lines[j]):
            j += 1
        before = [ln for ln in lines[:i] if ln.strip() and not END.match(ln) and not BEGIN.match(ln)]
        after = next((ln for ln in lines[j + 1:] if ln.strip() and not BEGIN.match(ln)), "")
        # The label is the TODO right above the block (up to a blank line), as release names its stub: a
        # solution-only block such as a __main__ has none, and is no hole, whatever TODO came before it.
        label = label_above(lines[:i]) or ""
        block = lines[i + 1:j]
        if any(ln.strip() for ln in block) and label:
            found.append({"todo": label, "reference": "\n".join(block), "before": before[-2:], "after": after,
                          "function": owners.get(out_line + 1, "")})
        out_line += len(block)
        i = j + 1
    return found


def _functions(text: str) -> dict[int, str]:
    """Line number -> the top-level function it is in (for a kernel: the functions that launch it)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return {}
    owner = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for n in range(node.lineno, (node.end_lineno or node.lineno) + 1):
                owner[n] = node.name
    return owner


def files_of(stage) -> dict[str, bytes]:
    """What publishing ``stage`` adds to an edition (relative path -> bytes)."""
    note = ROOT / "solutions" / "notes" / f"{stage.name}.md"
    if not note.is_file():
        raise PublishError(f"{stage.name} has no note at solutions/notes/{stage.name}.md: write what its reference "
                           "does differently from the simplest correct answer, then publish")
    found = {f"{FOLDER}/{stage.name}.md": note.read_bytes()}
    entries = []
    for name in stage.files():
        text = expand_file(ROOT / "solutions" / name)
        found[f"{FOLDER}/{name}"] = strip_markers(text).encode()
        entries += [dict(h, file=name) for h in holes(text)]
    found[f"{FOLDER}/{stage.name}.holes.json"] = (json.dumps(entries, indent=1) + "\n").encode()
    notebook = ROOT / "notebooks" / stage.notebook
    found[f"notebooks/{notebook.stem}.solution.ipynb"] = notebook.read_bytes()
    return found


def publish(dest: str | Path, names: list[str], *, log=print) -> list[str]:
    """Add the reference solutions of ``names`` to the learner's edition in ``dest``."""
    dest = Path(dest).resolve()
    meta = edition_info.read(dest)
    if meta is None or meta.get("kind", "learner") != "learner":
        raise PublishError(f"{dest} holds no learner's edition: make one first with "
                           "python -m grader release --to DIR")
    through = stages.find(meta["through"])
    chosen = [stages.find(n) for n in names]
    keys = edition.answer_keys()
    rendered = release.rendered()
    given = {n for s in stages.STAGES if s.number <= through.number
             for n in edition.answers_in(rendered[f"{s.module}.py"], keys)}
    published = {stages.find(p).number for p in meta.get("published", [])}
    allowed = given | published | {s.number for s in chosen}
    new: dict[str, bytes] = {}
    for stage in chosen:
        solution = strip_markers(expand_file(ROOT / "solutions" / f"{stage.module}.py"))
        reveals = sorted(edition.answers_in(solution, keys) - allowed)
        if reveals:
            raise PublishError(f"{stage.name}'s solution holds, as given code, the answers of "
                               f"{', '.join(f'stage{n}' for n in reveals)}, which this edition has neither "
                               "published nor shipped: publish those too, or first")
        new.update(files_of(stage))
    edition.fill_repository(new, meta.get("repository"))      # the solution notebooks open on Colab too
    contents = dict(as_written(dest, meta), **new)
    problems = edition.audit(contents, allowed, keys)
    if problems:
        raise PublishError("publishing would give away what it must not, so nothing was written:\n  "
                           + "\n  ".join(problems))
    meta = dict(meta, published=sorted({*meta.get("published", []), *(s.name for s in chosen)},
                                       key=lambda n: stages.find(n).number))
    meta["version"] = edition.edition_version(meta.get("base_version", meta["version"]), meta["published"])
    meta.pop("files", None)
    changes = edition.write(dest, new, meta, log=log, remove_missing=False)
    log(f"published {', '.join(s.name for s in chosen)} in {dest} ({len(changes)} file(s) written)")
    return changes


def as_written(dest: Path, meta: dict) -> dict[str, bytes]:
    """The edition's files in ``dest`` that are still as the edition wrote them (and the ``.new`` versions
    beside those a learner changed): what publishing adds to, and what the audit searches.  A file the
    learner changed is their own work, which may well hold the answers of a stage not yet published."""
    recorded = meta.get("files", {})
    return {rel: data for rel, data in edition.on_disk(dest, meta).items()
            if sha(data) == recorded.get(rel.removesuffix(edition_info.NEW))}


def main(stage_names: str, *, to: str) -> int:
    """``python -m grader publish stage2,stage3 --to DIR``: publish those stages into the edition ``to``."""
    try:
        publish(to, stage_names.split(","))
    except (PublishError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0
