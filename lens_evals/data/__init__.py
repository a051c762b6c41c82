"""The package's data files (datasets, chat templates, licences), read where the package is installed."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def data_file(*parts: str) -> Path:
    """``lens_evals/data/<parts...>`` of the installed package."""
    return Path(str(resources.files("lens_evals").joinpath("data", *parts)))
