"""How the workbook's code depends on itself: the import graph of grader/, kernels/ and solutions/,
read from the source (an import inside a function counts as much as one at the top)."""

import ast

from kernels.loader import ROOT

PACKAGES = ("grader", "kernels", "solutions")
PUBLISHING = "grader.publishing"
CLI = "grader.__main__"      # the command line: it dispatches release, publish and update too


def _modules() -> dict[str, object]:
    """Dotted module name -> its file, for every module of PACKAGES."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of PACKAGES it imports, anywhere in its code."""
    modules = _modules()

    def known(name: str) -> str | None:          # the module a dotted name is, or is in
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in node.names:               # a submodule by name, else a name of the module
                    sub = f"{base}.{alias.name}"
                    deps.add(sub if sub in modules else known(base))
        graph[name] = deps - {None, name}
    return graph


def _grading(name: str) -> bool:
    return name.startswith("grader") and not name.startswith(PUBLISHING) and name != CLI


def test_no_grading_module_imports_publishing():
    """Grading reads what it needs of an edition (grader/edition_info.py, grader/compare.py) and the
    solution-file grammar (kernels/solution_file.py) from modules that publishing imports in turn."""
    graph = import_graph()
    assert any(name.startswith(PUBLISHING) for name in graph) and "grader.grade" in graph
    wrong = sorted(f"{name} imports {dep}" for name, deps in graph.items() if _grading(name)
                   for dep in deps if dep.startswith(PUBLISHING))
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_itself_through_others():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
