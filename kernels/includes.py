"""Given code from an earlier stage: the ``# include:`` line of a solution file.

A stage keeps every feature of the stages before it, so most of its code is an earlier stage's
answer.  Rather than copy it, a solution file names what it takes, on a line of its own at the
top level::

    # include: stage5_causal._attend_blocks, stage5_causal._key_blocks, stage3_flash_forward.LN2

Each name is a top-level function (with its decorators) or an assignment of the file
``stage5_causal.py`` beside the including one, together with the comment lines right above it.
``expand`` replaces the line with that code as the earlier stage's learner finished it: the
solution markers are dropped and so is each hole's TODO paragraph, so the answers read as given
code.  (A comment inside a solution block stays: it is what a later stage reads about that code.)
An included file's own includes are expanded first, so a name may come from any earlier stage.

Everything that runs or ships a solution file expands it: release (the learner's stage file),
the grader's snapshot, ``kernels.loader``, the wrong solutions and publishing.  A name that is
not there, a file that is not there or a cycle is an ``IncludeError`` naming the file, the line
and the name.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path
from typing import Callable

MARKER = re.compile(r"^# include:(.*)$")
_NAME = re.compile(r"^([A-Za-z_]\w*)\.([A-Za-z_]\w*)$")
_BEGIN = re.compile(r"^\s*(?:#|//) BEGIN SOLUTION\b")
_END = re.compile(r"^\s*(?:#|//) END SOLUTION\s*$")
_TODO = re.compile(r"^\s*# TODO\(")


class IncludeError(ValueError):
    pass


def has_includes(text: str) -> bool:
    return any(MARKER.match(line) for line in text.splitlines())


def _marker_lines(text: str) -> set[int]:
    """The 1-based numbers of the include lines: comments at the top level, not text in a string."""
    found = {i for i, line in enumerate(text.splitlines(), 1) if MARKER.match(line)}
    try:
        comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline)
                    if tok.type == tokenize.COMMENT and tok.start[1] == 0}
    except (tokenize.TokenError, SyntaxError):
        return found
    return found & comments


def given(text: str) -> str:
    """A solution's code as given code: no solution markers, no TODO paragraph above a block."""
    lines = text.splitlines(keepends=True)
    drop = set()
    for i, line in enumerate(lines):
        if _BEGIN.match(line) or _END.match(line):
            drop.add(i)
        if _BEGIN.match(line):
            j = i - 1
            while j >= 0 and lines[j].lstrip().startswith("#") and not _TODO.match(lines[j]):
                j -= 1
            if j >= 0 and _TODO.match(lines[j]):
                drop.update(range(j, i))
    return "".join(line for i, line in enumerate(lines) if i not in drop)


def definitions(text: str, filename: str) -> dict[str, str]:
    """Top-level name -> its source (decorators and the comment lines right above it included)."""
    lines = text.splitlines(keepends=True)
    try:
        tree = ast.parse(text, filename)
    except SyntaxError as exc:
        raise IncludeError(f"{filename}:{exc.lineno}: cannot include from it: {exc.msg}") from None
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
        while start > 0 and lines[start - 1].startswith("#") and not MARKER.match(lines[start - 1]):
            start -= 1
        for name in names:
            found[name] = "".join(lines[start:node.end_lineno])
    return found


def expand(text: str, filename: str, read: Callable[[str], str | None], *, _stack: tuple[str, ...] = ()) -> str:
    """``text`` (of the file ``filename``) with every include line replaced by the code it names.

    ``read(module)`` returns the text of ``module``.py beside the file, or None where there is none.
    """
    if not has_includes(text):
        return text
    stack = _stack + (filename,)
    cache: dict[str, dict[str, str]] = {}
    markers = _marker_lines(text)
    out = []
    for lineno, line in enumerate(text.splitlines(keepends=True), 1):
        marker = MARKER.match(line) if lineno in markers else None
        if not marker:
            out.append(line)
            continue
        where = f"{filename}:{lineno}"
        pieces = []
        for item in filter(None, (s.strip() for s in marker.group(1).split(","))):
            m = _NAME.match(item)
            if not m:
                raise IncludeError(f"{where}: include {item!r}: expected module.name, like stage5_causal._key_blocks")
            module, name = m.groups()
            source = f"{module}.py"
            if module not in cache:
                if source in stack:
                    raise IncludeError(f"{where}: include {item}: a cycle, " + " -> ".join(stack + (source,)))
                included = read(module)
                if included is None:
                    raise IncludeError(f"{where}: include {item}: there is no {source} beside {filename}")
                cache[module] = definitions(given(expand(included, source, read, _stack=stack)), source)
            if name not in cache[module]:
                raise IncludeError(f"{where}: include {item}: {source} has no top-level {name}")
            pieces.append(cache[module][name])
        # Functions stand two blank lines apart; constants, one after the other.
        chunk, last = "", ""
        for piece in pieces:
            if chunk:
                tight = "\n" not in last.rstrip("\n") and "\n" not in piece.rstrip("\n")
                chunk = chunk.rstrip("\n") + ("\n" if tight else "\n\n\n")
            chunk, last = chunk + piece, piece
        first = next((ln for ln in chunk.splitlines() if not ln.startswith("#")), "")
        if out and out[-1].strip() and not out[-1].startswith("#") and first.startswith(("@", "def ", "class ")):
            chunk = "\n\n" + chunk          # a definition right after another one: two blank lines
        out.append(chunk if chunk.endswith("\n") else chunk + "\n")
    return "".join(out)


def expand_file(path: str | Path) -> str:
    """A solution file's text with its includes expanded from the files beside it."""
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
    a, b = (_without_docstring(given(expand_file(p))) for p in (earlier, later))
    return list(difflib.unified_diff(a, b, str(earlier), str(later), lineterm="", n=1))


if __name__ == "__main__":
    # python -m kernels.includes solutions/stage7_sliding_window.py     the file, includes expanded
    # python -m kernels.includes --diff solutions/stage6_gqa.py solutions/stage7_sliding_window.py
    import sys

    if sys.argv[1:2] == ["--diff"]:
        if len(sys.argv) != 4:
            sys.exit("usage: python -m kernels.includes --diff EARLIER.py LATER.py")
        print("\n".join(feature_diff(sys.argv[2], sys.argv[3])))
    else:
        for arg in sys.argv[1:]:
            sys.stdout.write(expand_file(arg))
