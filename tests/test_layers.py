"""The package's import graph has no circle: lower layers never import upward.

Every import counts, at module level, inside functions and under ``TYPE_CHECKING``: a lazy import
saves start-up time, it does not make a loop acceptable. Read from the source with ``ast``, so
nothing is imported and nothing depends on the order modules happen to load in.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "lifeguard"


def _modules() -> dict[str, Path]:
    modules = {}
    # A compiled module is known by its stub (lifeguard/_ears.pyi): it imports nothing.
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyi")]:
        if path.suffix == ".pyi" and path.with_suffix(".py").exists():
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that ``name`` (a module, or a module's attribute) lives in."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported package module: first line}."""
    modules = _modules()
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                # `from a import b` imports a.b if it is a module, else an attribute of a.
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                found = _resolve(target, modules)
                if found is not None and found != name:
                    graph[name].setdefault(found, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circle() -> None:
    graph = import_graph()
    loops = circles(graph)
    described = [
        "\n".join(f"  {a} -> {b} (line {graph[a][b]})" for a in loop for b in graph[a] if b in loop)
        for loop in loops
    ]
    assert not loops, "import circles:\n" + "\n\n".join(described)


def test_the_circle_check_sees_a_circle() -> None:
    """The check itself: a loop through a function-level import is found."""
    graph = {"a": {"b": 1}, "b": {"c": 3}, "c": {"a": 7}, "d": {"a": 2}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b": 1}, "b": {}}) == []


def test_the_graph_counts_imports_inside_functions_and_under_type_checking() -> None:
    graph = import_graph()
    # lifecycle imports the channel's type only under TYPE_CHECKING; the plan imports
    # the journal inside functions: both are edges.
    assert "lifeguard.channel" in graph["lifeguard.lifecycle"]
    assert "lifeguard.journal" in graph["lifeguard.backends.mlflow.plan"]
