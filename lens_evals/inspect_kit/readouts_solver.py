"""Solver that attaches the worker's readouts (docs/readouts.md: lens top tokens per layer, SAE
latents) of the model's response to ``ModelOutput.metadata["readouts"]``, so they are in the
``.eval`` log (``EvalSample.output``) and in ``lens-evals report``.

The model answers with ``output_readouts`` in its request (the provider's ``extra_args`` path,
encoded by ``provider/xargs.py``); the worker computes the readouts in the step and only their
top-k come back. Each response token is read where the model chose it: at the position before
it (the last prompt token for the first one), as the chat page does; at the last layer the logit
lens's top-1 is the token the model then sampled greedily.

The form left in the metadata (:class:`ResponseReadouts`, plain JSON; names as the request
contract's output)::

    {"response": {"token_ids": [...], "tokens": [...], "positions": [...]},   # n response tokens
     "lens": {name: {"layers": [...], "token_ids": [[[...]]], "logprobs": [[[...]]]}},  # (n_layers, n, top_k)
     "sae": {name: {"layer": i, "latent_ids": [[...]], "values": [[...]]}},              # (n, top_k); id -1: value 0
     "token_texts": {"<id>": text}}                                         # every id in "lens"

``positions[j]`` is the absolute row (prompt tokens counted from 0) that response token ``j``
was read at. Values are float32, written with their shortest float32 form."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
from inspect_ai.solver import Generate, Solver, TaskState, solver
from pydantic import ValidationError

from lens_evals.inspect_kit.probe_reading import decoded_texts
from lens_evals.inspect_kit.probe_solver import served_tokenizer
from lens_evals.inspect_kit.provider.outputs import (
    ACTIVATIONS_KEY,
    PROMPT_TOKEN_IDS_KEY,
    TOKEN_IDS_KEY,
    output_activations,
    output_token_ids,
)
from lens_evals.request.readouts import LensReadout, Readout, SaeReadout, validation_messages
from lens_evals.request.spec import READOUTS_KEY

READOUTS_METADATA_KEY = "readouts"
TOKEN_ID_KEYS = (TOKEN_IDS_KEY, PROMPT_TOKEN_IDS_KEY)


class ResponseTokens(TypedDict):
    token_ids: list[int]
    tokens: list[str]  # the text each token adds to the response
    positions: list[int]  # the row each token was read at (its own position - 1)


class LensRows(TypedDict):
    layers: list[int]
    token_ids: list[list[list[int]]]  # (n_layers, n_tokens, top_k), by log-prob descending
    logprobs: list[list[list[float]]]


class SaeRows(TypedDict):
    layer: int
    latent_ids: list[list[int]]  # (n_tokens, top_k), by value descending; -1 where fewer are active
    values: list[list[float]]


class ResponseReadouts(TypedDict):
    response: ResponseTokens
    lens: dict[str, LensRows]
    sae: dict[str, SaeRows]
    token_texts: dict[str, str]  # token id (as a string: JSON keys) -> its text, for every lens id


def _float32_list(array: Any) -> Any:
    """Nested lists of floats, each the shortest decimal that reads back as the same float32."""
    return np.asarray(array, dtype=np.float32).astype(str).astype(np.float64).tolist()


def _lens_readout(lens: str | Path | LensReadout | None, layers: Sequence[int] | Literal["all"], top_k: int) -> LensReadout | None:
    if lens is None or isinstance(lens, LensReadout):
        return lens
    if str(lens) == "logit":
        return LensReadout(name="logit", layers=layers if layers == "all" else list(layers), top_k=top_k)
    from lens_evals.readouts.requests import lens_readout

    return lens_readout(lens, layers=layers, top_k=top_k)


def _sae_readout(sae: str | Path | SaeReadout | None, top_k: int) -> SaeReadout | None:
    if sae is None or isinstance(sae, SaeReadout):
        return sae
    from lens_evals.readouts.requests import sae_readout

    return sae_readout(sae, top_k=top_k)


def build_readouts(
    lens: str | Path | LensReadout | None,
    sae: str | Path | SaeReadout | None,
    layers: Sequence[int] | Literal["all"],
    top_k: int,
    sae_top_k: int,
) -> list[Readout]:
    """The request's readouts; a ValueError naming the argument for one that cannot be made."""
    readouts: list[Readout] = []
    for what, make in (("lens", lambda: _lens_readout(lens, layers, top_k)), ("sae", lambda: _sae_readout(sae, sae_top_k))):
        try:
            made = make()
        except ValidationError as exc:
            raise ValueError(f"lens_readouts({what}=...): {validation_messages(exc)}") from None
        except (ValueError, OSError) as exc:  # a file that cannot be read
            raise ValueError(f"lens_readouts({what}=...): {exc}") from None
        if made is not None:
            readouts.append(made)
    if not readouts:
        raise ValueError("lens_readouts: give a lens, an SAE or both")
    if len({r.name for r in readouts}) < len(readouts):
        raise ValueError(f"lens_readouts: the lens and the SAE readout share the name {readouts[0].name!r}; names must differ")
    return readouts


