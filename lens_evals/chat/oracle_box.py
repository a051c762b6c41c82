"""The page's "ask the activation oracle" box, over HTTP: the same request path as the Inspect
solver (inspect_kit/oracle_solver.py): capture the target layer on the conversation, build the
oracle prompt, find its placeholders with the server's tokenizer, generate with the adapter while
the engine injects the vectors (oracle.inference.injection_vector)."""

from __future__ import annotations

from typing import Any

from lens_evals.chat.upstream import Upstream
from lens_evals.client import lens_xargs
from lens_evals.oracle.inference import OracleSettings, injection_vector
from lens_evals.oracle.prompt import check_single_token, oracle_messages, placeholder_positions, select_positions


class OracleUnavailable(RuntimeError):
    """The server serves no oracle adapter under the page's name."""


def oracle_settings(card: str | None, target_layer: int | None) -> OracleSettings:
    """From a trained oracle's card (``lens-evals oracle card``), else the solver's defaults."""
    if card:
        from lens_evals.oracle.adapters import read_card

        fields = read_card(card)["oracle"]
        return OracleSettings(**{k: fields[k] for k in ("target_layer", "injection_layer", "num_tokens", "placeholder", "coefficient")})
    return OracleSettings(target_layer=15 if target_layer is None else target_layer)


def ask(
    upstream: Upstream, model: str, lora: str, settings: OracleSettings, messages: list[dict[str, str]], question: str, max_tokens: int = 24
) -> dict[str, Any]:
    served = [entry["id"] for entry in upstream.models()]
    if lora not in served:
        raise OracleUnavailable(
            f"this server serves no activation-oracle adapter named {lora!r} (it serves {served}): start it with "
            f"--enable-lora --lora-modules {lora}=PATH (a trained oracle: `lens-evals oracle path`), or pass --oracle-lora NAME"
        )
    stream = upstream.capture(model, settings.target_layer, messages=messages)
    acts = stream[select_positions(stream.shape[0], settings.num_tokens)]
    prompt = oracle_messages(settings.target_layer, acts.shape[0], question, settings.placeholder)
    placeholder_id = check_single_token(
        settings.placeholder, upstream.tokenize(model, prompt=settings.placeholder, add_special_tokens=False)
    )
    positions = placeholder_positions(upstream.tokenize(model, messages=prompt, add_generation_prompt=True), placeholder_id, acts.shape[0])
    vector = injection_vector(acts, positions, settings)
    body: dict[str, Any] = {"model": lora, "messages": prompt, "max_tokens": max_tokens, "temperature": 0}
    if vector is not None:
        body["vllm_xargs"] = lens_xargs(steering=[vector])
    answer = upstream.post_json("/v1/chat/completions", body)
    return {"answer": answer["choices"][0]["message"]["content"], "target_layer": settings.target_layer, "positions": len(positions)}
