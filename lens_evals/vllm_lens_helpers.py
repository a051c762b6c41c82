"""vllm-lens's six serialisation helpers, under its names and signatures (``from lens_evals import
serialize_tensor, ...``), written from its documented wire format.

A tensor in vllm-lens's form is ``{"data": base64, "dtype": numpy storage dtype, "original_dtype":
"torch.<dtype>", "shape": [...], "compression": "zstd"}`` (bfloat16 stored as int16); a hook result
is ``{hook_index: {key: value}}`` with each tensor as ``{"__type__": "tensor", <tensor form>}``.
Every decoder here reads that form, its uncompressed legacy form and ours (``lens_evals.wire``),
and checks each payload before decoding it. Nothing is ever pickled or unpickled: where vllm-lens
would cloudpickle a hook result (a value that is not JSON or a tensor) ours carries the encoded
tree (lists and dicts holding tensors) or refuses the value, and a cloudpickled value in a response
is refused, saying why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from lens_evals.wire import formats as wire

if TYPE_CHECKING:
    import numpy as np
    import torch

NOT_PICKLED = (
    "vllm-lens would cloudpickle such a value; lens-evals never pickles (unpickling runs code), so a "
    "hook result holds only None, bools, numbers, strings, lists, string-keyed dicts and tensors/arrays"
)


def as_object(value: Any, what: str) -> Mapping[str, Any]:
    """``value`` if it is an object: a response is read as data, its shape checked like its arrays."""
    if not isinstance(value, Mapping):
        raise wire.WireError(f"{what} must be an object, got {type(value).__name__}")
    return value


def serialize_tensor(tensor: torch.Tensor | np.ndarray) -> dict[str, Any]:
    """A tensor (or numpy array) in vllm-lens's form: native dtype, zstd, base64."""
    return wire.encode_vllm_lens(tensor)


def deserialize_tensor(d: Mapping[str, Any]) -> torch.Tensor:
    """vllm-lens's form (compressed or legacy) or ours -> a torch tensor in its native dtype (in a
    client-only install without torch, where vllm-lens cannot run at all: a numpy array)."""
    tensor: torch.Tensor = wire.decode_native(d)
    return tensor


def serialize_activations(tensor_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: tensor}`` -> ``{name: vllm-lens form}``."""
    return {name: serialize_tensor(tensor) for name, tensor in tensor_dict.items()}


def decode_item(
    item: Any, array: Callable[[Any], Any] = wire.decode_native, tree: Callable[[Any], Any] = wire.decode_tree_native
) -> dict[str, Any]:
    """One request's ``activations`` object, each array through ``array`` (by default: a tensor in
    its native dtype, numpy without torch): ``probe_scores`` is {name: array}, ``saved`` (hook
    results) a tree, decoded with ``tree``."""
    out: dict[str, Any] = {}
    for name, encoded in as_object(item, "activations").items():
        if name == "probe_scores":
            out[name] = {probe: array(scores) for probe, scores in as_object(encoded, "probe_scores").items()}
        elif name in ("saved", "readouts"):  # hook results; lens / SAE readouts (name -> {field: array or list})
            out[name] = tree(encoded)
        else:
            out[name] = array(encoded)
    return out


def decode_activations(response_json: Mapping[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
    """``"activations"`` of a completion / chat response (or of a stream's last event) as tensors in
    their native dtype; ``{}`` when absent. A response to several prompts (which vllm-lens's server
    never sends) holds a list, one object per prompt: decoded as a list, in prompt order."""
    raw = as_object(response_json, "a response").get("activations")
    if raw is None:
        return {}
    if isinstance(raw, list):
        return [decode_item(item) for item in raw]
    return decode_item(raw)


def serialize_hook_results(results: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``{hook_index: saved}`` for JSON: tensors as ``{"__type__": "tensor", ...}`` (vllm-lens's
    form), JSON values as they are, lists and dicts holding tensors as encoded trees. Any other
    value is refused (a ``WireError`` saying why), never pickled."""
    out: dict[str, Any] = {}
    for index, saved in as_object(results, "hook results").items():
        try:
            out[index] = wire.encode_tree(dict(as_object(saved, f"hook_results.{index}")), f"hook_results.{index}", encoding=wire.VLLM_LENS)
        except wire.WireError as exc:
            raise wire.WireError(f"{exc}. {NOT_PICKLED}") from None
    return out


def deserialize_hook_results(raw: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Inverse of :func:`serialize_hook_results` (vllm-lens's form or ours; tensors in their native
    dtype). A cloudpickled value is refused with a ``WireError``, never unpickled."""
    return {
        index: dict(as_object(wire.decode_tree_native(saved), f"hook_results.{index}"))
        for index, saved in as_object(raw, "hook_results").items()
    }
