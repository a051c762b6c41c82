"""Run captures, steering and probes in a fresh process (offline LLM or AsyncLLM) and save them.

Usage: python run_capture.py MODEL_DIR OUT.safetensors {offline,async}
Environment decides the engine mode (e.g. VLLM_ENABLE_V1_MULTIPROCESSING=1)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

PROMPTS = ["the cat reads a book.", "our team builds many layers and the river sees the city.", "my friend"]
LAYERS = [0, 2, 3]


def params(i: int):
    from vllm import SamplingParams

    from lens_evals import LinearProbe, SteeringVector

    extra: dict = {"output_residual_stream": LAYERS}
    if i == 1:
        acts = np.random.default_rng(4).normal(size=(1, 128)).astype(np.float32)
        extra["apply_steering_vectors"] = [SteeringVector(activations=acts, layer_indices=[1], scale=3.0)]
    if i == 2:  # a module-level callable travels by import name; a registered hook by name
        from lens_evals.request.hook_library import record_norm
        from lens_evals.request.hooks import Hook

        extra["apply_hooks"] = [Hook(record_norm, [1, 3]), Hook("ablate", [2], args={"indices": [4]})]
    if i >= 1:
        weights = np.random.default_rng(5).normal(size=128).astype(np.float32)
        extra["output_probe_scores"] = [LinearProbe(name="p", layer=2, weights=weights, bias=1.0)]
    return SamplingParams(max_tokens=5 - i, temperature=0.0, ignore_eos=True, extra_args=extra)  # finishing at 3 steps


def gpu_options() -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.device import gpu_share

    return gpu_share()  # on a GPU: a share of the device beside the test process's engines


def offline(model: str) -> tuple[list, str, int]:
    """The outputs, what a lambda hook gives ("ok" in-process, the error text otherwise), and
    how many requests' rows the worker wrote before the fetch (``early_write``)."""
    from vllm import LLM, SamplingParams

    from lens_evals.engine.frontend.attach import LensRequestError
    from lens_evals.request.hooks import Hook

    llm = LLM(model, dtype="float32", max_model_len=512, seed=0, **gpu_options())
    outputs = llm.generate(PROMPTS, [params(i) for i in range(len(PROMPTS))])
    (memory,) = llm.collective_rpc("lens_evals_memory")
    try:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2, extra_args={"apply_hooks": [Hook(lambda ctx, h: None, [0])]}))
        lambda_result = "ok"
    except LensRequestError as exc:
        lambda_result = str(exc)
    return outputs, lambda_result, memory["early_written"]


async def run_async(model: str) -> list:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model, dtype="float32", max_model_len=512, seed=0, **gpu_options()))

    async def one(i: int):
        final = None
        async for out in engine.generate(PROMPTS[i], params(i), request_id=f"r{i}"):
            final = out
        return final

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))
    finally:
        engine.shutdown()


def main() -> None:
    model, out_path, mode = sys.argv[1:4]
    outputs, lambda_result, early = offline(model) if mode == "offline" else (asyncio.run(run_async(model)), "not run", -1)
    tensors = {}
    for i, out in enumerate(outputs):
        tensors[f"capture_{i}"] = out.activations["residual_stream"].contiguous()
        tensors[f"tokens_{i}"] = torch.tensor(list(out.outputs[0].token_ids))
        for name, scores in out.activations.get("probe_scores", {}).items():
            tensors[f"probe_{name}_{i}"] = scores.contiguous()
        for name, value in out.activations.get("saved", {}).items():
            tensors[f"saved_{name}_{i}"] = value.contiguous()
    from lens_evals.engine.transport.handoff import HandoffTarget

    save_file(
        tensors, out_path, metadata={"lambda_hook": lambda_result, "handoff_files": str(HandoffTarget.claimed), "early_written": str(early)}
    )


if __name__ == "__main__":
    main()
