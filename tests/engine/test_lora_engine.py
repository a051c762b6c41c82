"""LoRA adapters beside base-model requests, offline and on the server, against HF + peft.

vLLM's CPU LoRA ops read a base row's adapter index -1 as the last slot; with every slot in
use (max_loras=1 and one adapter), base rows next to LoRA rows got the adapter. The engine
replaces those ops (compat.lora.use_grouped_lora_ops); these batches would fail without it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import torch

from lens_evals.inspect_kit.provider.lora_args import lora_server_args
from lens_evals.inspect_kit.provider.server import LensServer
from tests.conftest import gpu_share, make_llm
from tests.lora_helpers import assert_greedy_of, greedy_gaps, greedy_margin, lora_dtype, random_adapter

PROMPTS = [[274, 336, 300, 267, 280], [267, 290, 310, 274, 320, 330, 340], [300, 301, 302]]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "qv": random_adapter(tiny_path, root / "qv", 0, ["q_proj", "v_proj"]),
        "mlp": random_adapter(tiny_path, root / "mlp", 1, ["o_proj", "down_proj", "up_proj"]),
    }


@pytest.fixture(scope="module")
def references(tiny_path, adapters) -> dict[str | None, torch.nn.Module]:
    """The fp32 HF references: the base model (None) and HF + peft for each adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def base() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32).eval()

    models: dict[str | None, torch.nn.Module] = {None: base()}
    for name, path in adapters.items():
        models[name] = PeftModel.from_pretrained(base(), str(path)).eval()
    return models


@pytest.fixture(scope="module")
def hf_tokens(references) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of each reference, one prompt at a time; an adapter that serves the base
    model's tokens (or the other adapter's) must be caught by the margin: checked here."""

    def greedy(model) -> list[list[int]]:
        out = []
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            out.append(generated[0, len(prompt) :].tolist())
        return out

    tokens = {name: greedy(model) for name, model in references.items()}
    for name, model in references.items():
        for other in references:
            if other != name:
                worst = max(float(greedy_gaps(model, prompt, tokens[other][i]).max()) for i, prompt in enumerate(PROMPTS))
                assert worst > 4 * greedy_margin(), f"{other or 'base'}'s tokens pass as {name or 'base'}'s: adapters too weak to test"
    return tokens


def assert_rows_greedy(references, pattern, token_rows, what: str) -> None:
    gaps = [
        assert_greedy_of(references[name], PROMPTS[i % len(PROMPTS)], tokens, f"{what} row {i} ({name or 'base'})")
        for i, (name, tokens) in enumerate(zip(pattern, token_rows))
    ]
    print(f"{what} ({lora_dtype()}): largest gap to the fp32 reference's greedy token {max(gaps):.4f} logits")


@pytest.mark.parametrize("max_loras", [1, 3])
def test_offline_mixed_batches_equal_hf_peft(tiny_path, adapters, references, hf_tokens, max_loras) -> None:
    """Base and adapter rows in one batch, every slot in use (max_loras=1) or one free."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    names = ["qv"] if max_loras == 1 else ["qv", "mlp"]
    requests = {name: LoRARequest(name, i + 1, str(adapters[name])) for i, name in enumerate(names)}
    pattern = [None, names[0], None, names[-1], names[0], None]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with make_llm(tiny_path, enable_lora=True, max_loras=max_loras, max_lora_rank=8, dtype=lora_dtype()) as llm:
        prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(pattern))]
        outputs = llm.generate(prompts, params, lora_request=[requests.get(name) if name else None for name in pattern], use_tqdm=False)
    assert_rows_greedy(references, pattern, [list(output.outputs[0].token_ids) for output in outputs], f"max_loras={max_loras}")


def test_lora_server_args(adapters) -> None:
    args = lora_server_args({"lora_modules": f"a={adapters['qv']},b={adapters['mlp']}", "dtype": "float32"})
    assert args["enable_lora"] is True and args["max_loras"] == 3 and args["max_lora_rank"] == 8
    assert args["lora_modules"] == [f"a={adapters['qv'].resolve()}", f"b={adapters['mlp'].resolve()}"]
    assert lora_server_args({"dtype": "float32"}) == {"dtype": "float32"}
    with pytest.raises(ValueError, match="NAME=PATH"):
        lora_server_args({"lora_modules": "just-a-path"})
    with pytest.raises(FileNotFoundError, match="no trained oracle"):
        lora_server_args({"lora_modules": "a=/no/such/adapter"})


def test_server_concurrent_mixed_requests_equal_hf_peft(tiny_path, adapters, references, hf_tokens) -> None:
    """Concurrent completions for the base model and two adapters share the server's batches."""
    args = lora_server_args(
        {
            "dtype": lora_dtype(),
            "max_model_len": 512,
            "seed": 0,
            **gpu_share(),
            "lora_modules": f"qv={adapters['qv']} mlp={adapters['mlp']}",
        }
    )
    server = LensServer(str(tiny_path), served_name="tiny-llama", server_args=args).start()
    try:

        async def complete(client: httpx.AsyncClient, model: str, prompt: list[int]) -> list[int]:
            response = await client.post(
                f"{server.url}/v1/completions",
                json={
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
            )
            response.raise_for_status()
            return response.json()["choices"][0]["token_ids"]

        pattern = [None, "qv", "mlp", None, "qv", None, "mlp", None, None]

        async def run_all() -> list[list[int]]:
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(
                    *(complete(client, name or "tiny-llama", PROMPTS[i % len(PROMPTS)]) for i, name in enumerate(pattern))
                )

        results = asyncio.run(run_all())
    finally:
        server.stop()
    assert_rows_greedy(references, pattern, results, "server")
