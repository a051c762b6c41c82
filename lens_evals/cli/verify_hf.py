"""``lens-evals verify MODEL``, second half: capture and steering of every layer against HF
transformers, where HF can load the checkpoint (a local model directory of an architecture
transformers implements).

The reference runs first, in a process of its own (vLLM's Transformers backend rewrites
transformers' classes in the process that loads it, and the reference's memory is freed before
the engine starts): HF in float32 on the CPU, the residual stream after each decoder layer (a
forward hook on the layer: HF's last ``hidden_states`` entry is after the final norm) on a few
prompts, and for each layer L a steering vector (a random direction, half the median stream norm
there) added after L at every position, with the streams it gives at L, L + 1 and the last layer.
Then the engine runs the same token ids: one request capturing every layer, one per layer
steering it. The error is the largest per-token relative error ``||vllm_t - hf_t|| / ||hf_t||``,
held to a bound from the engine's dtype and device (:func:`stream_bound`). A wrong stream
contract gives errors of order 1 (the adjacent layer's stream 0.25, StableLM read as fused 0.93).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

PROMPTS = ("The capital of France is Paris, and the capital of Italy is", "A model reads its residual stream layer by layer; 17 + 25 = 42.")
STEER_FRACTION = 0.5  # the steering vector's norm, as a fraction of the median stream norm at its layer
# Largest per-token relative error against HF in float32. float32 on CPU: ~9x SmolLM2's worst
# (1.1e-5 over 30 layers, tests/tolerance.py; 1.4e-5 here). On a GPU vLLM runs float32 matmuls in
# TF32 (unit roundoff 2^-11): tests/tolerance.py's GPU bound, not yet measured here. Half
# precision against HF's float32: SmolLM2 in bfloat16 on CPU measured 0.24 at worst (layers 9-13;
# prompt log-prob gap 0.56, docs/model_support.md), so only errors of order 1 are told from
# rounding (a wrong contract: 0.87-0.99); float16 not measured, taken as bfloat16.
BOUNDS = {"float32": 1e-4, "float32-cuda": 2e-2, "bfloat16": 5e-1, "float16": 5e-1}
HALF_PRECISION_NOTE = (
    "half precision against HF's float32: only errors of order 1 are told from rounding; the precise check: --engine-arg dtype=float32"
)
REFERENCE_FILE = "reference.safetensors"
META_FILE = "meta.json"


def stream_bound(dtype: str, device: str) -> float:
    """The largest per-token relative error accepted for an engine of ``dtype`` on ``device``."""
    if dtype == "float32" and device == "cuda":
        return BOUNDS["float32-cuda"]
    return BOUNDS.get(dtype, BOUNDS["bfloat16"])


def compared_layers(layer: int, num_layers: int) -> list[int]:
    """Where a steering vector at ``layer`` is compared: the layer itself (the write), the next
    (what it reads) and the last (what reaches the final norm)."""
    return sorted({layer, min(layer + 1, num_layers - 1), num_layers - 1})


@dataclass(frozen=True)
class LayerRow:
    layer: int
    capture: float  # largest per-token relative error of the capture against HF
    steering: float  # the same, steered at this layer (streams at compared_layers)
    effect: float  # how far the steering moved HF's stream there (relative): what the error is small against
    passed: bool


@dataclass
class HFComparison:
    """The comparison's outcome: ``skipped`` says why it did not run (HF cannot load the model)."""

    model: str
    dtype: str = ""
    device: str = ""
    bound: float = math.nan
    prompts: int = 0
    tokens: int = 0
    logprob_gap: float = math.nan  # vLLM's plain prompt log-probs against HF's: its own forward's gap
    rows: list[LayerRow] = field(default_factory=list)
    skipped: str | None = None
    error: str | None = None  # the engine's lens requests failed: why
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        if self.error is not None:
            return False
        return self.skipped is not None or (bool(self.rows) and all(row.passed for row in self.rows))

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}

    def table(self) -> str:
        head = f"against HF transformers (float32, CPU), {self.model}: "
        if self.skipped is not None:
            return head + f"not run ({self.skipped})"
        if self.error is not None:
            return head + f"FAIL: the engine's lens requests failed: {self.error}"
        lines = [
            head + f"{'PASS' if self.passed else 'FAIL'}; engine {self.dtype} on {self.device}, {self.prompts} prompts, "
            f"{self.tokens} tokens, {self.seconds:.1f} s",
            "layer  capture    steering   effect     bound      result",
        ]
        lines += [
            f"{r.layer:<6} {r.capture:.2e}   {r.steering:.2e}   {r.effect:.2e}   {self.bound:.0e}      {'pass' if r.passed else 'FAIL'}"
            for r in self.rows
        ]
        lines.append(f"largest prompt log-prob gap, a plain request against HF: {self.logprob_gap:.2e} (vLLM's forward; not bounded)")
        if self.dtype != "float32":
            lines.append(HALF_PRECISION_NOTE)
        return "\n".join(lines)


