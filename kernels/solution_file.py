"""The grammar of a solution file, and the one place that reads it.

A solution file (``solutions/stageN_*.py``, and the ``.cu`` of stage 4) is plain Python (or C++)
that runs as it is.  Release makes the learner's file from it (``stages/``), the grader grades
it, and publishing ships it; all of them read it with the functions of this module.

Holes
-----
The code a learner writes sits between a ``# BEGIN SOLUTION`` line and an ``# END SOLUTION``
line, right under the TODO paragraph that asks for it (``# TODO(3b): ...``), whose label names
the hole.  ``render`` turns each block into the stub its BEGIN line asks for, by default one named
by that label (a label never goes stale, unlike a line number)::

    BEGIN SOLUTION              ->  raise NotImplementedError("stage3_flash_forward.py: TODO(3b) is not written yet")
    BEGIN SOLUTION stub=pass    ->  pass        (inside a @triton.jit kernel, where raise cannot go)
    BEGIN SOLUTION stub=        ->  (nothing: solution-only code such as a __main__ benchmark)

In a ``.cu`` file the markers are ``// BEGIN SOLUTION`` and ``// END SOLUTION`` and the stub is
empty (C++ has no NotImplementedError: the TODO comments say what to write).

Given code
----------
A stage keeps every feature of the stages before it, so most of its code is an earlier stage's
answer.  A solution file takes it with an ordinary import at the top level, from the ``solutions``
package, marked as given code by the comment ``# given`` on the import's first line::

    from solutions.stage3_flash_forward import LOG2E, LN2, HEAD_DIMS  # given
    from solutions.stage5_causal import _visible, _key_blocks  # given

That is the whole convention: one module per statement (consecutive statements are one block
of given code), each name a top-level function (with its decorators), class or assignment of
that module (or a name it takes as given code itself, though the file that writes it says more).
The import stands where the code goes in the learner's file, below definitions too, and names
every helper that file needs, also those only the given functions call: a linter's "import not
at the top" and "imported but unused" are by design.  Release refuses an import of ``solutions``
without the marker: a learner's file must not import the answers.

Run as it is, the import binds the names of the earlier module; ``expand`` makes the file
self-contained instead: it replaces each block of given imports with the code they name, as the
earlier stage's learner finished it (solution markers dropped, and each hole's TODO paragraph,
so the answers read as given code; a comment inside a solution block stays: it is what a later
stage reads about that code), with the comment lines right above each definition.  Definitions
stand two blank lines apart; constants, one after the other.  Release (the learner's file), the
grader's snapshot, ``kernels.loader``, the wrong solutions and publishing all read the expansion.

For the two to mean the same thing, given code must not depend on a name the importing file
binds otherwise (an import binds a function's globals in the module that defines it; the expanded
copy finds them in the importing file): what differs between stages, such as which kernel a
helper launches, is an argument.  tests/test_solution_file.py checks every given import for it.

Release's record
----------------
``stages/.release.json`` (``MANIFEST``) holds the SHA-256 (``sha``) of each file release wrote;
``is_untouched`` says whether a learner's file is still exactly that, with or without solutions/.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

#: The workbook's folder (as kernels.loader.ROOT, which imports this module).
ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ".release.json"          # in stages/: file name -> SHA-256 of what release wrote

# -- holes ----------------------------------------------------------------------------------------
BEGIN = re.compile(r"^(\s*)(?:#|//) BEGIN SOLUTION(?:\s+stub=(.*))?\s*$")
END = re.compile(r"^\s*(?:#|//) END SOLUTION\s*$")
LABEL = re.compile(r"TODO\(\w+\)")                  # a TODO's label: TODO(1a)
TODO_START = re.compile(r"^\s*# TODO\(")            # the first line of a hole's TODO paragraph
#: A stub that release writes in a Python file.
STUB = re.compile(r"^\s*(raise NotImplementedError\(.*\)|pass)\s*$")
#: A stub's message: "TODO(1a) is not written yet", or "fill in the TODO at line N" as release wrote it
#: before it named the label (a copy released then still has its holes found).
STUB_MESSAGE = re.compile(r'(NotImplementedError\("[^"]*?: )(?:fill in the TODO at line \d+|.*? is not written yet)"')


class SolutionFileError(ValueError):
    """A solution file that does not follow the grammar; the message names the file and the line."""


class MarkerError(SolutionFileError):
    pass


class GivenCodeError(SolutionFileError):
    pass


def is_marker(line: str) -> bool:
    return bool(BEGIN.match(line) or END.match(line))


def label_above(lines: list[str]) -> str | None:
    """The TODO label (``TODO(1a)``) in the lines right above a hole, up to a blank line."""
    for line in reversed(lines):
        if not line.strip():
            return None
        found = LABEL.search(line)
        if found:
            return found.group(0)
    return None


def stub(filename: str, label: str | None) -> str:
    """The line release writes for a hole of a Python file that asks for no stub of its own."""
    return f'raise NotImplementedError("{filename}: {label or "the TODO above"} is not written yet")'


def render(text: str, filename: str) -> str:
    """The learner's version of a solution file (expanded first: see ``expand``)."""
    out: list[str] = []
    inside = False
    start = 0
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        begin, end = BEGIN.match(line), END.match(line)
        if begin:
            if inside:
                raise MarkerError(f"{filename}:{lineno}: BEGIN SOLUTION inside another (opened at line {start})")
            inside, start = True, lineno
            indent, stub_text = begin.group(1), begin.group(2)
            if stub_text is None and filename.endswith(".cu"):
                stub_text = ""
            elif stub_text is None:
                stub_text = stub(filename, label_above(out))
            if stub_text.strip():
                out.append(f"{indent}{stub_text.strip()}\n")
        elif end:
            if not inside:
                raise MarkerError(f"{filename}:{lineno}: END SOLUTION without a BEGIN")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{filename}:{start}: BEGIN SOLUTION is never closed")
    return "".join(out)


