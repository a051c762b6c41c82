"""Graph mode's configuration, read alike by both sides: which layers are tapped (vLLM's
``additional_config={"lens_evals": {"graph_layers": [...]}}`` or ``LENS_EVALS_GRAPH_LAYERS``;
None: eager mode) and what a graph-mode engine cannot run. The frontend refuses such requests
at admission (:func:`refusal`); the worker taps these layers (``worker/graph_taps.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from lens_evals import settings
from lens_evals.engine import compat

GRAPH_LAYERS_ENV = settings.GRAPH_LAYERS.name

# the tapped layers that keep CUDA graphs: every layer, these indices, or none (eager)
LayerSpec = Literal["all"] | list[int] | None

CONFIG_KEY = "lens_evals"


def parse_layer_spec(spec: Any) -> LayerSpec:
    """``"all"``, a list of layer indices, or a comma-separated string of them; None when off."""
    if spec is None or spec == "" or spec == []:
        return None
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text in ("", "off", "none", "false"):
            return None
        if text == "all":
            return "all"
        try:
            return sorted({int(part) for part in text.split(",") if part.strip()})
        except ValueError:
            raise ValueError(f"{GRAPH_LAYERS_ENV} must be 'all' or comma-separated layer indices, got {spec!r}") from None
    if isinstance(spec, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
        return sorted(set(spec))
    raise ValueError(f"graph_layers must be 'all' or a list of layer indices, got {spec!r}")


def env_layer_spec() -> LayerSpec:
    return parse_layer_spec(settings.GRAPH_LAYERS.get())


def resolve_layers(spec: LayerSpec, num_layers: int) -> list[int] | None:
    if spec is None:
        return None
    layers = list(range(num_layers)) if isinstance(spec, str) else list(spec)
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"graph_layers {bad} out of range for a model with {num_layers} layers")
    return layers


def configured_layers(vllm_config: Any, num_layers: int) -> list[int] | None:
    """The tapped layers of an engine (None: graph mode off, eager hooks)."""
    section = compat.config.plugin_config(vllm_config, CONFIG_KEY)
    return resolve_layers(parse_layer_spec(section.get("graph_layers")), num_layers)


def refusal(lens: Any, tapped: Iterable[int]) -> str | None:
    """Why a parsed lens request cannot run on a graph-mode engine (None: it can)."""
    tapped = set(tapped)
    wanted = set(lens.capture_layers) | {p.layer for p in lens.probes}
    wanted |= {layer for vec in lens.steering for layer in vec.layer_indices}
    missing = sorted(wanted - tapped)
    if missing:
        return (
            f"layers {missing} are not tapped on this graph-mode engine (tapped: {sorted(tapped)}); "
            f"start it with {GRAPH_LAYERS_ENV} including them, or without graph mode"
        )
    if any(vec.norm_match for vec in lens.steering):
        return "norm_match steering needs eager mode (the row norm is not known outside the graph)"
    if lens.hooks or lens.hook_set is not None:
        return "hooks need eager mode (graph mode runs only capture, steering and probes)"
    if getattr(lens, "readouts", None):
        return "readouts (output_readouts) need eager mode for now (graph mode runs only capture, steering and probes)"
    return None
