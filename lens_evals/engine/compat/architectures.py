"""Per architecture: how the residual stream is read from a vLLM decoder layer and written back.

The residual stream after layer i is what HF transformers calls ``hidden_states[i + 1]`` (for
the last layer: the input of the final norm). vLLM's decoder layers hand that stream to the
next layer in different ways, and nothing in a layer's output says which: a 2-tuple may be
``(hidden, residual)`` whose SUM is the stream, or ``(stream, something else)``. So the
contract of each decoder-layer class is written down here, read off vLLM's own model file
(cited per entry), and trusted only once the architecture matrix (tests/engine/test_architectures.py)
has compared capture, steering, hooks and probes with HF transformers. A model whose
architecture is not in ``VERIFIED`` serves plain requests as usual; its lens requests are
refused with ``refusal_message`` unless ``LENS_EVALS_TRUST_ARCH=1``.

Adding an architecture: docs/model_support.md ("Adding an architecture").
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lens_evals import settings
from lens_evals.engine.compat._base import logger

__all__ = [
    "Architecture",
    "FUSED",
    "LayerSupport",
    "STREAM",
    "STREAM_FIRST",
    "StreamContract",
    "TRUST_ENV",
    "VERIFIED",
    "architecture_of",
    "class_name",
    "find_decoder_layers",
    "frontend_refusal",
    "guessed",
    "layer_support",
    "refusal_message",
    "trust_unverified",
]

TRUST_ENV = settings.TRUST_ARCH.name


@dataclass(frozen=True)
class StreamContract:
    """How one decoder-layer class carries the residual stream.

    ``kind``:
      * ``"fused"``: the layer returns ``(hidden, residual)`` and the stream is their sum (vLLM's
        fused add + norm: the next layer adds them first). A residual of None means the stream
        is ``hidden`` alone.
      * ``"stream"``: the layer returns the stream itself (a tensor).
      * ``"stream_first"``: the layer returns a tuple whose FIRST element is the whole stream;
        the other elements are something else (e.g. StableLM's stream before the MLP) and are
        never added to it.
    ``hidden_arg`` / ``residual_arg``: the names of the layer's ``forward`` parameters that carry
    the incoming stream (bound by signature, since the argument order differs between models).
    """

    kind: str
    hidden_arg: str = "hidden_states"
    residual_arg: str | None = "residual"

    def read_output(self, output: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) of a layer's output, as (tokens, hidden) rows: the stream is hidden +
        residual (residual None: hidden alone). ``hidden`` is (a view of) the tensor the next
        layer reads: writing into it in place moves the stream."""
        if self.kind == "fused":
            if isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor):
                return _rows(output[0]), None if output[1] is None else _rows(output[1])
        elif self.kind == "stream":
            if isinstance(output, torch.Tensor):
                return _rows(output), None
        elif isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return _rows(output[0]), None
        raise TypeError(f"lens_evals: a {self.kind!r} decoder layer returned {_describe(output)}")

    def write_output(self, output: Any, hidden: torch.Tensor) -> Any:
        """The layer's output with its stream part replaced by ``hidden`` ((tokens, hidden) rows)."""
        first = output[0] if isinstance(output, tuple) else output
        new = hidden.view(first.shape) if first.dim() != hidden.dim() else hidden
        return (new,) + tuple(output[1:]) if isinstance(output, tuple) else new

    def read_input(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual) rows entering a layer: the stream after the previous layer (the
        embeddings at layer 0)."""
        bound = _bind(type(layer), args, kwargs)
        hidden = bound.get(self.hidden_arg)
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"lens_evals: decoder layer called without a {self.hidden_arg!r} tensor")
        residual = bound.get(self.residual_arg) if self.residual_arg else None
        return _rows(hidden), _rows(residual) if isinstance(residual, torch.Tensor) else None


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """(tokens, hidden) rows: transformers' layers (vLLM's Transformers backend) see the step as
    one sequence of a batch of 1, (1, tokens, hidden); a view, so writes reach the layer's tensor."""
    return tensor[0] if tensor.dim() == 3 and tensor.shape[0] == 1 else tensor