def strip_markers(text: str) -> str:
    """A solution file as a reader of the reference sees it: the code of every hole, no markers."""
    return "".join(line for line in text.splitlines(keepends=True) if not is_marker(line))


def solution_blocks(text: str) -> list[list[str]]:
    """The code between the solution markers of a solution file, block by block."""
    found, current = [], None
    for line in text.splitlines():
        if BEGIN.match(line):
            current = []
        elif END.match(line):
            found.append(current or [])
            current = None
        elif current is not None:
            current.append(line)
    return found


def as_given(text: str) -> str:
    """A solution's code as given code: no solution markers, no TODO paragraph above a block."""
    lines = text.splitlines(keepends=True)
    drop = set()
    for i, line in enumerate(lines):
        if is_marker(line):
            drop.add(i)
        if BEGIN.match(line):
            j = i - 1
            while j >= 0 and lines[j].lstrip().startswith("#") and not TODO_START.match(lines[j]):
                j -= 1
            if j >= 0 and TODO_START.match(lines[j]):
                drop.update(range(j, i))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


# -- given code -----------------------------------------------------------------------------------
PACKAGE = "solutions"
GIVEN = re.compile(r"^# given\b")                   # the marker comment, on the import's first line
_GIVEN_LINE = re.compile(rf"^[ \t]*from[ \t]+(?:{PACKAGE}\b|\.)[\w.]*[ \t]+import\b[^#\n]*# given\b", re.M)


@dataclass(frozen=True)
class GivenImport:
    first: int              # its lines, 1-based, inclusive
    last: int
    module: str             # the earlier file's module name: "stage5_causal"
    names: tuple[str, ...]


def has_given_code(text: str) -> bool:
    """Whether ``text`` takes given code (then ``expand`` makes it self-contained, or says why it cannot)."""
    return bool(_GIVEN_LINE.search(text))


def _comments(text: str) -> dict[int, str]:
    """Line number -> the comment on that line (comments only, never text in a string)."""
    try:
        return {tok.start[0]: tok.string for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                if tok.type == tokenize.COMMENT}
    except (tokenize.TokenError, SyntaxError):
        return {}


def _parse(text: str, filename: str) -> ast.Module:
    try:
        return ast.parse(text, filename)
    except SyntaxError as exc:
        raise GivenCodeError(f"{filename}:{exc.lineno}: cannot read its given code: {exc.msg}") from None


