"""Whether vLLM will load our plugin in the processes it starts: vLLM finds general plugins by
their package's ``vllm.general_plugins`` entry point (so lens-evals must be *installed*, not only
importable from a source tree on ``PYTHONPATH``) and loads only those ``VLLM_PLUGINS`` names when
that variable is set. Without the plugin an engine serves every request as plain vLLM and a
lens request comes back without activations, steering or probe scores; the package's own engine
and server starters ask this first and refuse with what to do."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points

from lens_evals import settings

PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "lens_evals"
PLUGIN_TARGET = "lens_evals.engine.plugin:register"


class PluginNotLoadable(RuntimeError):
    """vLLM would start this engine without the lens-evals plugin."""


def installed_plugins() -> list[tuple[str, str]]:
    """(name, target) of every ``vllm.general_plugins`` entry point of this Python environment."""
    return [(entry.name, entry.value) for entry in entry_points(group=PLUGIN_GROUP)]


def plugin_load_problem(plugins: Iterable[tuple[str, str]], allowed: str | None) -> str | None:
    """Why vLLM would not load our plugin, given the environment's entry points and
    ``VLLM_PLUGINS`` (``allowed``: comma-separated names, or None when unset), or None."""
    if not any(name == PLUGIN_NAME and target == PLUGIN_TARGET for name, target in plugins):
        return (
            f"the lens-evals vLLM plugin is not installed in this Python environment (no {PLUGIN_GROUP!r} entry point "
            f"{PLUGIN_NAME} = {PLUGIN_TARGET}; importing lens_evals from a source tree on PYTHONPATH does not register it): "
            "install the package (`pip install -e .` in the repository, or `pip install --target DIR .` with DIR on PYTHONPATH)"
        )
    if allowed is not None and PLUGIN_NAME not in {name.strip() for name in allowed.split(",")}:
        return f"VLLM_PLUGINS={allowed!r} leaves out the lens-evals plugin: add {PLUGIN_NAME} to it, or unset it"
    return None


def require_plugin(env: Mapping[str, str] | None = None) -> None:
    """Raise :class:`PluginNotLoadable` if vLLM, started with ``env`` (default: this process's
    environment), would not load our plugin; nothing when the plugin is turned off on purpose
    (``LENS_EVALS_DISABLE``): then plain vLLM is what was asked for."""
    env = os.environ if env is None else env
    if settings.plugin_disabled_by(env) is not None:
        return
    problem = plugin_load_problem(installed_plugins(), env.get("VLLM_PLUGINS"))
    if problem is not None:
        raise PluginNotLoadable(f"lens_evals: {problem}. Without it, lens requests would come back without activations.")