FUSED = StreamContract("fused")
STREAM = StreamContract("stream", residual_arg=None)
STREAM_FIRST = StreamContract("stream_first", residual_arg=None)


@dataclass(frozen=True)
class Architecture:
    """A verified architecture: the decoder-layer class vLLM builds for it (``module.Class``,
    the module's last dotted part) and that class's contract; ``source``: where vLLM says it."""

    layer_class: str
    contract: StreamContract
    source: str
    graph_mode: bool = False  # graph-mode taps verified (tests/engine/test_architectures.py GRAPH, on the GPU)


def _vllm(layer_class: str, contract: StreamContract, note: str = "", graph_mode: bool = False) -> Architecture:
    module = layer_class.split(".")[0]
    return Architecture(layer_class, contract, f"vllm/model_executor/models/{module}.py {note}".strip(), graph_mode)


def _hf(layer_class: str, graph_mode: bool = False, note: str = "") -> Architecture:
    """Served by vLLM's Transformers backend: the decoder layers are transformers' own, which
    return the stream (transformers 5: ``hidden_states = residual + mlp(...)``; ``return
    hidden_states``)."""
    module = layer_class.split(".")[0]
    return Architecture(
        layer_class,
        STREAM,
        f"vllm/model_executor/models/transformers/ + transformers/models/{module.removeprefix('modeling_')}/{module}.py {note}".strip(),
        graph_mode,
    )


