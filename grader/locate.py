"""Where in the learner's file an error happened: the kernel's own line, not the launch.

Two shapes of error come back from a Triton kernel:

* in the CPU interpreter, the kernel runs as Python: the traceback holds the kernel's frame in
  the exception that *caused* the one raised at the launch (``InterpreterError ... from e``), so
  the first traceback of the chain is searched before the last;
* compiled for a GPU, a ``CompilationError`` says ``at L:C:`` with L counted from the kernel's
  ``def`` line, and quotes the source up to the failing line: the kernel whose line L is that
  source line is found in the learner's file (parsed, never run), and L becomes a file line.
"""

from __future__ import annotations

import ast
import re

_CHAIN = re.compile(r"\n(?:The above exception was the direct cause of the following exception:|"
                    r"During handling of the above exception, another exception occurred:)\n")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
_COMPILE_AT = re.compile(r"^at (\d+):(\d+):\n")


def frame(tb: str, module: str) -> str:
    """'File ".../stage3_x.py", line 98, in _kernel: <code>' of the innermost learner frame of the root cause."""
    sections = _CHAIN.split(tb)
    for section in sections:
        lines = section.splitlines()
        mine = [i for i, ln in enumerate(lines) if (m := _FRAME.match(ln)) and m.group(1).endswith(f"{module}.py")]
        if mine:
            i = mine[-1]
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.match(lines[i + 1]) else ""
            code = re.sub(r"\s+#[^'\"]*$", "", code)          # the line's trailing comment
            return lines[i].strip() + (f": {code}" if code else "")
    frames = [ln.strip() for ln in tb.splitlines() if (m := _FRAME.match(ln)) and not m.group(1).startswith("<")]
    return frames[-1] if frames else ""        # Python's own machinery ("<frozen importlib._bootstrap>") says nothing


def compile_error(message: str, text: str, filename: str) -> str | None:
    """For a Triton ``CompilationError`` message, a shorter message that names the file line; else None."""
    at = _COMPILE_AT.match(message)
    if not at:
        return None
    rel = int(at.group(1))
    body = message[at.end():].split("\n")
    caret = next((i for i, ln in enumerate(body) if ln.strip() == "^"), None)
    if caret is None or caret == 0:
        return None
    failing, error = body[caret - 1].strip(), "\n".join(body[caret + 1:]).strip()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    lines = text.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            line = node.lineno + rel - 1        # Triton counts from the def line (decorators excluded)
            if 0 < line <= len(lines) and lines[line - 1].strip() == failing:
                return (f"the kernel does not compile: {error or 'see the line'} ({filename} line {line}, "
                        f"in {node.name}: {failing})")
    return None
