"""The binary response frame (``lens_evals.wire.frame``): a response framed and unframed decodes to
the tensors it was made of, bit for bit in their native dtypes, with the JSON around them as it
was; a malformed frame (any truncation, any byte changed, a range outside the blob, a bad
reference) is a ``WireError`` saying what is wrong, never another exception. Over HTTP:
tests/engine/test_vllm_lens_http.py."""

from __future__ import annotations

import base64
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_evals.client import decode_activations
from lens_evals.engine.frontend.http_middleware import encode_activations
from lens_evals.wire import formats as wire
from lens_evals.wire import frame as wire_frame

TEXT = 'a "quoted" \\ text, é, \u2028, \x01'


def tensors() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        {"residual_stream": torch.randn(2, 5 + i, 64, generator=generator).to(dtype)}
        for i, dtype in enumerate([torch.bfloat16, torch.float32, torch.float16])
    ]


def framed_response() -> tuple[bytes, list[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    prompts = tensors()
    saved = {"norm.2": torch.randn(7, dtype=torch.float32), "ids": torch.arange(4), "mask": torch.tensor([True, False])}
    activations = [encode_activations(item, wire.SAFETENSORS_FRAME) for item in prompts]
    activations[0]["saved"] = wire.encode_tree(saved, "saved", encoding=wire.SAFETENSORS_FRAME)
    response = {"id": "cmpl-1", "choices": [{"index": 0, "text": TEXT, "token_ids": [1, 2, 3]}], "activations": activations}
    return b"".join(wire_frame.frame_bytes(response)), prompts, saved


def test_a_frame_decodes_to_the_tensors_and_json_it_was_made_of() -> None:
    body, prompts, saved = framed_response()
    assert body.startswith(wire_frame.MAGIC)
    back = wire_frame.response_body(body, wire_frame.CONTENT_TYPE + "; charset=utf-8")
    assert back["id"] == "cmpl-1" and back["choices"][0]["text"] == TEXT and back["choices"][0]["token_ids"] == [1, 2, 3]
    decoded = decode_activations(back)
    assert isinstance(decoded, list) and len(decoded) == len(prompts)
    for got, want in zip(decoded, prompts):
        assert got["residual_stream"].dtype == want["residual_stream"].dtype
        assert torch.equal(got["residual_stream"], want["residual_stream"])
    for name, tensor in saved.items():
        assert torch.equal(decoded[0]["saved"][name], tensor), name
    # the blob holds exactly the safetensors files the base64 text would have held
    as_json = json.loads(json.dumps(encode_activations(prompts[1], wire.SAFETENSORS)))
    assert bytes(back["activations"][1]["residual_stream"]["data"]) == base64.b64decode(as_json["residual_stream"]["data"])
    assert len(body) < len(json.dumps(as_json)) * len(prompts)  # no base64: smaller than the JSON


def test_json_bodies_pass_through_and_content_types_are_told_apart() -> None:
    assert wire_frame.response_body(b'{"a": [1, "x"]}', "application/json") == {"a": [1, "x"]}
    assert wire_frame.is_frame("Application/Vnd.Lens-Evals.Frame")
    assert not wire_frame.is_frame(None) and not wire_frame.is_frame("application/json")


def _head(head: object, blob: bytes = b"") -> bytes:
    text = json.dumps(head).encode()
    return wire_frame.MAGIC + len(text).to_bytes(8, "little") + text + blob


MALFORMED = {
    "no prefix": (b'{"id": 1}', "no LENSFRM1 prefix"),
    "head longer than the frame": (wire_frame.MAGIC + (10**6).to_bytes(8, "little") + b"{}", "does not fit"),
    "head not JSON": (wire_frame.MAGIC + (3).to_bytes(8, "little") + b"{x}", "frame head is not JSON"),
    "range past the blob": (_head({"a": {"data": {"frame": [2, 10]}}}, b"0123456789"), "outside the 10-byte blob"),
    "negative offset": (_head({"a": {"data": {"frame": [-1, 2]}}}, b"01"), "two non-negative integers"),
    "float length": (_head({"a": {"data": {"frame": [0, 1.0]}}}, b"01"), "two non-negative integers"),
    "boolean offset": (_head({"a": {"data": {"frame": [True, 1]}}}, b"01"), "two non-negative integers"),
    "extra key": (_head({"a": {"data": {"frame": [0, 1], "x": 1}}}, b"01"), "two non-negative integers"),
    "too deep": (_head(json.loads("[" * 70 + "]" * 70)), "nested deeper"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_frame_is_refused_saying_why(name: str) -> None:
    body, message = MALFORMED[name]
    with pytest.raises(wire.WireError, match=message):
        wire_frame.unframe(body)


def test_a_range_holding_something_else_than_its_tensor_is_refused_by_the_decoder() -> None:
    body, _, _ = framed_response()
    back = wire_frame.unframe(body)
    back["activations"][0]["residual_stream"]["data"] = back["activations"][0]["residual_stream"]["data"][:-2]
    with pytest.raises(wire.WireError, match="truncated"):
        decode_activations(back)


BODY = framed_response()[0]


def decode_or_wire_error(body: bytes) -> None:
    try:
        decode_activations(wire_frame.unframe(body))
    except wire.WireError:
        pass  # refused, saying why; any other exception fails the test


@settings(max_examples=150, deadline=None)
@given(st.integers(min_value=0, max_value=len(BODY) - 1))
def test_every_truncation_is_a_wire_error(cut: int) -> None:
    with pytest.raises(wire.WireError):
        decode_activations(wire_frame.unframe(BODY[:cut]))


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(BODY) - 1), st.integers(min_value=1, max_value=255))
def test_any_changed_byte_decodes_or_is_a_wire_error(at: int, flip: int) -> None:
    changed = bytearray(BODY)
    changed[at] ^= flip
    decode_or_wire_error(bytes(changed))
