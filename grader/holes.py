"""Which TODO holes of a learner's stage file are still exactly as release wrote them.

Release turns every ``# BEGIN SOLUTION`` block into a stub (``raise NotImplementedError(...)``,
``pass`` inside a Triton kernel, or nothing in a ``.cu``) under the TODO comment that explains
it.  A hole is *unfilled* while the learner's file still holds, on consecutive lines, the same
TODO comment, the same stub and the same line after it.  The hole is then found wherever it now
is, so the line reported is the current one, however much the learner added above it.

This reads the learner's file as text and parses it with ``ast``; it never runs it, so it is
safe in the grader's own process.  It needs ``solutions/`` (the instructor's copy, and the
grader's own checkout) to know what release wrote; in a learner's copy without it, a hole is a
TODO comment directly followed by a stub that release writes (``raise NotImplementedError`` or
``pass``).

A check that fails while a function it called still reaches an unfilled hole (through the calls
in the learner's file, a wrapper reaching its kernel) is ``todo``, not ``FAIL``: the code it
exercised is not written yet, whatever error that caused.
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

from kernels.loader import ROOT
from kernels.solution_file import BEGIN, END, LABEL, STUB, STUB_MESSAGE, expand_file, render

_COMMENT = re.compile(r"^\s*(#|//)")
_CUDA_USER = "cuda_build"     # a Python function that builds the .cu reaches the .cu's holes


@dataclass(frozen=True)
class Hole:
    label: str          # "TODO(3b)"
    file: str           # "stage3_flash_forward.py"
    line: int           # the TODO comment's first line, in the learner's file as it is now
    function: str       # the top-level function it sits in ("" at module level or in a .cu)

    def describe(self) -> str:
        where = f" in {self.function}" if self.function else ""
        return f"{self.label} at {self.file} line {self.line}{where}"


@dataclass
class Holes:
    """The unfilled holes of one stage, and which learner functions reach which of them."""
    unfilled: list[Hole] = field(default_factory=list)
    reaches: dict[str, set[str]] = field(default_factory=dict)    # function -> functions it may call
    cuda_users: set[str] = field(default_factory=set)             # functions that build the .cu

    def reached_by(self, called) -> list[Hole]:
        """The unfilled holes that a call of any function in ``called`` may run into."""
        called = set(called)
        if not called or not self.unfilled:
            return []
        known = [name for name in called if name in self.reaches]
        if not known:                       # a name the file does not define at top level: be safe
            return list(self.unfilled)
        funcs = set().union(*(self.reaches[name] for name in known))
        out = []
        for hole in self.unfilled:
            if hole.file.endswith(".cu"):
                if funcs & self.cuda_users:
                    out.append(hole)
            elif not hole.function or hole.function in funcs:
                out.append(hole)
        return out


def _signatures(solution: str, released: str) -> list[tuple[str, list[str]]]:
    """(label, the lines of each hole as released: its TODO comment, its stub, the line after).

    The TODO comment above each ``BEGIN SOLUTION`` (and any declaration between the two) survives
    release verbatim; the two lines that follow it in the released text are the stub (in a .cu,
    where the stub is empty, the code after the hole) and the line after that.
    """
    sol, out_lines = solution.splitlines(), released.splitlines()
    out = []
    for i, line in enumerate(sol):
        if not BEGIN.match(line):
            continue
        j = i                      # the lines right above the hole, up to a blank line
        while j > 0 and sol[j - 1].strip() and not END.match(sol[j - 1]):
            j -= 1
        todo = [t for t in range(j, i) if "TODO" in sol[t] and _COMMENT.match(sol[t])]
        if todo:                   # from its TODO comment (a declaration may sit between the two)
            j = todo[-1]
        else:                      # no TODO: the comment right above it, if any
            j = i
            while j > 0 and _COMMENT.match(sol[j - 1]) and not END.match(sol[j - 1]):
                j -= 1
        block = [ln.strip() for ln in sol[j:i]]
        if not block:
            continue                              # solution-only code (a __main__): no TODO, no hole
        at = _find(out_lines, block)
        if at is None:
            continue
        after = [ln.strip() for ln in out_lines[at + len(block):at + len(block) + 2]]
        label = _label(block)
        out.append((label, block + after))
    return out


def _label(lines: list[str]) -> str:
    """The first TODO label (``TODO(1a)``) in ``lines``, else plain "TODO"."""
    return next((m.group(0) for m in map(LABEL.search, lines) if m), "TODO")


def _norm(line: str) -> str:
    """A line as compared: stripped, and a stub's message reduced to the file it names (either form
    of the message matches either, so a copy released before stubs named their label still has its
    holes found)."""
    return STUB_MESSAGE.sub(r'\1#"', line.strip())


def _find(lines: list[str], wanted: list[str]) -> int | None:
    """Index of the first line of ``wanted`` in ``lines`` (compared by ``_norm``), or None."""
    n = len(wanted)
    wanted = [_norm(w) for w in wanted]
    for i in range(len(lines) - n + 1):
        if _norm(lines[i]) == wanted[0] and all(_norm(lines[i + k]) == wanted[k] for k in range(1, n)):
            return i
    return None


def _released(name: str, solutions: Path) -> list[tuple[str, list[str]]] | None:
    path = solutions / name
    if not path.exists():
        return None
    text = expand_file(path)
    return _signatures(text, render(text, name))


def unfilled_in(text: str, name: str, *, solutions: Path | None = None) -> list[tuple[str, int]]:
    """(label, 1-based line) of every hole of file ``name`` that ``text`` still holds as released."""
    solutions = solutions if solutions is not None else ROOT / "solutions"
    lines = text.splitlines()
    released = _released(name, solutions) if solutions.is_dir() else None
    found = []
    if released is not None:
        for label, wanted in released:
            at = _find(lines, wanted)
            if at is not None:
                found.append((label, at + 1))
        return found
    for i, line in enumerate(lines):             # no solutions/: a TODO comment right above a stub
        if "TODO" in line and _COMMENT.match(line):
            j = i
            while j + 1 < len(lines) and _COMMENT.match(lines[j + 1]):
                j += 1
            if j + 1 < len(lines) and STUB.match(lines[j + 1]):
                found.append((_label([line]), i + 1))
    return found


def _call_graph(tree: ast.Module) -> tuple[dict[str, tuple[int, int]], dict[str, set[str]], set[str]]:
    spans, refs, cuda = {}, {}, set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            spans[node.name] = (node.lineno, node.end_lineno or node.lineno)
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            names |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            refs[node.name] = names
            if _CUDA_USER in names:
                cuda.add(node.name)
    # Registrations attach one function to another: ``@op.register_fake`` on a function, or a
    # module-level ``op.register_autograd(backward, setup_context=setup)``. Calling ``op`` then
    # runs them, so ``op`` reaches them.
    for node in tree.body:
        decorated = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for expr in (node.decorator_list if decorated else [node.value] if isinstance(node, ast.Expr) else []):
            target = expr.func if isinstance(expr, ast.Call) else expr
            if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id in spans):
                continue
            attached = {node.name} if decorated else set()
            if isinstance(expr, ast.Call):
                attached |= {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} - {target.value.id}
            refs[target.value.id] |= attached
    reaches = {}
    for name in spans:
        seen, todo = {name}, [name]
        while todo:
            for callee in refs[todo.pop()] & spans.keys():
                if callee not in seen:
                    seen.add(callee)
                    todo.append(callee)
        reaches[name] = seen
    return spans, reaches, cuda


_CACHE: dict[str, Holes] = {}


def find(folder: Path, stage) -> Holes:
    """The unfilled holes of ``stage``'s files in ``folder`` (a learner's stages/, a snapshot, a submission)."""
    folder = Path(folder)
    texts = {name: (folder / name).read_text() for name in stage.files() if (folder / name).exists()}
    key = hashlib.sha256(repr(sorted(texts.items())).encode()).hexdigest()
    if key in _CACHE:
        return _CACHE[key]
    holes = Holes()
    py = f"{stage.module}.py"
    spans: dict[str, tuple[int, int]] = {}
    if py in texts:
        try:
            spans, holes.reaches, holes.cuda_users = _call_graph(ast.parse(texts[py]))
        except SyntaxError:
            pass                      # the import error says it; every hole then counts for every call
    for name, text in texts.items():
        for label, line in unfilled_in(text, name):
            function = ""
            if name == py:
                function = next((f for f, (a, b) in spans.items() if a <= line <= b), "")
            holes.unfilled.append(Hole(label, name, line, function))
    _CACHE[key] = holes
    return holes


def todo_message(holes: list[Hole]) -> str:
    """What a learner reads for a check whose code still has holes: which, and where now."""
    first, rest = holes[0], holes[1:]
    text = f"not written yet: {first.describe()} is still as released"
    if rest:
        text += "; also " + ", ".join(f"{h.label} (line {h.line})" for h in rest[:4])
        text += f" and {len(rest) - 4} more" if len(rest) > 4 else ""
    return text
