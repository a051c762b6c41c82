"""The systems a benchmark compares, by name. Each runs in its own process (see ``child``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class System:
    name: str
    label: str
    kind: str  # "vllm" (pure or ours), "vllm-mixed" (ours, features interleaved), "hf", "nnsight-hf", "nnsight-vllm", "tl"
    lens: str | None = None  # our feature: "plain" (none), "capture-1", "capture-8", "capture-all", "steer-1", "probe", "mixed"
    cuda_graphs: bool = False  # pure vLLM with CUDA graphs / torch.compile (GPU only)
    gpu_only: bool = False
    captures_layer: bool = False  # yields the hooked layer's stream to compare with HF
    copy_overlap: bool = True  # False: LENS_EVALS_COPY_OVERLAP=0, the step copies on the compute stream

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
HF_FORWARD = "hf-forward"  # the prefill workload's HF competitor (and its reference)

ALL_SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System(GRAPHS, "pure vLLM, CUDA graphs", "vllm", cuda_graphs=True, gpu_only=True),
        System(BASELINE, "pure vLLM, eager", "vllm"),
        System("lens-plain", "ours: plugin on, plain requests", "vllm", lens="plain"),
        System("lens-capture-1", "ours: capture 1 layer", "vllm", lens="capture-1", captures_layer=True),
        System("lens-capture-8", "ours: capture 8 layers", "vllm", lens="capture-8", captures_layer=True),
        System("lens-capture-all", "ours: capture all layers", "vllm", lens="capture-all", captures_layer=True),
        System("lens-steer-1", "ours: steer 1 layer", "vllm", lens="steer-1"),
        System("lens-probe", "ours: probe on worker", "vllm", lens="probe"),
        # Graph mode: torch.compile + CUDA graphs kept on, the layer tapped by a fixed op
        System(
            "lens-graphs-capture-1",
            "ours, graph mode: capture 1 layer",
            "vllm",
            lens="capture-1",
            cuda_graphs=True,
            gpu_only=True,
            captures_layer=True,
        ),
        System(
            "lens-graphs-capture-8",
            "ours, graph mode: capture 8 layers",
            "vllm",
            lens="capture-8",
            cuda_graphs=True,
            gpu_only=True,
            captures_layer=True,
        ),
        # The same captures with the step copies on the compute stream (the side stream's gain, GPU)
        System(
            "lens-capture-1-sync",
            "ours: capture 1 layer, copies not overlapped",
            "vllm",
            lens="capture-1",
            gpu_only=True,
            captures_layer=True,
            copy_overlap=False,
        ),
        System(
            "lens-graphs-capture-1-sync",
            "ours, graph mode: capture 1 layer, copies not overlapped",
            "vllm",
            lens="capture-1",
            cuda_graphs=True,
            gpu_only=True,
            captures_layer=True,
            copy_overlap=False,
        ),
        System("lens-graphs-steer-1", "ours, graph mode: steer 1 layer", "vllm", lens="steer-1", cuda_graphs=True, gpu_only=True),
        System("lens-graphs-probe", "ours, graph mode: probe on worker", "vllm", lens="probe", cuda_graphs=True, gpu_only=True),
        # One engine, plain requests and each feature in alternating rounds (see ``interleaved``)
        System("lens-mixed", "ours, same engine: plain / capture / steer / probe rounds", "vllm-mixed", lens="mixed"),
        System(
            "lens-graphs-mixed",
            "ours, graph mode, same engine: plain / capture / steer / probe rounds",
            "vllm-mixed",
            lens="mixed",
            cuda_graphs=True,
            gpu_only=True,
        ),
        System(REFERENCE, "HF generate + forward hook", "hf", captures_layer=True),
        System(HF_FORWARD, "HF forward + hook, length-sorted, batch tuned", "hf-forward", captures_layer=True),
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


# The prefill workload (issue #21): capture costs against the copy it must make. PREFILL_ONLY:
# not in the decode workload's default systems (the -sync rows: named when wanted).
PREFILL_ONLY = ("lens-capture-8", "lens-graphs-capture-8", "lens-capture-1-sync", "lens-graphs-capture-1-sync", HF_FORWARD)
PREFILL_CPU = ("vllm-eager", "lens-capture-1", "lens-mixed", HF_FORWARD, "nnsight-hf", "tl-bridge")  # the last two: where installed
PREFILL_GPU = (
    "vllm-graphs",
    "vllm-eager",
    "lens-capture-1",
    "lens-capture-8",
    "lens-graphs-capture-1",
    "lens-graphs-capture-8",
    "lens-steer-1",
    "lens-graphs-probe",
    "lens-mixed",
    "lens-graphs-mixed",
    HF_FORWARD,
)
PREFILL_TARGET = 1.05  # capture <= 1.05x pure vLLM (eager, and graph mode against graphs)


def default_systems(gpu: bool, workload: str = "decode") -> list[str]:
    if workload == "prefill":
        return list(PREFILL_GPU if gpu else PREFILL_CPU)
    return [name for name, s in ALL_SYSTEMS.items() if (gpu or not s.gpu_only) and name not in PREFILL_ONLY]


def resolve(names: list[str] | None, gpu: bool, workload: str = "decode") -> list[System]:
    """The systems to run, baseline first; unknown names are a ValueError."""
    chosen = names or default_systems(gpu, workload)
    unknown = [n for n in chosen if n not in ALL_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {', '.join(ALL_SYSTEMS)}")
    if BASELINE not in chosen:
        chosen = [BASELINE, *chosen]
    if any(ALL_SYSTEMS[n].graph_mode for n in chosen) and GRAPHS not in chosen:
        chosen = [GRAPHS, *chosen]  # graph-mode rows are compared with pure vLLM with graphs
    order = list(ALL_SYSTEMS)
    return [ALL_SYSTEMS[n] for n in sorted(set(chosen), key=order.index)]
