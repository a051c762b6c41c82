"""One way between the package's layers (docs/architecture.md), imports inside functions included:
the command line on top (``lens_evals.cli``: nothing else imports it), then the Inspect tasks
(``evals/``), then what builds on the Inspect layer (``integrations/``, ``report/``), then the
Inspect layer itself (``inspect_kit/``), then the library (engine, request, wire, models, probing,
oracle, capture, client, settings). A module imports its own layer or those below it, never one
above."""

from __future__ import annotations

from tests.test_layout import import_graph

# top first; a package not listed is the library, below them all
LAYERS = [("lens_evals.cli",), ("lens_evals.evals",), ("lens_evals.integrations", "lens_evals.report"), ("lens_evals.inspect_kit",)]


def layer(module: str) -> int:
    for rank, packages in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in packages):
            return rank
    return len(LAYERS)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import of a layer above the importer's."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) < layer(a))


def test_the_checker_finds_an_upward_import() -> None:
    graph = {
        "lens_evals.probing.train": {"lens_evals.cli.checks", "lens_evals.settings"},
        "lens_evals.inspect_kit.probe_solver": {"lens_evals.evals.coup.coup"},
        "lens_evals.integrations.petri": {"lens_evals.inspect_kit.target_turn", "lens_evals.evals.petri_audit"},
        "lens_evals.cli.app": {"lens_evals.evals.roleplaying", "lens_evals.report"},
        "lens_evals.report.page": {"lens_evals.integrations.petri"},
    }
    assert upward_imports(graph) == [
        "lens_evals.inspect_kit.probe_solver -> lens_evals.evals.coup.coup",
        "lens_evals.integrations.petri -> lens_evals.evals.petri_audit",
        "lens_evals.probing.train -> lens_evals.cli.checks",
    ]


def test_nothing_below_the_command_line_imports_it() -> None:
    graph = import_graph()
    assert any(m.startswith("lens_evals.cli.") for m in graph), "the command line was not read"
    users = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) == 0 and layer(a) != 0)
    assert not users, f"library code imports the command line (move the check down to where it is used): {users}"


def test_every_import_goes_down_the_layers() -> None:
    graph = import_graph()
    assert len({layer(m) for m in graph}) == len(LAYERS) + 1, "every layer has modules"
    assert not upward_imports(graph), "imports of a layer above: " + "; ".join(upward_imports(graph))
