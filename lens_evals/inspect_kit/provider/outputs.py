"""What a lens request leaves in Inspect's ``ModelOutput.metadata``, and the one way to read it.

The provider puts the decoded activations under ``"activations"`` (``residual_stream``: a torch
tensor, a numpy array in a client-only install; ``probe_scores``: {probe name: per-token scores};
``saved``: hook results), the server's token ids under ``"token_ids"`` (``prompt``, ``completion``;
also ``"prompt_token_ids"``, vllm-lens's key), the request's own hook results under
``"hook_results"`` and, asked for with vLLM's ``prompt_logprobs``, each prompt token's log-probability
under ``"prompt_logprobs"``. Solvers take arrays and ids out of the output once read, so the ``.eval`` log
stays small."""

from __future__ import annotations

from typing import Any

from lens_evals.vllm_lens_helpers import decode_item
from lens_evals.wire import formats as wire

ACTIVATIONS_KEY = "activations"
TOKEN_IDS_KEY = "token_ids"  # {"prompt": [...], "completion": [...]} with return_token_ids
PROMPT_TOKEN_IDS_KEY = "prompt_token_ids"  # the prompt's ids again, under vllm-lens's key
HOOK_RESULTS_KEY = "hook_results"  # {hook index: saved}, vllm-lens's key
PROMPT_LOGPROBS_KEY = "prompt_logprobs"  # with prompt_logprobs in extra_body: one float per prompt token (None first)
NOT_A_LENS_MODEL = "use a vllm-lens/<model> model"


def decode_activations(raw: Any) -> dict[str, Any]:
    """Torch tensors in the model's dtype; numpy arrays in a client-only install without torch.
    Every encoding the server sends, vllm-lens's per-tensor form included ("probe_scores" is
    {name: array}, "saved" a tree)."""
    if isinstance(raw, list):
        raw = raw[0]
    return decode_item(raw or {})


def decode_hook_results(raw: Any) -> dict[str, Any]:
    """{hook index: saved}, each a tree with its tensors decoded (as :func:`decode_activations`)."""
    decoded: dict[str, Any] = wire.decode_tree_native(raw or {})
    return decoded


def _metadata(output: Any) -> dict[str, Any]:
    metadata = getattr(output, "metadata", None) if output is not None else None
    return metadata if metadata is not None else {}


def output_activations(output: Any, wanted: str, *, keep: bool = False) -> dict[str, Any]:
    """The activations of ``output`` (a ``ModelOutput``), which must hold ``wanted``
    (``"residual_stream"``, ``"probe_scores"``, ``"saved"``), or a RuntimeError that says so.
    They are taken out of the output (Inspect would log them with it) unless ``keep``."""
    metadata = _metadata(output)
    activations = metadata.get(ACTIVATIONS_KEY) if keep else metadata.pop(ACTIVATIONS_KEY, None)
    if not activations or wanted not in activations:
        found = f"only {sorted(activations)}" if activations else "none"
        raise RuntimeError(f"the model returned no {wanted.replace('_', ' ')} (activations: {found}): {NOT_A_LENS_MODEL}")
    return dict(activations)


def output_token_ids(output: Any) -> dict[str, list[int]]:
    """The server's token ids (asked for with ``return_token_ids``), taken out of the output."""
    metadata = _metadata(output)
    metadata.pop(PROMPT_TOKEN_IDS_KEY, None)
    token_ids = metadata.pop(TOKEN_IDS_KEY, None)
    if not token_ids:
        raise RuntimeError(f"the server returned no token ids (return_token_ids): {NOT_A_LENS_MODEL}")
    return dict(token_ids)


def prompt_token_logprobs(entries: list[Any], prompt_ids: list[int]) -> list[float | None]:
    """vLLM's ``prompt_logprobs`` (per prompt token: None, or {token id: {"logprob", ...}} holding at
    least that token) as the log-probability of each prompt token (None for the first)."""
    if len(entries) != len(prompt_ids):
        raise RuntimeError(f"the server sent {len(entries)} prompt log-probs for {len(prompt_ids)} prompt tokens")
    values: list[float | None] = []
    for entry, token in zip(entries, prompt_ids):
        if entry is None:
            values.append(None)
            continue
        chosen = entry.get(str(token), entry.get(token)) if isinstance(entry, dict) else None
        if not isinstance(chosen, dict) or "logprob" not in chosen:
            raise RuntimeError(f"the server's prompt log-probs lack prompt token {token}")
        values.append(float(chosen["logprob"]))
    return values


def output_prompt_logprobs(output: Any) -> list[float | None]:
    """Each prompt token's log-probability (None for the first), asked for with
    ``extra_body={"prompt_logprobs": 0}``; taken out of the output."""
    values = _metadata(output).pop(PROMPT_LOGPROBS_KEY, None)
    if values is None:
        raise RuntimeError(f"the server returned no prompt log-probs (prompt_logprobs): {NOT_A_LENS_MODEL}")
    return list(values)
