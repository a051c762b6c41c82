"""``activation_oracle``: ask an activation oracle (Karvonen et al., arXiv 2512.15674) a
question about the target model's activations on the sample's conversation.

1. capture the residual stream after ``target_layer`` on the conversation (all positions, or
   the last ``num_tokens``), with a base-model request;
2. build the oracle prompt (one user turn, ``"Layer: L\\n" + placeholder * K + " \\n" +
   question``) and tokenise it on the server to find the placeholders' absolute positions;
3. generate with the oracle adapter (a LoRA served beside the base model) while the engine
   injects each vector at its placeholder after ``injection_layer``:
   ``h + c * ||h|| * v / ||v||``.

The model must be ``vllm-lens/<model>`` serving the adapter, e.g.
``-M lora_modules=oracle=smollm2-135m-oracle``. The answer becomes ``state.output``, an
assistant message (metadata ``activation_oracle``) and ``state.store["lens_evals:oracle"]``.
With ``zero_vector_baseline`` the same prompt is also answered with nothing injected."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from inspect_ai.model import ChatMessageUser, GenerateConfig, ModelOutput, get_model
from inspect_ai.solver import Generate, Solver, TaskState, solver

from lens_evals.inspect_kit.provider.outputs import output_activations
from lens_evals.oracle.inference import OracleSettings, injection_vector
from lens_evals.oracle.prompt import check_single_token, oracle_messages, placeholder_positions, select_positions
from lens_evals.request.spec import CAPTURE_KEY, STEERING_KEY

ORACLE_STORE_KEY = "lens_evals:oracle"
QUESTION_METADATA_KEY = "oracle_question"


def _lens_api(model: Any) -> Any:
    api = model.api
    if not (hasattr(api, "tokenize") and hasattr(api, "served_models")):  # Inspect's ModelAPI has tokenize now
        raise RuntimeError(f"activation_oracle needs a vllm-lens/<model> model, got {model}")
    return api


async def _capture(model: Any, state: TaskState, layer: int) -> np.ndarray:
    config = GenerateConfig(max_tokens=1, temperature=0.0, extra_body={"extra_args": {CAPTURE_KEY: [layer]}})
    output = await model.generate(state.messages, config=config)
    stream = output_activations(output, "residual_stream", keep=True)["residual_stream"]
    acts: np.ndarray = stream[0].float().numpy()  # (n_prompt, hidden): one token generated
    return acts


async def _ask(model: Any, prompt: str, lora: str, vector: Any, max_tokens: int, expected_tokens: int) -> ModelOutput:
    extra_body: dict[str, Any] = {"lora_request": {"lora_name": lora}}
    if vector is not None:
        extra_body["extra_args"] = {STEERING_KEY: [vector]}
    config = GenerateConfig(max_tokens=max_tokens, temperature=0.0, extra_body=extra_body)
    output: ModelOutput = await model.generate([ChatMessageUser(content=prompt)], config=config)
    if output.usage is not None and output.usage.input_tokens != expected_tokens:
        raise RuntimeError(
            f"the oracle prompt had {output.usage.input_tokens} tokens, not the {expected_tokens} the placeholder "
            "positions were computed for (a system message added by the config?)"
        )
    return output


async def check_serves(model: Any, lora: str) -> None:
    if lora not in await _lens_api(model).served_models():
        raise RuntimeError(f"the server does not serve the adapter {lora!r}; start it with -M lora_modules={lora}=PATH_OR_ORACLE_NAME")


async def ask_oracle(
    model: Any, acts: np.ndarray, question: str, settings: OracleSettings, lora: str, max_tokens: int, zero_vector_baseline: bool = False
) -> tuple[ModelOutput, dict[str, Any]]:
    """Ask the adapter ``lora`` (served beside ``model``) ``question`` about ``acts`` (K, hidden),
    read after ``settings.target_layer``; the answer and a record of what was asked and injected."""
    api = _lens_api(model)
    messages = oracle_messages(settings.target_layer, acts.shape[0], question, settings.placeholder)
    placeholder_id = check_single_token(settings.placeholder, await api.tokenize(text=settings.placeholder))
    prompt_ids = await api.tokenize(messages=messages)
    positions = placeholder_positions(prompt_ids, placeholder_id, acts.shape[0])
    prompt = messages[0]["content"]
    output = await _ask(model, prompt, lora, injection_vector(acts, positions, settings), max_tokens, len(prompt_ids))
    record: dict[str, Any] = {
        "question": question,
        "answer": output.completion,
        "lora": lora,
        "target_layer": settings.target_layer,
        "injection_layer": settings.injection_layer,
        "num_positions": int(acts.shape[0]),
        "positions": positions,
        "coefficient": settings.coefficient,
        "placeholder": settings.placeholder,
        "mean_vector_norm": round(float(np.linalg.norm(acts, axis=-1).mean()), 3),
    }
    if zero_vector_baseline:
        baseline = await _ask(model, prompt, lora, None, max_tokens, len(prompt_ids))
        record["zero_vector_answer"] = baseline.completion
    return output, record


@solver
def activation_oracle(
    question: str | None = None,
    target_layer: int = 15,
    injection_layer: int = 1,
    placeholder: str = " ?",
    num_tokens: int | None = None,
    lora: str = "oracle",
    coefficient: float = 1.0,
    max_tokens: int = 8,
    zero_vector_baseline: bool = False,
    base_model: str | None = None,
) -> Solver:
    """Ask ``question`` (or the sample's ``metadata["oracle_question"]``) about the target's
    activations after ``target_layer``: all positions of the conversation's prompt, or the last
    ``num_tokens``. ``lora`` is the adapter name the server serves. ``base_model``: the model the
    oracle was trained on (its card's); another evaluated model is refused."""
    settings = OracleSettings(target_layer, injection_layer, num_tokens, placeholder, coefficient)

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        model = get_model()
        if base_model and Path(base_model).name != Path(model.name).name:
            raise ValueError(
                f"oracle trained on {base_model}, not on the evaluated model {model.name}: its settings (target layer "
                f"{target_layer}, placeholder, coefficient) and adapter mean nothing there"
            )
        asked = question or (state.metadata or {}).get(QUESTION_METADATA_KEY)
        if not asked:
            raise ValueError(f"no question: pass question= or set the sample's metadata[{QUESTION_METADATA_KEY!r}]")
        await check_serves(model, lora)
        stream = await _capture(model, state, target_layer)
        acts = stream[select_positions(stream.shape[0], num_tokens)]
        output, record = await ask_oracle(model, acts, asked, settings, lora, max_tokens, zero_vector_baseline)
        state.store.set(ORACLE_STORE_KEY, record)
        message = output.message.model_copy(update={"metadata": {**(output.message.metadata or {}), "activation_oracle": record}})
        output.choices[0].message = message
        state.messages.append(message)
        state.output = output
        return state

    return solve