def given_imports(text: str, filename: str) -> list[GivenImport]:
    """The given-code imports of a file, in order.  One that is marked but is not an import by name
    from a file of solutions/, at the top level, is an error."""
    if not has_given_code(text):
        return []
    tree = _parse(text, filename)
    comments = _comments(text)
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and GIVEN.match(comments.get(node.lineno, ""))):
            continue
        where, parts = f"{filename}:{node.lineno}", (node.module or "").split(".")
        if node.level or len(parts) != 2 or parts[0] != PACKAGE or id(node) not in top:
            raise GivenCodeError(f"{where}: given code is imported at the top level, by name, from a file of "
                                 f"{PACKAGE}/: from {PACKAGE}.stage5_causal import _visible  # given")
        aliased = [a.name for a in node.names if a.asname or a.name == "*"]
        if aliased:
            raise GivenCodeError(f"{where}: given {parts[1]}.{aliased[0]}: given code keeps its name (no 'as', "
                                 "no '*')")
        found.append(GivenImport(node.lineno, node.end_lineno or node.lineno, parts[1],
                                 tuple(a.name for a in node.names)))
    return sorted(found, key=lambda g: g.first)


def check_self_contained(text: str, filename: str) -> None:
    """Refuse a learner's file (an expansion) that still imports the solutions: an import of them that
    is not marked as given code."""
    if not re.search(rf"^[ \t]*(?:from|import)[ \t]+(?:{PACKAGE}\b|\.)", text, re.M):
        return
    for node in ast.walk(_parse(text, filename)):
        modules = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                   ["." * node.level + (node.module or "")] if isinstance(node, ast.ImportFrom) else [])
        for module in modules:
            if module.startswith(".") or module.split(".")[0] == PACKAGE:
                raise GivenCodeError(f"{filename}:{node.lineno}: import of {module}: a learner's file must not "
                                     f"import the solutions; mark given code as such: from {PACKAGE}."
                                     "stage5_causal import _visible  # given")


def definitions(text: str, filename: str) -> dict[str, str]:
    """Top-level name -> its source (decorators and the comment lines right above it included)."""
    lines = text.splitlines(keepends=True)
    tree = _parse(text, filename)
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        else:
            continue
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
        while start > 0 and lines[start - 1].startswith("#"):
            start -= 1
        for name in names:
            found[name] = "".join(lines[start:node.end_lineno])
    return found


def _join(pieces: list[str]) -> str:
    """Given definitions one after another: two blank lines apart, or none between two one-line
    constants."""
    chunk, last = "", ""
    for piece in pieces:
        if chunk:
            tight = "\n" not in last.rstrip("\n") and "\n" not in piece.rstrip("\n")
            chunk = chunk.rstrip("\n") + ("\n" if tight else "\n\n\n")
        chunk, last = chunk + piece, piece
    return chunk


def expand(text: str, filename: str, read: Callable[[str], str | None], *, _stack: tuple[str, ...] = ()) -> str:
    """``text`` (of the file ``filename``) with every block of given imports replaced by the code it names.

    ``read(module)`` returns the text of ``module``.py beside the file, or None where there is none.
    An earlier file's own given code is expanded first, so a name may come from any earlier stage.
    """
    imports = given_imports(text, filename)
    if not imports:
        return text
    stack = _stack + (filename,)
    cache: dict[str, dict[str, str]] = {}

    def piece(given: GivenImport, name: str) -> str:
        source = f"{given.module}.py"
        where = f"{filename}:{given.first}: given {given.module}.{name}"
        if given.module not in cache:
            if source in stack:
                raise GivenCodeError(f"{where}: a cycle, " + " -> ".join(stack + (source,)))
            earlier = read(given.module)
            if earlier is None:
                raise GivenCodeError(f"{where}: there is no {source} beside {filename}")
            cache[given.module] = definitions(as_given(expand(earlier, source, read, _stack=stack)), source)
        if name not in cache[given.module]:
            raise GivenCodeError(f"{where}: {source} has no top-level {name}")
        return cache[given.module][name]

    blocks: list[list[GivenImport]] = []            # consecutive statements: one block
    for given in imports:
        if blocks and blocks[-1][-1].last + 1 == given.first:
            blocks[-1].append(given)
        else:
            blocks.append([given])
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    at = 0
    for block in blocks:
        out += lines[at:block[0].first - 1]
        chunk = _join([piece(given, name) for given in block for name in given.names])
        first = next((ln for ln in chunk.splitlines() if not ln.startswith("#")), "")
        if out and out[-1].strip() and not out[-1].startswith("#") and first.startswith(("@", "def ", "class ")):
            chunk = "\n\n" + chunk          # a definition right after another one: two blank lines
        out.append(chunk if chunk.endswith("\n") else chunk + "\n")
        at = block[-1].last
    return "".join(out + lines[at:])


