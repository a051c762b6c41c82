"""The package's shape (docs/architecture.md): no import circle between its modules (imports
inside functions and ``TYPE_CHECKING`` blocks included: a circle hidden in a function is still a
circle), no product module over 400 lines, the engine's process sides kept apart (the frontend
never imports the worker, nor the worker the frontend; ``transport`` imports neither; ``compat``
none of the three) and vLLM imported only through ``engine/compat`` (but its public request API,
and the listed exceptions)."""

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
    assert len(graph) > 50 and graph[f"{ENGINE}.worker.state"], "the import graph was not read"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# package -> the packages it must not import (its modules, in functions and TYPE_CHECKING too)
ENGINE = "lens_evals.engine"
APART = {
    f"{ENGINE}.frontend": (f"{ENGINE}.worker",),
    f"{ENGINE}.worker": (f"{ENGINE}.frontend",),
    f"{ENGINE}.transport": (f"{ENGINE}.frontend", f"{ENGINE}.worker"),
    f"{ENGINE}.compat": (f"{ENGINE}.frontend", f"{ENGINE}.worker", f"{ENGINE}.transport"),
}
# vLLM's public request API, which the package's callers use as any vLLM user does
VLLM_PUBLIC = {("vllm", "LLM"), ("vllm", "SamplingParams"), ("vllm.lora.request", "LoRARequest"), ("vllm.inputs", "TokensPrompt")}
# modules outside compat that import vLLM internals, and why
VLLM_EXCEPTIONS = {
    # the benchmark runs nnsight's own vLLM integration (its worker classes), not ours
    "benchmarks.nnsight_vllm": "nnsight's vLLM worker classes"
}


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def crossings(graph: dict[str, set[str]], apart: dict[str, tuple[str, ...]]) -> list[str]:
    """``a -> b`` for every import of a module ``b`` of a package that ``a``'s package must not import."""
    return sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for package, banned in apart.items()
        if within(name, package)
        for target in targets
        if any(within(target, other) for other in banned)
    )


def test_the_checker_finds_a_crossing() -> None:
    graph = {"e.front.a": {"e.worker.b", "e.moved"}, "e.worker.b": {"e.worker"}, "e.worker": set(), "e.moved": set()}
    assert crossings(graph, {"e.front": ("e.worker",)}) == ["e.front.a -> e.worker.b"]
    assert crossings(graph, {"e.worker": ("e.front",)}) == []


def test_the_engine_sides_import_each_other_only_through_transport() -> None:
    graph = import_graph()
    assert graph[f"{ENGINE}.frontend.admit"] and graph[f"{ENGINE}.worker.state"], "the import graph was not read"
    found = crossings(graph, APART)
    assert not found, "imports across the engine's sides (move what both need to engine/transport/):\n" + "\n".join(found)


def vllm_imports(source: str) -> set[tuple[str, str]]:
    """(vLLM module, name) of every import of vLLM in ``source`` (name "*" for ``import vllm.x``)."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {(alias.name, "*") for alias in node.names if within(alias.name, "vllm")}
        elif isinstance(node, ast.ImportFrom) and not node.level and within(node.module or "", "vllm"):
            found |= {(node.module or "", alias.name) for alias in node.names}
    return found


def vllm_outside_compat(sources: dict[str, str]) -> list[str]:
    """Modules outside engine/compat that import vLLM beyond its public API and are not excepted."""
    return sorted(
        f"{name}: from {module} import {imported}"
        for name, source in sources.items()
        if not within(name, f"{ENGINE}.compat") and name not in VLLM_EXCEPTIONS
        for module, imported in vllm_imports(source)
        if (module, imported) not in VLLM_PUBLIC
    )


def test_the_checker_finds_vllm_outside_compat() -> None:
    sources = {
        f"{ENGINE}.worker.x": "def f():\n    from vllm.v1.worker import gpu_model_runner\n",
        f"{ENGINE}.frontend.y": "import vllm.envs\nfrom vllm import SamplingParams\n",
        f"{ENGINE}.compat.worker": "from vllm.v1.worker import gpu_model_runner\n",
    }
    assert vllm_outside_compat(sources) == [
        f"{ENGINE}.frontend.y: from vllm.envs import *",
        f"{ENGINE}.worker.x: from vllm.v1.worker import gpu_model_runner",
    ]


def test_vllm_is_imported_only_through_compat() -> None:
    sources = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert any(vllm_imports(source) for name, source in sources.items() if within(name, f"{ENGINE}.compat")), "no vLLM import read"
    found = vllm_outside_compat(sources)
    assert not found, "vLLM internals imported outside lens_evals/engine/compat/ (add an accessor there):\n" + "\n".join(found)


def test_no_module_over_400_lines() -> None:
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
