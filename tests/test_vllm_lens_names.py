"""Issue #43: vllm-lens's public names at our package root, each against an independent reader
and writer of vllm-lens's documented wire form (written here from its format: base64 of the zstd
of the tensor's bytes, ``dtype`` the numpy storage dtype, bfloat16 stored as int16 with
``original_dtype``; hook-result tensors tagged ``"__type__": "tensor"``), and the table of names in
docs/vllm_lens.md, each row resolved and its test found."""

from __future__ import annotations

import base64
import importlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zstandard

import lens_evals
from lens_evals.request.hooks import Hook
from lens_evals.wire import formats as wire

ROOT = Path(__file__).resolve().parent.parent
HELPERS = [
    "decode_activations",
    "deserialize_hook_results",
    "deserialize_tensor",
    "serialize_activations",
    "serialize_hook_results",
    "serialize_tensor",
]
STORAGE = {torch.bfloat16: torch.int16}  # numpy has no bfloat16: its bits travel as int16


def their_tensor(tensor: torch.Tensor, compress: bool = True) -> dict[str, Any]:
    """vllm-lens's documented tensor form, built without our code."""
    array = tensor.view(STORAGE.get(tensor.dtype, tensor.dtype)).numpy()
    data = array.tobytes()
    out = {"dtype": str(array.dtype), "original_dtype": str(tensor.dtype), "shape": list(array.shape)}
    if compress:
        return {"data": base64.b64encode(zstandard.ZstdCompressor().compress(data)).decode(), **out, "compression": "zstd"}
    return {"data": base64.b64encode(data).decode(), **out}


def read_their_tensor(payload: dict[str, Any]) -> torch.Tensor:
    """vllm-lens's documented tensor form read without our code (a KeyError if it is not that form)."""
    data = base64.b64decode(payload["data"])
    if payload.get("compression") == "zstd":
        data = zstandard.ZstdDecompressor().decompress(data)
    tensor = torch.from_numpy(np.frombuffer(data, dtype=payload["dtype"]).reshape(payload["shape"]).copy())
    return tensor.view(torch.bfloat16) if payload.get("original_dtype") == "torch.bfloat16" else tensor


TENSORS = {
    "bfloat16": torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "float16": torch.randn(2, 5, generator=torch.Generator().manual_seed(2)).to(torch.float16),
    "float32": torch.randn(6, generator=torch.Generator().manual_seed(3)),
    "int64": torch.arange(12).reshape(3, 4),
    "bool": torch.tensor([True, False, True]),
}


def test_the_six_names_import_from_the_root() -> None:
    namespace: dict[str, Any] = {}
    exec(f"from lens_evals import {', '.join(HELPERS)}", namespace)  # the line issue #43 saw raise ImportError
    assert [namespace[name].__name__ for name in HELPERS] == HELPERS and set(HELPERS) <= set(lens_evals.__all__)
    client = importlib.import_module("lens_evals.client")
    assert all(getattr(client, name) is getattr(lens_evals, name) for name in HELPERS)


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_serialize_tensor_writes_their_form(name: str) -> None:
    tensor = TENSORS[name]
    encoded = json.loads(json.dumps(lens_evals.serialize_tensor(tensor=tensor)))  # their keyword
    assert set(encoded) == {"data", "dtype", "original_dtype", "shape", "compression"}
    assert encoded["original_dtype"] == str(tensor.dtype) and encoded["shape"] == list(tensor.shape)
    back = read_their_tensor(encoded)
    assert back.dtype == tensor.dtype and torch.equal(back, tensor)


@pytest.mark.parametrize("name", sorted(TENSORS))
def test_deserialize_tensor_reads_their_forms_and_ours(name: str) -> None:
    tensor = TENSORS[name]
    for payload in (their_tensor(tensor), their_tensor(tensor, compress=False), wire.encode_array(tensor, wire.SAFETENSORS_ZSTD)):
        back = lens_evals.deserialize_tensor(d=payload)
        assert isinstance(back, torch.Tensor) and back.dtype == tensor.dtype and torch.equal(back, tensor)
    legacy = {"data": base64.b64encode(np.arange(4, dtype=np.float32).tobytes()).decode(), "dtype": "float32", "shape": [2, 2]}
    assert torch.equal(lens_evals.deserialize_tensor(legacy), torch.arange(4.0).reshape(2, 2))  # vllm-lens < 1.1
    short = {**their_tensor(tensor, compress=False), "shape": [99]}
    with pytest.raises(wire.WireError, match="tensor data has .* bytes"):
        lens_evals.deserialize_tensor(short)