# HF architecture name (config.json "architectures") -> verified contract. Each entry was read off
# vLLM 0.32's model file (the line it cites: the decoder layer's return and the model's layer
# loop) and checked against vLLM 0.26; the matrix test proves it. Keep alphabetical.
VERIFIED: dict[str, Architecture] = {
    # -- fused: the layer returns (hidden, residual); the model ends with norm(hidden, residual)
    "AfmoeForCausalLM": _vllm("afmoe.AfmoeDecoderLayer", FUSED),
    "ApertusForCausalLM": _vllm("apertus.ApertusDecoderLayer", FUSED),
    "DeepseekV2ForCausalLM": _vllm("deepseek_v2.DeepseekV2DecoderLayer", FUSED, "(MLA + MoE; verified on the GPU)", graph_mode=True),
    "DeepseekV3ForCausalLM": _vllm("deepseek_v2.DeepseekV2DecoderLayer", FUSED, "(MLA + MoE, the Kimi-K2 family; verified on the GPU)"),
    "Ernie4_5ForCausalLM": _vllm("llama.LlamaDecoderLayer", FUSED, "(ernie45.py: Ernie4_5ForCausalLM(LlamaForCausalLM))"),
    "ExaoneMoeForCausalLM": _vllm("exaone_moe.ExaoneMoeDecoderLayer", FUSED),
    "Gemma2ForCausalLM": _vllm(
        "gemma2.Gemma2DecoderLayer", FUSED, "(post-norms inside the layer; norm(hidden, residual))", graph_mode=True
    ),
    "Gemma3ForCausalLM": _vllm("gemma3.Gemma3DecoderLayer", FUSED, graph_mode=True),
    "GemmaForCausalLM": _vllm("gemma.GemmaDecoderLayer", FUSED),
    "Glm4ForCausalLM": _vllm("glm4.Glm4DecoderLayer", FUSED, "(Glm4Model(LlamaModel))", graph_mode=True),
    "Glm4MoeForCausalLM": _vllm("glm4_moe.Glm4MoeDecoderLayer", FUSED, graph_mode=True),
    "GptOssForCausalLM": _vllm("gpt_oss.TransformerBlock", FUSED, "(called as layer(x, positions, residual): bound by name)"),
    "HYV3ForCausalLM": _vllm("hy_v3.HYV3DecoderLayer", FUSED, "(the model adds hidden + residual before its norm)"),
    "Llama4ForCausalLM": _vllm("llama4.Llama4DecoderLayer", FUSED, "(Llama4Model(LlamaModel))"),
    "LlamaForCausalLM": _vllm(
        "llama.LlamaDecoderLayer", FUSED, "(return hidden_states, residual; norm(hidden, residual))", graph_mode=True
    ),
    "MiMoV2FlashForCausalLM": _vllm("mimo_v2.MiMoV2FlashDecoderLayer", FUSED),
    "Ministral3ForCausalLM": _vllm("mistral.MistralDecoderLayer", FUSED, "(MistralModel(LlamaModel))"),
    "MistralForCausalLM": _vllm("mistral.MistralDecoderLayer", FUSED, "(MistralModel(LlamaModel))", graph_mode=True),
    "MixtralForCausalLM": _vllm("mixtral.MixtralDecoderLayer", FUSED, graph_mode=True),
    "NemotronForCausalLM": _vllm("nemotron.NemotronDecoderLayer", FUSED),
    "OlmoeForCausalLM": _vllm("olmoe.OlmoeDecoderLayer", FUSED),
    "Phi3ForCausalLM": _vllm("llama.LlamaDecoderLayer", FUSED, "(phi3.py: Phi3ForCausalLM(LlamaForCausalLM))", graph_mode=True),
    "Qwen2ForCausalLM": _vllm("qwen2.Qwen2DecoderLayer", FUSED, graph_mode=True),
    "Qwen2MoeForCausalLM": _vllm("qwen2_moe.Qwen2MoeDecoderLayer", FUSED),
    "Qwen3ForCausalLM": _vllm("qwen3.Qwen3DecoderLayer", FUSED, "(Qwen3Model(Qwen2Model))", graph_mode=True),
    "Qwen3MoeForCausalLM": _vllm("qwen3_moe.Qwen3MoeDecoderLayer", FUSED, graph_mode=True),
    # -- stream: the layer returns the stream; the model ends with norm(hidden_states)
    "BloomForCausalLM": _vllm("bloom.BloomBlock", STREAM),
    "FalconForCausalLM": _vllm("falcon.FalconDecoderLayer", STREAM),
    "GPT2LMHeadModel": _vllm("gpt2.GPT2Block", STREAM, "(hidden_states = layer(hidden_states); ln_f(hidden_states))"),
    "GPTJForCausalLM": _vllm("gpt_j.GPTJBlock", STREAM),
    "GraniteForCausalLM": _vllm("granite.GraniteDecoderLayer", STREAM, "(residual_multiplier inside the layer)", graph_mode=True),
    "GraniteMoeForCausalLM": _vllm("granitemoe.GraniteMoeDecoderLayer", STREAM),
    "GraniteMoeSharedForCausalLM": _vllm("granitemoeshared.GraniteMoeSharedDecoderLayer", STREAM),
    "GraniteMoeSWAForCausalLM": _vllm("granitemoeshared.GraniteMoeSharedDecoderLayer", STREAM),
    "GraniteSWAForCausalLM": _vllm("granite.GraniteDecoderLayer", STREAM),
    "OPTForCausalLM": _vllm("opt.OPTDecoderLayer", STREAM),
    # -- stream via vLLM's Transformers backend: transformers' own decoder layers
    "ArceeForCausalLM": _hf("modeling_arcee.ArceeDecoderLayer"),
    "CwmForCausalLM": _hf("modeling_cwm.CwmDecoderLayer"),
    "FlexOlmoForCausalLM": _hf("modeling_flex_olmo.FlexOlmoDecoderLayer"),
    "Gemma3ForConditionalGeneration": _hf(
        "modeling_gemma3.Gemma3DecoderLayer",
        note="(the language tower, with model_impl='transformers'; vLLM's own gemma3_mm builds gemma3.Gemma3DecoderLayer, not verified)",
    ),
    "GlmForCausalLM": _hf("modeling_glm.GlmDecoderLayer"),
    "GPTBigCodeForCausalLM": _hf("modeling_gpt_bigcode.GPTBigCodeBlock"),
    "GPTNeoXForCausalLM": _hf("modeling_gpt_neox.GPTNeoXLayer"),
    "HunYuanDenseV1ForCausalLM": _hf("modeling_hunyuan_v1_dense.HunYuanDenseV1DecoderLayer"),
    "HunYuanMoEV1ForCausalLM": _hf("modeling_hunyuan_v1_moe.HunYuanMoEV1DecoderLayer"),
    "Jais2ForCausalLM": _hf("modeling_jais2.Jais2DecoderLayer"),
    "MellumForCausalLM": _hf("modeling_mellum.MellumDecoderLayer"),
    "Olmo2ForCausalLM": _hf("modeling_olmo2.Olmo2DecoderLayer", graph_mode=True),
    "Olmo3ForCausalLM": _hf("modeling_olmo3.Olmo3DecoderLayer"),
    "OlmoForCausalLM": _hf("modeling_olmo.OlmoDecoderLayer"),
    "PhiForCausalLM": _hf("modeling_phi.PhiDecoderLayer"),
    "SeedOssForCausalLM": _hf("modeling_seed_oss.SeedOssDecoderLayer"),
    "SmolLM3ForCausalLM": _hf("modeling_smollm3.SmolLM3DecoderLayer"),
    "Starcoder2ForCausalLM": _hf("modeling_starcoder2.Starcoder2DecoderLayer"),
    "VaultGemmaForCausalLM": _hf("modeling_vaultgemma.VaultGemmaDecoderLayer"),
    # -- stream_first: the layer returns (stream, X) and X is never added (the model ends with
    #    norm(hidden_states)); several of these take a `residual` argument they ignore
    "CohereForCausalLM": _vllm(
        "commandr.CohereDecoderLayer", STREAM_FIRST, "(residual argument ignored; its LayerNorm passes the residual through, never adds it)"
    ),
    "Exaone4ForCausalLM": _vllm("exaone4.Exaone4DecoderLayer", STREAM_FIRST, "(post-LN; returns the stream and the stream before the MLP)"),
    "Gemma4ForCausalLM": _vllm("gemma4.Gemma4DecoderLayer", STREAM_FIRST, "(return hidden_states, None)"),
    "HyperCLOVAXForCausalLM": _vllm("hyperclovax.HyperCLOVAXDecoderLayer", STREAM_FIRST, "(muP: the residual argument is reset)"),
    "MiniCPM3ForCausalLM": _vllm("minicpm3.MiniCPM3DecoderLayer", STREAM_FIRST, "(MiniCPMDecoderLayer's forward)"),
    "StableLmForCausalLM": _vllm(
        "stablelm.StablelmDecoderLayer",
        STREAM_FIRST,
        "(return hidden_states, residual: residual is the stream before the MLP, never added)",
    ),
}


