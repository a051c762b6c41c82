"""The wire's fast paths give exactly what the standard library gives: SIMD base64 (pybase64,
where installed) against ``base64``, and ``wire.json_bytes`` (long base64 strings written in
unescaped) against ``json.dumps(...).encode()``, byte for byte, on responses and on arbitrary
JSON values with long strings in and out of ``"data"`` keys."""

from __future__ import annotations

import base64
import binascii
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lens_evals.engine.frontend.http_middleware import encode_activations
from lens_evals.wire import codec
from lens_evals.wire import formats as wire


def test_base64_equals_the_standard_library() -> None:
    for size in (0, 1, 2, 3, 4, 5, 1000, 3 * 2**20 + 1):
        data = os.urandom(size)
        assert codec.b64encode(data) == base64.b64encode(data).decode("ascii")
        assert codec.b64decode(base64.b64encode(data).decode("ascii")) == data


@pytest.mark.parametrize("text", ["QUJD\nRA==", "QUJDRA=", "QUJD RA==", "QUJD*A==", "QUJDRA==é", "QUJDRA==QQ==x", "Q"])
def test_bad_base64_is_refused_as_the_standard_library_refuses_it(text: str) -> None:
    with pytest.raises((binascii.Error, ValueError)):
        base64.b64decode(text, validate=True)
    with pytest.raises(wire.WireError, match="not valid base64"):
        codec.b64decode(text)


def response(encoding: str) -> dict:
    torch.manual_seed(0)
    activations = {
        "residual_stream": (torch.randn(2, 37, 128) * 40).to(torch.bfloat16),
        "probe_scores": {"p": torch.randn(37), 'q"\\ é': torch.randn(3).double()},
        "saved": {"norms": [torch.randn(5), {"ids": torch.arange(9), "mask": torch.ones(4, dtype=torch.bool)}]},
    }
    return {
        "id": "cmpl-1",
        "choices": [{"index": 0, "text": 'a "quoted" \\ text, é, \u2028, \x01', "token_ids": [1, 2, 3]}],
        "usage": {"prompt_tokens": 37, "completion_tokens": 1},
        "activations": encode_activations(activations, encoding),
    }


@pytest.mark.parametrize("encoding", wire.JSON_ENCODINGS)
def test_json_bytes_equals_json_dumps_on_responses(encoding: str) -> None:
    body = response(encoding)
    assert wire.json_bytes(body) == json.dumps(body).encode()
    several = {"activations": [body["activations"]] * 3, "data": "A" * 5000}
    assert wire.json_bytes(several) == json.dumps(several).encode()


BASE64_TEXT = st.binary(min_size=3000, max_size=6000).map(lambda b: base64.b64encode(b).decode("ascii"))
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text() | BASE64_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(["data", "x", "é", '"']) | st.text(), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES)
def test_json_bytes_equals_json_dumps_on_any_json_value(value: object) -> None:
    assert wire.json_bytes(value) == json.dumps(value).encode()
