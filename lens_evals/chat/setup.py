"""The chat page's backend from its command line: the lens server's model, the probes, steering
vectors, SAE and lens layers, each checked before the page starts (a clear error otherwise)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from lens_evals.chat.backend import ChatBackend
from lens_evals.chat.oracle_box import oracle_settings
from lens_evals.chat.steering import Steering, load_vector
from lens_evals.chat.token_details import LENS_NAME, SAE_NAME, DetailsRequest
from lens_evals.chat.upstream import Upstream, UpstreamError


@dataclass
class ChatOptions:
    server: str
    model: str | None = None
    probes: list[str] = field(default_factory=list)
    vectors: list[str] = field(default_factory=list)
    sae: str | None = None
    lens_layers: list[int] | None = None  # None: every layer (of the lens file, when given)
    lens: str | None = None  # an affine lens file (tuned / Jacobian); None: the logit lens
    top_k: int = 5
    num_layers: int | None = None  # None: from the served model's config.json
    oracle_lora: str = "oracle"
    oracle_card: str | None = None
    oracle_layer: int | None = None
    api_key: str | None = None


def served_num_layers(root: str) -> int:
    config = Path(root) / "config.json"
    if not config.is_file():
        raise ValueError(f"cannot read the served model's config ({config} is not a local file): pass --num-layers")
    data = json.loads(config.read_text(encoding="utf-8"))
    data = data.get("text_config", data)
    return int(data["num_hidden_layers"])


def open_backend(options: ChatOptions) -> ChatBackend:
    from lens_evals.probing.probe import load_probe

    upstream = Upstream(options.server, api_key=options.api_key)
    models = upstream.models()
    entry = models[0] if options.model is None else next((m for m in models if m["id"] == options.model), None)
    if entry is None:
        raise UpstreamError(f"the server serves no model {options.model!r}; it serves {[m['id'] for m in models]}")
    num_layers = options.num_layers or served_num_layers(str(entry.get("root") or ""))
    probes = {}
    for path in options.probes:
        probe = load_probe(path).linear_probe()
        if probe.name in probes:
            raise ValueError(f"two probes named {probe.name!r}")
        if not 0 <= probe.layer < num_layers:
            raise ValueError(f"{path}: probe layer {probe.layer} is not a layer of the served model (0..{num_layers - 1})")
        probes[probe.name] = probe
    vectors = {Path(path).stem: load_vector(path) for path in options.vectors}
    layers = list(range(num_layers)) if options.lens_layers is None else sorted(set(options.lens_layers))
    if any(not 0 <= layer < num_layers for layer in layers):
        raise ValueError(f"lens layers {layers}: the served model has layers 0..{num_layers - 1}")
    from lens_evals.readouts.requests import lens_readout, sae_readout
    from lens_evals.request.readouts import LensReadout

    if options.lens:  # without --lens-layer: every layer the file has a translator for
        lens = lens_readout(options.lens, LENS_NAME, "all" if options.lens_layers is None else layers, options.top_k)
        layers = list(lens.layers) if isinstance(lens.layers, list) else layers
        if any(not 0 <= layer < num_layers for layer in layers):
            raise ValueError(f"{options.lens}: lens layers {layers}; the served model has layers 0..{num_layers - 1}")
    else:
        lens = LensReadout(name=LENS_NAME, layers=layers, top_k=options.top_k)
    sae = sae_readout(options.sae, SAE_NAME) if options.sae else None
    if sae is not None and not 0 <= sae.layer < num_layers:
        raise ValueError(f"the SAE reads layer {sae.layer}; the served model has layers 0..{num_layers - 1}")
    return ChatBackend(
        upstream=upstream,
        model=str(entry["id"]),
        probes=probes,
        details=DetailsRequest(lens=lens if layers else None, sae=sae, sae_label=Path(options.sae).name if options.sae else ""),
        steering=Steering(upstream, str(entry["id"]), vectors),
        oracle_lora=options.oracle_lora,
        oracle=oracle_settings(options.oracle_card, options.oracle_layer),
        num_layers=num_layers,
    )