def guessed(layer: nn.Module) -> StreamContract:
    """With LENS_EVALS_TRUST_ARCH=1 only: a contract guessed, never verified. A layer class from
    transformers (vLLM's Transformers backend builds transformers' own layers) returns the stream
    (``_hf``); otherwise it is read from the signature (a ``residual`` parameter means vLLM's fused
    residual, else the stream as the first of a tuple)."""
    names = set(_forward_signature(type(layer).forward).parameters) - {"self"}
    hidden_arg = "hidden_states" if "hidden_states" in names else next(iter(names), "hidden_states")
    if _from_transformers(type(layer)):
        return StreamContract("stream", hidden_arg=hidden_arg, residual_arg=None)
    if "residual" in names:
        return StreamContract("fused", hidden_arg=hidden_arg)
    return StreamContract("stream_first", hidden_arg=hidden_arg, residual_arg=None)


def _from_transformers(cls: type) -> bool:
    """A transformers decoder-layer class, or a subclass of one (its own modules, not remote code's
    ``transformers_modules``)."""
    return any(base.__module__.split(".", 1)[0] == "transformers" for base in cls.__mro__)


def trust_unverified() -> bool:
    return settings.TRUST_ARCH.get()


def class_name(cls: type) -> str:
    """``module.Class`` with the module's last dotted part: how VERIFIED names layer classes."""
    return f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}"


def architecture_of(model_config: Any) -> str:
    """The architecture named by the checkpoint's config.json (vLLM's ModelConfig)."""
    hf_config = model_config.hf_config
    names = list(getattr(hf_config, "architectures", None) or [])
    return names[0] if names else type(hf_config).__name__


def refusal_message(architecture: str, layer_class: str | None) -> str:
    layer = f", decoder layer {layer_class}" if layer_class else ""
    return (
        f"lens requests are not supported on architecture {architecture}{layer}: how its decoder layers "
        "carry the residual stream has not been verified against HF transformers, and a wrong guess gives "
        f"wrong activations silently. Set {TRUST_ENV}=1 on the server / engine process to use a guessed "
        "contract at your own risk, or add the architecture (docs/model_support.md, 'Adding an architecture')"
    )


