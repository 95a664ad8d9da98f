"""The worker's code is the isolation package: it imports nothing of the workbook that its sandbox does not show.

Inside bubblewrap the worker's file system holds, of the workbook, only what ``View.workbook_paths``
names: ``grader/isolation/`` whole, ``grader/__init__.py`` and ``kernels/`` without the reference.
An import of any other grader module from the worker's side would work on your machine and fail
in every sandboxed grading, so the imports are followed here, from the worker's entry module, at
every depth of the code (an import inside a function counts: it runs when that function does).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from kernels.loader import ROOT

from grader.isolation.view import View

CHILD = "grader.isolation.child"
WORKBOOK = ("grader", "kernels")               # the workbook's own top-level packages
THIRD_PARTY = {"torch", "numpy", "triton"}     # what the worker may import besides the standard library


def _file(module: str) -> Path | None:
    """The workbook file of ``module`` (a package's __init__.py), or None where it is not one."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(module: str, path: Path) -> set[str]:
    """Every module ``path`` (the file of ``module``) imports, as absolute names, with the packages
    each one's import runs first (``a.b.c`` imports ``a`` and ``a.b``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if _file(f"{base}.{alias.name}"))
    return {".".join(name.split(".")[:i]) for name in found for i in range(1, name.count(".") + 2)} - {"__future__"}


def _closure(start: str) -> tuple[dict[str, Path], set[str]]:
    """The workbook modules ``start`` imports at any depth (name -> file), and the other top-level
    modules they import."""
    workbook: dict[str, Path] = {}
    others: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in workbook:
            continue
        path = _file(name)
        assert path is not None, f"{name} is imported by the worker and is not a file of the workbook"
        workbook[name] = path
        for imported in _imported(name, path):
            if imported.split(".")[0] in WORKBOOK:
                todo.append(imported)
            else:
                others.add(imported.split(".")[0])
    return workbook, others


def _shown(path: Path) -> bool:
    return any(path == shown or shown in path.parents for shown in View(gpu=False).workbook_paths())


def test_the_worker_imports_only_what_its_sandbox_shows():
    workbook, others = _closure(CHILD)
    assert {"grader.isolation.guard", "grader.isolation.harness", "grader.isolation.seccomp",
            "kernels.loader"} <= set(workbook), sorted(workbook)           # the walk does reach them
    hidden = sorted(name for name, path in workbook.items() if not _shown(path))
    assert not hidden, f"the worker imports modules its sandbox does not show: {hidden}"
    strangers = sorted(others - set(sys.stdlib_module_names) - THIRD_PARTY)
    assert not strangers, f"the worker imports modules that are neither the standard library nor {THIRD_PARTY}: " \
                          f"{strangers}"


def test_the_packages_the_worker_passes_through_import_nothing():
    """``import grader.isolation.child`` runs grader/__init__.py and grader/isolation/__init__.py first:
    neither may pull in the grader's own side."""
    for name in ("grader", "grader.isolation"):
        assert _imported(name, _file(name)) == set(), name


def test_the_answer_keys_are_not_in_the_worker_s_view():
    paths = View(gpu=False).workbook_paths()
    assert ROOT / "kernels" / "reference.py" not in paths
    assert all(_shown(path) for path in paths)
    for key in ("solutions", "tests", "grader/checks", "grader/grade.py", "kernels/reference.py"):
        assert not _shown(ROOT / key), key


def test_notebooks_of_earlier_editions_still_find_the_harness():
    from grader import harness
    from grader.isolation import harness as moved
    assert harness is moved and callable(harness.peak_memory)
