"""What one benchmark run does, written once by the parent and read by every system's process."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class BenchConfig:
    model_dir: str
    prompts: list[list[int]]  # token ids; every system gets exactly these
    max_tokens: int
    layer: int
    num_layers: int
    hidden_size: int
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"  # vLLM / torch dtype name
    hf_batch: int = 16
    hf_batches: list[int] = field(default_factory=list)  # hf-forward: batch sizes tried, the fastest timed
    workload: str = "decode"  # or "prefill": Alpaca-like prompt lengths, max_tokens=1 (see ``prefill``)
    probe_count: int = 1  # probes per request of the probe systems (all on ``layer``)
    check_prompts: int = 2  # prompts whose captured layer is kept to compare systems
    steer_scale: float = 0.0  # 0: same work as real steering, tokens must equal pure vLLM's
    engine: str = "inprocess"  # or "multiprocess" (vLLM's default)
    gpu_memory_utilization: float = 0.85
    warmup_tokens: int = 4
    repeats: int = 1  # timed runs per system; the best one is reported
    sync_debug: bool = False  # vLLM systems: count host-GPU syncs in one extra, untimed run
    tensor_parallel_size: int = 1  # vLLM systems (ours and pure) only
    pipeline_parallel_size: int = 1
    timeout_s: float = 3600.0
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        longest = max(len(p) for p in self.prompts)
        return int(-(-(longest + self.max_tokens + 16) // 16) * 16)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> BenchConfig:
        return cls(**json.loads(path.read_text()))