def test_serialize_activations_writes_their_form_per_tensor() -> None:
    encoded = lens_evals.serialize_activations(tensor_dict={"residual_stream": TENSORS["bfloat16"], "other": TENSORS["float32"]})
    assert torch.equal(read_their_tensor(encoded["residual_stream"]), TENSORS["bfloat16"])
    assert torch.equal(read_their_tensor(encoded["other"]), TENSORS["float32"])


def test_decode_activations_reads_a_response_in_either_form() -> None:
    stream = TENSORS["bfloat16"]
    for encoded in (their_tensor(stream), wire.encode_array(stream, wire.SAFETENSORS_ZSTD), wire.encode_array(stream, wire.SAFETENSORS)):
        decoded = lens_evals.decode_activations(response_json={"id": "x", "activations": {"residual_stream": encoded}})
        assert set(decoded) == {"residual_stream"} and decoded["residual_stream"].dtype == torch.bfloat16
        assert torch.equal(decoded["residual_stream"], stream)
    ours = {"probe_scores": {"p": their_tensor(TENSORS["float32"])}, "saved": {"n": {"__type__": "tensor", **their_tensor(stream)}}}
    decoded = lens_evals.decode_activations({"activations": ours})
    assert torch.equal(decoded["probe_scores"]["p"], TENSORS["float32"]) and torch.equal(decoded["saved"]["n"], stream)
    assert lens_evals.decode_activations({"choices": []}) == {}
    several = {"activations": [{"residual_stream": their_tensor(stream)}] * 2}  # several prompts: a list
    decoded_each = lens_evals.decode_activations(several)
    assert isinstance(decoded_each, list) and len(decoded_each) == 2
    assert all(torch.equal(item["residual_stream"], stream) for item in decoded_each)
    for item in several["activations"]:
        assert torch.equal(lens_evals.decode_activations({"activations": item})["residual_stream"], stream)


def test_serialize_hook_results_writes_their_form_and_never_pickles() -> None:
    saved = {"norm": TENSORS["bfloat16"], "n": 3, "name": "x", "flags": [True, None], "per_layer": [TENSORS["float32"], TENSORS["int64"]]}
    encoded = json.loads(json.dumps(lens_evals.serialize_hook_results(results={"0": saved, "1": {}})))
    assert set(encoded) == {"0", "1"} and encoded["1"] == {}
    top = encoded["0"]
    assert top["norm"]["__type__"] == "tensor" and torch.equal(read_their_tensor(top["norm"]), TENSORS["bfloat16"])
    assert (top["n"], top["name"], top["flags"]) == (3, "x", [True, None])  # JSON values pass as they are
    # vllm-lens would cloudpickle a list holding tensors; ours carries each tensor in its form
    assert [item["__type__"] for item in top["per_layer"]] == ["tensor", "tensor"]
    assert torch.equal(read_their_tensor(top["per_layer"][1]), TENSORS["int64"])
    with pytest.raises(wire.WireError, match=r"hook_results\.0\.obj: unsupported type object.*never pickles"):
        lens_evals.serialize_hook_results({"0": {"obj": object()}})
    with pytest.raises(wire.WireError, match="hook_results.0 must be an object"):
        lens_evals.serialize_hook_results({"0": [1]})  # type: ignore[dict-item]


