"""The package's shape (docs/architecture.md): no import circle between its modules (imports
inside functions and ``TYPE_CHECKING`` blocks included: a circle hidden in a function is still a
circle) and no product module over 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lens_evals"
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                # `from X import a`: the module X.a if there is one, else the module X
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_checker_finds_a_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 50 and graph["lens_evals.engine.worker.state"], "the import graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_module_over_400_lines() -> None:
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
