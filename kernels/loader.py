"""The one way tests, notebooks and the grader reach stage code.

``load_stage("stage3")`` returns the learner's ``stages/stage3_flash_forward.py`` as a
module.  Which copy is loaded is chosen by ``source``, else by the environment variable
``WORKBOOK_SOURCE``:

    stages       the learner's files (the default)
    solutions    the instructor's reference solutions
    <a folder>   any folder shaped like stages/ (a submission to grade)

Modules are loaded from their file path under a name of their own, so a learner's stage 3
and the solution's stage 3 can both be loaded in one process without clashing.  A package of
the instructors' (``solutions/attention_op/``) is imported by ``load_package`` instead, once per
process, under the dotted name of its folder.  A solution file that takes given code from an
earlier stage runs expanded (kernels/solution_file.py), as the learner's file and the grader's
snapshot do: the code it runs, tracebacks and Triton's view of its kernels all come from the
expanded text.  (Imported as ``solutions.stage6_gqa``, the same file runs as the plain Python it
is, and means the same.)
"""

from __future__ import annotations

import hashlib
import importlib.util
import linecache
import os
import re
import sys
from pathlib import Path
from types import ModuleType

from kernels import solution_file

ROOT = Path(__file__).resolve().parent.parent
ENV_VAR = "WORKBOOK_SOURCE"
_STAGE = re.compile(r"^stage(\d+)")


def source_dir(source: str | os.PathLike | None = None) -> Path:
    """The folder stage files are loaded from."""
    source = source if source is not None else os.environ.get(ENV_VAR, "stages")
    if str(source) in ("stages", "solutions"):
        return ROOT / str(source)
    path = Path(source).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(f"{ENV_VAR}/source {str(source)!r} is neither 'stages', 'solutions' nor a folder")
    return path


def stage_path(name: str, source: str | os.PathLike | None = None) -> Path:
    """The file of stage ``name`` ('stage3', '3' or 'stage3_flash_forward') in ``source``."""
    folder = source_dir(source)
    m = _STAGE.match(name) or re.match(r"^(\d+)$", name)
    if not m:
        raise ValueError(f"unknown stage {name!r}: expected a name like 'stage3' or 'stage3_flash_forward'")
    number = m.group(1)
    candidates = sorted(p for p in folder.glob(f"stage{number}_*.py"))
    if not candidates:
        raise FileNotFoundError(f"no file for stage {number} (stage{number}_*.py) in {folder}")
    return candidates[0]


def load_stage(name: str, source: str | os.PathLike | None = None) -> ModuleType:
    """Import a stage file and return it as a module (cached per file and content)."""
    return load_file(stage_path(name, source))


def load_file(path: str | os.PathLike) -> ModuleType:
    """Import any workbook file as a module, registered under a name of its own (cached per file
    and content): Triton's compiler looks a kernel's globals up through ``sys.modules``."""
    from kernels import runtime  # (decides TRITON_INTERPRET before the file imports triton)

    path = Path(path)
    data = path.read_bytes()
    given = solution_file.has_given_code(data.decode(errors="replace"))
    expanded = solution_file.expand_file(path) if given else None
    digest = hashlib.sha1(str(path).encode() + (expanded.encode() if expanded else data)).hexdigest()[:12]
    mod_name = f"workbook_{path.parent.name}_{path.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        if expanded is None:
            spec.loader.exec_module(module)
        else:
            _exec_expanded(module, path, expanded)
    except BaseException:
        del sys.modules[mod_name]
        raise
    runtime.quicken_interpreter()
    return module


def load_package(path: str | os.PathLike) -> ModuleType:
    """Import a package folder of the workbook (``solutions/attention_op/``) as the module its place
    under the workbook names (``solutions.attention_op``), from any working directory.

    A package is imported once per process, as Python imports any package: ``import
    solutions.attention_op`` (with the workbook's folder on ``sys.path``) then gets the same module.
    What a package registers when it is imported (torch.library ops, whose names PyTorch takes once
    per process) is registered once, whichever way it was reached first."""
    from kernels import runtime  # (decides TRITON_INTERPRET before the package imports triton)

    path = Path(path).resolve()
    name = ".".join(path.relative_to(ROOT).parts)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py", submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[loaded]
        raise
    runtime.quicken_interpreter()
    return module


def _exec_expanded(module: ModuleType, path: Path, text: str) -> None:
    """Run ``text``, the expansion of ``path``, as the module's code.  Its lines are registered
    under a name of their own, ``path`` + " (expanded)", where inspect (and so Triton, which
    reads a kernel's source) and tracebacks find them."""
    name = f"{path} (expanded)"
    linecache.cache[name] = (len(text), None, text.splitlines(keepends=True), name)
    exec(compile(text, name, "exec"), module.__dict__)