def frontend_refusal(model_config: Any) -> str | None:
    """Why lens requests on this model are refused (None: verified, or trusted by opt-in)."""
    arch = architecture_of(model_config)
    if arch in VERIFIED or trust_unverified():
        return None
    return refusal_message(arch, _layer_classes_of_model_file(model_config))


def _layer_classes_of_model_file(model_config: Any) -> str | None:
    """For the refusal message only (the frontend has no model): the decoder-layer classes that
    the vLLM model file of this architecture defines (``*DecoderLayer`` / ``*Block``)."""
    import sys

    from vllm.model_executor.model_loader.utils import get_model_architecture

    try:
        model_class, _ = get_model_architecture(model_config)
    except (ValueError, ImportError, AttributeError) as exc:
        logger.debug("lens_evals: could not resolve the model class of %s: %s", architecture_of(model_config), exc)
        return None
    module = sys.modules.get(model_class.__module__)
    names = sorted(
        class_name(value)
        for name, value in vars(module or object).items()
        if isinstance(value, type)
        and issubclass(value, nn.Module)
        and name.endswith(("DecoderLayer", "Block"))
        and value.__module__ == model_class.__module__
    )
    return ", ".join(names) or f"(none in {model_class.__module__}: served by {model_class.__name__})"


def find_decoder_layers(model: nn.Module, num_layers: int) -> Iterator[tuple[int, nn.Module]]:
    """(absolute index, layer) for the decoder layers present on this pipeline stage: the
    ModuleList of ``num_layers`` entries (named ``layers`` in most models, ``h`` in GPT-2 style
    ones). In a multimodal model the vision tower's list can have as many entries (and comes
    first): then the list under ``language_model`` is the one (elsewhere the first found, as
    before: a text-only model has one such list)."""
    from vllm.model_executor.models.utils import PPMissingLayer

    found = [
        (path, child)
        for path, child in model.named_modules()
        if isinstance(child, nn.ModuleList) and len(child) == num_layers and path.rsplit(".", 1)[-1] in ("layers", "h", "blocks")
    ]
    if len(found) > 1:
        found = [(path, child) for path, child in found if "language_model" in path.split(".")] or found
    if not found:
        raise RuntimeError(f"lens_evals: could not find {num_layers} decoder layers in {type(model).__name__}")
    for index, layer in enumerate(found[0][1]):
        if not isinstance(layer, PPMissingLayer):
            yield index, layer


@dataclass(frozen=True)
class LayerSupport:
    """What the worker found: the contract to use, or why lens requests are refused."""

    architecture: str
    layer_class: str | None
    contract: StreamContract | None
    refusal: str | None


def layer_support(model_config: Any, layers: dict[int, nn.Module]) -> LayerSupport:
    arch = architecture_of(model_config)
    found = sorted({class_name(type(layer)) for layer in layers.values()})
    layer_class = ", ".join(found) if found else None
    entry = VERIFIED.get(arch)
    if entry is not None and found == [entry.layer_class]:
        return LayerSupport(arch, layer_class, entry.contract, None)
    if trust_unverified() and len(found) == 1:
        return LayerSupport(arch, layer_class, guessed(next(iter(layers.values()))), None)
    message = refusal_message(arch, layer_class)
    if entry is not None:
        message += f" (verified with decoder layer {entry.layer_class}; this vLLM builds {layer_class})"
    return LayerSupport(arch, layer_class, None, message)


@functools.cache
def _forward_signature(forward: Callable[..., Any]) -> inspect.Signature:
    """The signature of a decoder layer class's ``forward`` (read once per class)."""
    return inspect.signature(forward)


def _bind(layer_type: type[nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The layer's forward arguments by name (``self`` bound to None)."""
    return dict(_forward_signature(layer_type.forward).bind_partial(None, *args, **kwargs).arguments)


def _describe(output: Any) -> str:
    if isinstance(output, tuple):
        return "a tuple of (" + ", ".join(type(item).__name__ for item in output) + ")"
    return type(output).__name__