def hf_unloadable(model: str) -> str | None:
    """Why HF cannot load ``model`` here (None: it can): a local directory with a config whose
    architecture transformers implements. Nothing is downloaded."""
    path = Path(model)
    if not (path / "config.json").is_file():
        return f"{model} is not a local model directory (nothing is downloaded; dequantise a GGUF file to a HF folder first)"
    import transformers

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    architectures = config.get("architectures") or []
    if not architectures or not hasattr(transformers, architectures[0]):
        return f"transformers {transformers.__version__} has no class {architectures[:1] or 'for this config'}"
    if config.get("quantization_config"):
        return f"a quantised checkpoint ({config['quantization_config'].get('quant_method', '?')}): compare its unquantised weights"
    return None


# ------------------------------------------------------------------ the HF side (its own process)
def hf_decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList:
    """The decoder layers; in a multimodal model the language model's (its vision tower, listed
    first, may have as many layers)."""
    language_model = getattr(getattr(model, "model", None), "language_model", None)
    model = model if language_model is None else language_model
    for module in model.modules():
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == num_layers:
                return child
    raise RuntimeError(f"no list of {num_layers} decoder layers in {type(model).__name__}")


class HFModel:
    """HF transformers, float32: the stream after each decoder layer, with an addition after one."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self.num_layers = int(self.model.config.get_text_config().num_hidden_layers)
        self.layers = hf_decoder_layers(self.model, self.num_layers)

    @torch.no_grad()
    def run(self, tokens: Sequence[int], vectors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """((batch, num_layers, n_tokens, hidden) streams, (batch, n_tokens - 1) log-probs of the
        prompt tokens after the first). Without ``vectors`` a batch of one; with ``vectors``
        (num_layers, hidden), a batch of num_layers: row L with ``vectors[L]`` added after layer L
        at every position (one batched forward, not one per layer)."""
        batch = 1 if vectors is None else self.num_layers
        captured: dict[int, torch.Tensor] = {}

        def hook(index: int) -> Any:
            def after(module: torch.nn.Module, args: Any, output: Any) -> Any:
                hidden = output[0] if isinstance(output, tuple) else output
                if vectors is not None:
                    hidden = hidden.clone()
                    hidden[index] += vectors[index].to(hidden.dtype)
                captured[index] = hidden.clone()
                if vectors is not None:
                    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
                return None

            return after

        ids = torch.tensor([list(tokens)] * batch)
        handles = [module.register_forward_hook(hook(i)) for i, module in enumerate(self.layers)]
        try:
            logits = self.model(ids).logits[:, :-1].double()
        finally:
            for handle in handles:
                handle.remove()
        logprobs = torch.log_softmax(logits, dim=-1).gather(2, ids[:, 1:, None])[..., 0]
        return torch.stack([captured[i] for i in range(self.num_layers)], dim=1), logprobs


def _reference_main(path: Path, work: Path, prompts: Sequence[str]) -> None:
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    hf, tokenizer = HFModel(path), AutoTokenizer.from_pretrained(str(path))
    token_ids = [list(tokenizer(prompt).input_ids) for prompt in prompts]
    out: dict[str, torch.Tensor] = {}
    plain = []
    for p, tokens in enumerate(token_ids):
        streams, logprobs = hf.run(tokens)
        out[f"plain.{p}"], out[f"logprobs.{p}"] = streams[0].contiguous(), logprobs[0].contiguous()
        plain.append(streams[0])
    rng = np.random.default_rng(0)
    vectors = torch.zeros(hf.num_layers, plain[0].shape[-1])
    for layer in range(hf.num_layers):
        norms = torch.cat([streams[layer].norm(dim=-1) for streams in plain])
        direction = torch.from_numpy(rng.normal(size=plain[0].shape[-1])).float()
        vectors[layer] = direction / direction.norm() * STEER_FRACTION * float(norms.median())
        out[f"vector.{layer}"] = vectors[layer].clone()
    for p, tokens in enumerate(token_ids):
        steered, _ = hf.run(tokens, vectors)
        for layer in range(hf.num_layers):
            out[f"steered.{layer}.{p}"] = steered[layer, compared_layers(layer, hf.num_layers)].contiguous()
    save_file(out, str(work / REFERENCE_FILE))
    (work / META_FILE).write_text(json.dumps({"tokens": token_ids, "num_layers": hf.num_layers}))


@dataclass
class Reference:
    tokens: list[list[int]]
    num_layers: int
    tensors: dict[str, torch.Tensor]


def hf_reference(model: str, prompts: Sequence[str] = PROMPTS) -> Reference:
    """HF's streams for ``prompts``, computed in a fresh process on the CPU."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="lens-verify-hf-") as tmp:
        work = Path(tmp)
        (work / "prompts.json").write_text(json.dumps(list(prompts)))
        done = subprocess.run(
            [sys.executable, "-m", "lens_evals.cli.verify_hf", model, str(work)],
            env=os.environ | {"CUDA_VISIBLE_DEVICES": ""},
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"the HF reference for {model} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        meta = json.loads((work / META_FILE).read_text())
        return Reference(meta["tokens"], int(meta["num_layers"]), load_file(str(work / REFERENCE_FILE)))


# ------------------------------------------------------------------ the engine side
def compare(llm: Any, reference: Reference, model: str) -> HFComparison:
    """Run the reference's token ids on the engine ``llm`` (capture every layer; steer each) and
    compare with HF."""
    from vllm import SamplingParams

    from lens_evals.engine.frontend.self_check import token_error  # the largest per-token relative error
    from lens_evals.request.spec import SteeringVector

    started = time.monotonic()
    n, tokens = reference.num_layers, reference.tokens
    config = llm.llm_engine.vllm_config.model_config
    dtype = str(config.dtype).removeprefix("torch.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = HFComparison(model, dtype, device, stream_bound(dtype, device), len(tokens), sum(len(t) for t in tokens))
    engine_layers = int(config.hf_text_config.num_hidden_layers)
    if engine_layers != n:
        raise RuntimeError(f"the engine has {engine_layers} decoder layers, HF {n}")

    def params(**extra: Any) -> Any:
        return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, extra_args=extra)

    vectors = {layer: reference.tensors[f"vector.{layer}"].numpy() for layer in range(n)}
    jobs: list[tuple[int, int | None]] = [(p, None) for p in range(len(tokens))]
    jobs += [(p, layer) for layer in range(n) for p in range(len(tokens))]
    requests = [
        params(output_residual_stream=list(range(n)))
        if layer is None
        else params(
            output_residual_stream=compared_layers(layer, n),
            apply_steering_vectors=[SteeringVector(activations=vectors[layer][None], layer_indices=[layer])],
        )
        for _, layer in jobs
    ]
    outputs = llm.generate([{"prompt_token_ids": tokens[p]} for p, _ in jobs], requests, use_tqdm=False)
    got = {job: out.activations["residual_stream"] for job, out in zip(jobs, outputs)}
    gaps = []
    for p, out in enumerate(outputs[: len(tokens)]):
        entries = out.prompt_logprobs or []
        mine = torch.tensor([e[t].logprob for e, t in zip(entries[1:], tokens[p][1:])], dtype=torch.float64)
        gaps.append(float((mine - reference.tensors[f"logprobs.{p}"]).abs().max()))
    result.logprob_gap = max(gaps)
    for layer in range(n):
        at = compared_layers(layer, n)
        capture = max(token_error(got[(p, None)][layer], reference.tensors[f"plain.{p}"][layer]) for p in range(len(tokens)))
        steering = max(token_error(got[(p, layer)], reference.tensors[f"steered.{layer}.{p}"]) for p in range(len(tokens)))
        effect = min(
            token_error(reference.tensors[f"steered.{layer}.{p}"], reference.tensors[f"plain.{p}"][at]) for p in range(len(tokens))
        )
        ok = capture <= result.bound and steering <= result.bound
        result.rows.append(LayerRow(layer, capture, steering, effect, ok))
    result.seconds = round(time.monotonic() - started, 3)
    return result


if __name__ == "__main__":  # hf_reference's process: MODEL_DIR WORK_DIR
    work_dir = Path(sys.argv[2])
    _reference_main(Path(sys.argv[1]), work_dir, json.loads((work_dir / "prompts.json").read_text()))
