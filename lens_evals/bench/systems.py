"""The systems a benchmark compares, by name. Each runs in its own process (see ``child``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class System:
    name: str
    label: str
    kind: str  # "vllm" (pure or ours), "vllm-mixed" (ours, features interleaved), "hf", "nnsight-hf", "nnsight-vllm", "tl"
    lens: str | None = None  # our feature: "plain" (none), "capture-1", "capture-all", "steer-1", "probe", "mixed"
    cuda_graphs: bool = False  # pure vLLM with CUDA graphs / torch.compile (GPU only)
    gpu_only: bool = False
    captures_layer: bool = False  # yields the hooked layer's stream to compare with HF

    @property
    def on_vllm(self) -> bool:
        """Pure vLLM or ours (one feature or interleaved): a vLLM engine this package starts."""
        return self.kind in ("vllm", "vllm-mixed")

    @property
    def graph_mode(self) -> bool:
        """Ours with CUDA graphs / torch.compile kept on (the layer tapped in the graph)."""
        return self.cuda_graphs and self.lens is not None


BASELINE = "vllm-eager"
GRAPHS = "vllm-graphs"
REFERENCE = "hf-hook"  # the independent reference for captured values

ALL_SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(GRAPHS, "pure vLLM, CUDA graphs", "vllm", cuda_graphs=True, gpu_only=True),
        System(BASELINE, "pure vLLM, eager", "vllm"),
        System("lens-plain", "ours: plugin on, plain requests", "vllm", lens="plain"),
        System("lens-capture-1", "ours: capture 1 layer", "vllm", lens="capture-1", captures_layer=True),
        System("lens-capture-all", "ours: capture all layers", "vllm", lens="capture-all", captures_layer=True),
        System("lens-steer-1", "ours: steer 1 layer", "vllm", lens="steer-1"),
        System("lens-probe", "ours: probe on worker", "vllm", lens="probe"),
        # Graph mode: torch.compile + CUDA graphs kept on, the layer tapped by a fixed op
        System("lens-graphs-capture-1", "ours, graph mode: capture 1 layer", "vllm", lens="capture-1",
               cuda_graphs=True, gpu_only=True, captures_layer=True),
        System("lens-graphs-steer-1", "ours, graph mode: steer 1 layer", "vllm", lens="steer-1", cuda_graphs=True, gpu_only=True),
        System("lens-graphs-probe", "ours, graph mode: probe on worker", "vllm", lens="probe", cuda_graphs=True, gpu_only=True),
        # One engine, plain requests and each feature in alternating rounds (see ``interleaved``)
        System("lens-mixed", "ours, same engine: plain / capture / steer / probe rounds", "vllm-mixed", lens="mixed"),
        System("lens-graphs-mixed", "ours, graph mode, same engine: plain / capture / steer / probe rounds", "vllm-mixed",
               lens="mixed", cuda_graphs=True, gpu_only=True),
        System(REFERENCE, "HF generate + forward hook", "hf", captures_layer=True),
        System("nnsight-hf", "nnsight 0.8, HF backend", "nnsight-hf", captures_layer=True),
        System("nnsight-vllm", "nnsight 0.8, vLLM backend", "nnsight-vllm", captures_layer=True),
        System("tl-bridge", "TransformerLens 4.3 TransformerBridge", "tl", captures_layer=True),
    )
}

# Ratio targets against eager pure vLLM on the same engine (issue #10).
TARGETS_VS_EAGER = {"lens-capture-1": 1.10, "lens-steer-1": 1.05, "lens-probe": 1.03}
TARGET_VS_GRAPHS = 1.2  # the moonshot: lens features with graphs kept on
MOONSHOT_SYSTEMS = ("lens-graphs-capture-1", "lens-graphs-steer-1", "lens-graphs-probe")
MIN_SPEEDUP_VS_HF = 10.0  # ours capture 1 layer vs HF generate + hook


def default_systems(gpu: bool) -> list[str]:
    return [name for name, s in ALL_SYSTEMS.items() if gpu or not s.gpu_only]


def resolve(names: list[str] | None, gpu: bool) -> list[System]:
    """The systems to run, baseline first; unknown names are a ValueError."""
    chosen = names or default_systems(gpu)
    unknown = [n for n in chosen if n not in ALL_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {', '.join(ALL_SYSTEMS)}")
    if BASELINE not in chosen:
        chosen = [BASELINE, *chosen]
    if any(ALL_SYSTEMS[n].graph_mode for n in chosen) and GRAPHS not in chosen:
        chosen = [GRAPHS, *chosen]  # graph-mode rows are compared with pure vLLM with graphs
    order = list(ALL_SYSTEMS)
    return [ALL_SYSTEMS[n] for n in sorted(set(chosen), key=order.index)]