def test_deserialize_hook_results_reads_their_form_and_never_unpickles() -> None:
    raw = {"0": {"norm": {"__type__": "tensor", **their_tensor(TENSORS["bfloat16"])}, "n": 3, "ids": [1, 2]}}
    back = lens_evals.deserialize_hook_results(raw=json.loads(json.dumps(raw)))
    assert torch.equal(back["0"]["norm"], TENSORS["bfloat16"]) and back["0"]["n"] == 3 and back["0"]["ids"] == [1, 2]
    saved = {"per_layer": [TENSORS["float16"]], "t": TENSORS["bool"]}
    again = lens_evals.deserialize_hook_results(lens_evals.serialize_hook_results({"3": saved}))
    assert torch.equal(again["3"]["per_layer"][0], TENSORS["float16"]) and torch.equal(again["3"]["t"], TENSORS["bool"])
    # a pickle that would raise SystemExit if it were ever loaded
    pickled = base64.b64encode(b"cbuiltins\nexit\n(I3\ntR.").decode()
    for value in ({"__type__": "cloudpickle", "data": pickled}, [{"__type__": "cloudpickle", "data": pickled}]):
        with pytest.raises(wire.WireError, match="cloudpickled value: refused, never unpickled"):
            lens_evals.deserialize_hook_results({"0": {"x": value}})


def test_their_hook_dump_names_registered_hooks_and_refuses_code() -> None:
    hook = Hook("record_norm", [2], args={"scale": 2.0})
    assert hook.model_dump() == hook.to_wire() and Hook.from_wire(json.dumps(hook.model_dump())) == hook

    def capture(ctx: Any, hidden: Any) -> None:
        ctx.saved["mean"] = hidden.mean().item()

    with pytest.raises(ValueError, match="never runs code sent over the network.*LENS_EVALS_HOOKS=.*record_norm"):
        Hook(fn=capture, layer_indices=[1]).model_dump()  # what vllm-lens's client sends: refused before sending


# --------------------------------------------------------------------------- docs/vllm_lens.md's table
ROW = re.compile(r"^\| `(?P<theirs>[^`]+)` \| `(?P<ours>[^`]+)` \| `(?P<test>tests/[\w/]+\.py)::(?P<fn>\w+)` \|$")


def table_rows() -> list[re.Match[str]]:
    text = (ROOT / "docs" / "vllm_lens.md").read_text(encoding="utf-8")
    return [match for line in text.splitlines() if (match := ROW.match(line))]


def resolve(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_public_name_of_theirs_has_a_tested_row() -> None:
    rows = table_rows()
    public = {f"vllm_lens.{name}" for name in [*HELPERS, "Hook", "HookContext", "SteeringVector", "__version__"]}
    public |= {"vllm_lens.client.VLLMLensClient", "vllm_lens.client.GenerateOutput"}
    assert {row["theirs"] for row in rows} == public
    for row in rows:
        ours = resolve(row["ours"])
        assert ours is not None, row["ours"]
        if row["theirs"].startswith("vllm_lens.") and row["theirs"].count(".") == 1 and row["ours"].count(".") == 1:
            assert row["theirs"].split(".")[1] == row["ours"].split(".")[1], row.group(0)  # the same name at the root
        source = (ROOT / row["test"]).read_text(encoding="utf-8")
        assert f"def {row['fn']}(" in source, f"{row['test']}::{row['fn']} (row {row['theirs']}) does not exist"


def test_version_is_the_distributions() -> None:
    from importlib.metadata import version

    assert lens_evals.__version__ == version("lens-evals")  # vllm_lens.__version__ is its distribution's too


def test_the_inspect_provider_reads_their_form() -> None:
    """The provider's decoder for a response in vllm-lens's form: the server's default since #43,
    what a provider without the frame client gets (it read the form as a plain dict before)."""
    from lens_evals.inspect_kit.provider.outputs import decode_activations, decode_hook_results

    stream, scores = TENSORS["bfloat16"], TENSORS["float32"]
    raw = {"residual_stream": their_tensor(stream), "probe_scores": {"p": their_tensor(scores)}}
    decoded = decode_activations([raw])
    assert torch.equal(decoded["residual_stream"], stream) and torch.equal(decoded["probe_scores"]["p"], scores)
    hooks = decode_hook_results({"0": {"norm": {"__type__": "tensor", **their_tensor(stream)}, "n": 2}})
    assert torch.equal(hooks["0"]["norm"], stream) and hooks["0"]["n"] == 2