def response_readouts(readouts: dict[str, Any], prompt_ids: list[int], completion_ids: list[int], tok: Any) -> ResponseReadouts:
    """The engine's readouts of every position (``activations["readouts"]``) cut to the response's
    tokens, each at the position before it, in the logged form."""
    n = len(completion_ids)
    positions = [len(prompt_ids) - 1 + j for j in range(n)]
    lens: dict[str, LensRows] = {}
    sae: dict[str, SaeRows] = {}
    for name, fields in readouts.items():
        ids_key, values_key = ("token_ids", "logprobs") if "layers" in fields else ("latent_ids", "values")
        ids, values = np.asarray(fields[ids_key]), np.asarray(fields[values_key], dtype=np.float32)
        rows = ids.shape[-2]
        if positions and positions[-1] >= rows:
            raise RuntimeError(
                f"readout {name!r} has {rows} positions; the {len(prompt_ids)} prompt and {n} response tokens need {positions[-1] + 1}"
            )
        if "layers" in fields:
            lens[name] = {
                "layers": [int(layer) for layer in fields["layers"]],
                "token_ids": ids[:, positions].astype(int).tolist(),
                "logprobs": _float32_list(values[:, positions]),
            }
        else:
            sae[name] = {
                "layer": int(fields["layer"]),
                "latent_ids": ids[positions].astype(int).tolist(),
                "values": _float32_list(values[positions]),
            }
    shown = sorted({int(i) for rows_ in lens.values() for i in np.asarray(rows_["token_ids"], dtype=np.int64).ravel()})
    texts = tok.batch_decode([[i] for i in shown]) if shown else []
    return {
        "response": {"token_ids": list(completion_ids), "tokens": decoded_texts(tok, prompt_ids, completion_ids), "positions": positions},
        "lens": lens,
        "sae": sae,
        "token_texts": {str(i): text for i, text in zip(shown, texts)},
    }


@solver
def lens_readouts(
    lens: str | Path | LensReadout | None = "logit",
    sae: str | Path | SaeReadout | None = None,
    layers: Sequence[int] | Literal["all"] = "all",
    top_k: int = 10,
    sae_top_k: int = 16,
    tokenizer: str | None = None,
    **generate_args: Any,
) -> Solver:
    """Generate, asking the worker for readouts of the response, left in
    ``state.output.metadata["readouts"]`` (module docstring).

    ``lens``: ``"logit"`` (the logit lens), an affine lens file (``lens-evals readouts fit-tuned`` /
    ``fit-jacobian``), a :class:`LensReadout`, or None. ``sae``: an SAE-Lens folder, an
    :class:`SaeReadout`, or None. ``layers`` and ``top_k``: the lens's (``"all"``: every layer, or
    every layer of the lens file); ``sae_top_k``: the SAE's. ``tokenizer``: a local model directory
    or embedded model name whose tokenizer matches the served model (default: the evaluated model's
    name), for the tokens' texts. Other keyword arguments go to ``generate`` (``max_tokens``, an
    ``extra_body`` whose ``extra_args`` may carry other lens fields, ...)."""
    readouts = build_readouts(lens, sae, layers, top_k, sae_top_k)

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        given = dict(generate_args.get("extra_body") or {})
        extra_body = {**given, "extra_args": {**given.get("extra_args", {}), READOUTS_KEY: readouts}, "return_token_ids": True}
        state = await generate(state, **{**generate_args, "extra_body": extra_body})
        asked = {k: v for k, v in (state.output.metadata or {}).items() if k in TOKEN_ID_KEYS} if _asks_token_ids(given) else {}
        others = output_activations(state.output, "readouts")
        got = others.pop("readouts")
        token_ids = output_token_ids(state.output)
        logged = response_readouts(got, token_ids["prompt"], token_ids["completion"], served_tokenizer(state, tokenizer))
        # what the solver does not own stays as the provider leaves it without the solver: other
        # activations (probe scores, a capture) and the token ids the caller's request gets
        metadata = {**(state.output.metadata or {}), **asked, **({ACTIVATIONS_KEY: others} if others else {})}
        if state.output.metadata is not None:  # the model event's copy of this output shares this dict
            state.output.metadata.update(metadata)
        # a new dict for the readouts: the model event need not log them twice
        state.output.metadata = {**metadata, READOUTS_METADATA_KEY: logged}
        return state

    return solve


def _asks_token_ids(extra_body: dict[str, Any]) -> bool:
    """Whether the caller's own ``extra_body`` gets the token ids from the provider (it asks for
    them with other lens fields or prompt log-probs, unless told not to)."""
    default = bool(extra_body.get("extra_args")) or extra_body.get("prompt_logprobs") is not None
    return bool(extra_body.get("return_token_ids", default))
