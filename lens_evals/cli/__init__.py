"""The ``lens-evals`` command line: ``app`` builds the parser and dispatches; one module per subcommand.

``main`` (the console script's entry point, ``lens_evals.cli:main``) is loaded on first use, so
importing a subcommand's module does not build the whole parser.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "main":
        from lens_evals.cli.app import main

        return main
    raise AttributeError(f"module 'lens_evals.cli' has no attribute {name!r}")
