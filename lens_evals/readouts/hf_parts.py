"""The pieces of an HF transformers causal LM that fitting needs: its decoder layers, its final
norm and its unembedding (checked against the model's own logits), and the residual stream of
chosen layers (each decoder layer's output: what ``lens-evals capture`` records) from one forward
per prompt. Host side only: no vLLM."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Fn = Callable[[torch.Tensor], torch.Tensor]


class ModelPartsError(RuntimeError):
    """The model's layout is not one fitting knows (the message says what was looked for)."""


@dataclass
class ModelParts:
    model: Any
    decoder: Any  # the module that runs embeddings + layers + final norm (``model.model``)
    layers: Any  # the decoder layers, in order
    final_norm: Fn
    unembed: Fn  # normed stream -> logits (lm_head, soft-capping where the config has it)
    lm_head: Any = None
    softcap: float | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def unembed_subset(self, token_ids: torch.Tensor) -> Fn:
        """``unembed`` restricted to the rows ``token_ids`` of the vocabulary (logits ``[n, len(token_ids)]``)."""
        weight = self.lm_head.weight[token_ids]
        bias = None if getattr(self.lm_head, "bias", None) is None else self.lm_head.bias[token_ids]
        cap = self.softcap

        def unembed(normed: torch.Tensor) -> torch.Tensor:
            logits = torch.nn.functional.linear(normed, weight, bias).float()
            return torch.tanh(logits / cap) * cap if cap else logits

        return unembed

    def head(self, stream: torch.Tensor) -> torch.Tensor:
        """Logits of a last-layer stream (before the final norm)."""
        return self.unembed(self.final_norm(stream))


def model_parts(model: Any) -> ModelParts:
    """The decoder, its layers, final norm and unembedding of ``model`` (Llama-like layouts: the
    decoder at ``model.model`` or ``get_decoder()``, the norm at ``norm`` / ``final_layernorm``)."""
    decoder = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or not hasattr(decoder, "layers"):
        raise ModelPartsError(f"{type(model).__name__}: no decoder with .layers at .model or get_decoder()")
    norm = next((getattr(decoder, name) for name in ("norm", "final_layernorm", "ln_f") if hasattr(decoder, name)), None)
    if norm is None:
        raise ModelPartsError(f"{type(decoder).__name__}: no final norm (looked for norm, final_layernorm, ln_f)")
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else model.lm_head
    cap = getattr(model.config, "final_logit_softcapping", None)

    def unembed(normed: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = lm_head(normed).float()
        return torch.tanh(logits / cap) * cap if cap else logits

    return ModelParts(model, decoder, decoder.layers, norm, unembed, lm_head, cap)


def _output_tensor(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


@torch.no_grad()
def check_head(parts: ModelParts, token_ids: Sequence[int], atol: float = 1e-3) -> None:
    """Raise :class:`ModelPartsError` unless ``head(last layer's stream)`` gives the model's own
    logits on ``token_ids`` (a model with a logit scaling this module does not apply is refused
    rather than fitted against the wrong distribution)."""
    streams = capture_streams(parts, [token_ids], [parts.num_layers - 1], skip_first=0)
    ours = parts.head(streams[parts.num_layers - 1])
    theirs = parts.model(torch.tensor([list(token_ids)])).logits[0].float()
    err = (ours - theirs).abs().max().item()
    if err > atol * max(1.0, theirs.abs().max().item()):
        raise ModelPartsError(
            f"final norm + unembedding differ from the model's logits by {err:.3g}: a logit scaling fitting does not know"
        )


@torch.no_grad()
def capture_streams(
    parts: ModelParts, prompts: Iterable[Sequence[int]], layers: Sequence[int], skip_first: int = 0, progress: bool = False
) -> dict[int, torch.Tensor]:
    """layer -> ``[n_tokens, d]`` float32: the streams of every prompt (one forward each, no
    padding), concatenated, each prompt's first ``skip_first`` positions left out."""
    chosen = sorted(set(layers))
    caught: dict[int, torch.Tensor] = {}
    out: dict[int, list[torch.Tensor]] = {layer: [] for layer in chosen}

    def hook(index: int) -> Callable[..., None]:
        def record(_module: Any, _args: Any, output: Any) -> None:
            caught[index] = _output_tensor(output)[0].float()

        return record

    handles = [parts.layers[layer].register_forward_hook(hook(layer)) for layer in chosen]
    try:
        from tqdm.auto import tqdm

        for ids in tqdm(prompts, desc="streams", disable=not progress):
            caught.clear()
            parts.decoder(input_ids=torch.tensor([list(ids)]))
            for layer in chosen:
                out[layer].append(caught[layer][skip_first:])
    finally:
        for handle in handles:
            handle.remove()
    return {layer: torch.cat(rows) for layer, rows in out.items()}


def load_hf_model(model: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` in float32, eval mode, from an embedded name or a model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lens_evals.models.registry import resolve_model

    path = str(resolve_model(model))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    for parameter in hf.parameters():
        parameter.requires_grad_(False)
    return hf, AutoTokenizer.from_pretrained(path)