def expand_file(path: str | Path) -> str:
    """A solution file's text with its given code expanded from the files beside it."""
    path = Path(path)

    def read(module: str) -> str | None:
        other = path.parent / f"{module}.py"
        return other.read_text() if other.is_file() else None

    return expand(path.read_text(), path.name, read)


def _without_docstring(text: str) -> list[str]:
    lines = text.splitlines()
    body = ast.parse(text).body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        return lines[body[0].end_lineno:]
    return lines


def feature_diff(earlier: str | Path, later: str | Path) -> list[str]:
    """What ``later`` adds to ``earlier``: a unified diff of the two solution files expanded, as given
    code (no solution markers, no TODO paragraphs) and without their module docstrings, which
    introduce each stage as a whole."""
    import difflib
    a, b = (_without_docstring(as_given(expand_file(p))) for p in (earlier, later))
    return list(difflib.unified_diff(a, b, str(earlier), str(later), lineterm="", n=1))


# -- release's record -----------------------------------------------------------------------------
def sha(data: str | bytes) -> str:
    """The SHA-256 of a file's text or bytes, as release and editions record it."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def manifest_text(manifest: dict[str, str]) -> str:
    """stages/.release.json: file name -> SHA-256 of what release wrote."""
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def stage_files(solutions: Path) -> list[Path]:
    """The solution files release makes a learner's file of (plain files only, never through a link)."""
    from grader.isolation import files
    return sorted(p for p in solutions.iterdir() if p.name.startswith("stage") and p.suffix in (".py", ".cu")
                  and files.plain_file(p))


def learner_text(source: Path) -> str:
    """What release writes for the solution file ``source``: expanded, then rendered."""
    text = render(expand_file(source), source.name)
    check_self_contained(text, source.name)
    return text


def is_untouched(path: Path, solutions: Path | None = None) -> bool:
    """True when a learner file is exactly what release generates (the learner has not started).

    Without ``solutions/`` (a learner's bundle, an autograder), what release wrote is known from
    ``stages/.release.json``.  Compared as bytes: a file in any encoding, or none, is just edited.
    A file that is not a plain one (a link, a FIFO) is never untouched, and is not read through.
    """
    from grader.isolation import files  # the grader's safe reads (this module is the loader's too, in the worker)
    solutions = solutions or ROOT / "solutions"
    try:
        current = files.read_plain(path)
    except files.UnsafeFile:
        return False
    if current is None:
        return False
    if not solutions.is_dir():
        manifest = ROOT / "stages" / MANIFEST
        recorded = json.loads(manifest.read_text()).get(path.name) if manifest.exists() else None
        return recorded is not None and sha(current) == recorded
    source = solutions / path.name               # render this one file: every stage's takes seconds
    if source not in stage_files(solutions):
        return False
    return current == learner_text(source).encode()


if __name__ == "__main__":
    # python -m kernels.solution_file solutions/stage7_sliding_window.py     the file, given code expanded
    # python -m kernels.solution_file --diff solutions/stage6_gqa.py solutions/stage7_sliding_window.py
    import sys

    if sys.argv[1:2] == ["--diff"]:
        if len(sys.argv) != 4:
            sys.exit("usage: python -m kernels.solution_file --diff EARLIER.py LATER.py")
        print("\n".join(feature_diff(sys.argv[2], sys.argv[3])))
    else:
        for arg in sys.argv[1:]:
            sys.stdout.write(expand_file(arg))
