"""Shared by the examples: the embedded SmolLM2-135M-Instruct in an in-process engine."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # fast start; hooks may be any callable
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def embedded_llm() -> Any:
    from vllm import LLM

    from lens_evals.models.registry import model_path

    return LLM(str(model_path("smollm2-135m-instruct")), dtype="float32", max_model_len=256, seed=0)


def prompt_and_answer(llm: Any, prompt: str, answer: str) -> tuple[list[int], int]:
    """The prompt's token ids and the first token id of the answer."""
    tokenizer = llm.get_tokenizer()
    return tokenizer(prompt).input_ids, tokenizer(answer, add_special_tokens=False).input_ids[0]
