"""Request side: wire format and SteeringVector validation (no engine, no vllm import)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest

from lens_evals import LinearProbe, SteeringVector, parse_lens_args
from lens_evals.request.wire_model import float32_array
from lens_evals.wire import formats as wire


def test_round_trip_preserves_values_and_dtype() -> None:
    arr = np.random.default_rng(0).normal(size=(3, 5, 7)).astype(np.float32)
    payload = json.loads(json.dumps(wire.encode_array(arr)))  # survives JSON
    out = wire.decode_array(payload)
    assert out.dtype == np.float32 and out.shape == (3, 5, 7)
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize(
    "payload, message",
    [
        ("nope", "expected an encoded tensor object"),
        ({"encoding": "pickle", "data": ""}, "unknown tensor encoding"),
        ({"encoding": wire.ENCODING, "data": "@@@"}, "not valid base64"),
        ({"encoding": wire.ENCODING, "data": base64.b64encode(b"\x01\x00").decode()}, "truncated"),
        ({"encoding": wire.ENCODING}, "no 'data'"),
    ],
)
def test_malformed_payloads_raise_clear_errors(payload: object, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.decode_array(payload)


def test_truncated_payload_is_rejected() -> None:
    good = wire.encode_array(np.ones((4, 4), dtype=np.float32))
    raw = base64.b64decode(good["data"])
    cut = {"encoding": wire.ENCODING, "data": base64.b64encode(raw[:-8]).decode()}
    with pytest.raises(wire.WireError, match="truncated"):
        wire.decode_array(cut)


def test_integer_dtype_is_rejected() -> None:
    from safetensors.numpy import save

    raw = save({"t": np.arange(4, dtype=np.int64)})
    with pytest.raises(wire.WireError, match="not allowed"):
        wire.decode_array({"encoding": wire.ENCODING, "data": base64.b64encode(raw).decode()})


def test_steering_vector_wire_and_json_round_trip() -> None:
    vec = SteeringVector(activations=np.ones((2, 3, 8)), layer_indices=[1, 4], scale=0.5, norm_match=True, position_indices=[0, 5, 9])
    for form in (vec.to_wire(), vec.to_json()):
        back = SteeringVector.from_wire(form)
        assert back.layer_indices == [1, 4] and back.position_indices == [0, 5, 9]
        assert back.scale == 0.5 and back.norm_match
        np.testing.assert_array_equal(back.activations, vec.activations)


def test_float32_array_reads_bfloat16_tensors_arrays_lists_and_wire_payloads() -> None:
    """Captures from a bfloat16 model arrive as bfloat16 tensors, which numpy cannot hold (2026-12-04,
    H200: the oracle's training capture failed on ``tensor.numpy()``). Reference: the bfloat16 bits
    widened by hand (a bfloat16 is the top half of a float32)."""
    import torch

    values = torch.tensor([[0.1, -2.25, 3.0e38], [1e-30, 0.0, -7.0]], dtype=torch.bfloat16)
    bits = values.view(torch.int16).numpy().astype(np.uint16)
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    assert widened[0, 0] != np.float32(0.1)  # the rounding to bfloat16 is kept, not undone
    for form in (values, widened.copy(), widened.tolist(), wire.encode_array(values)):
        got = float32_array(form)
        assert got.dtype == np.float32 and got.shape == (2, 3)
        np.testing.assert_array_equal(got, widened)
    with pytest.raises(ValueError, match="numeric array"):
        float32_array([["a", "b"]])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"activations": np.ones((2, 8)), "layer_indices": [1]}, "2 layer rows but layer_indices has 1"),
        ({"activations": np.full((1, 8), np.nan), "layer_indices": [1]}, "NaN or inf"),
        ({"activations": np.ones((1, 8)), "layer_indices": [-1]}, "must be >= 0"),
        (
            {"activations": np.ones((1, 3, 8)), "layer_indices": [1], "position_indices": [0, 1]},
            "3 position rows but position_indices has 2",
        ),
        ({"activations": np.ones((1, 2, 8)), "layer_indices": [1], "position_indices": [3, 3]}, "duplicates"),
        ({"activations": np.zeros((1, 8)), "layer_indices": [1], "norm_match": True}, "non-zero"),
        ({"activations": np.ones((1, 8)), "layer_indices": [1], "scale": float("inf")}, "finite"),
    ],
)
def test_bad_steering_vectors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SteeringVector(**kwargs)


def test_parse_lens_args_validates_and_checks_model_shape() -> None:
    vec = SteeringVector(activations=np.ones((1, 8)), layer_indices=[2])
    lens = parse_lens_args({"output_residual_stream": [3, 1], "apply_steering_vectors": [vec.to_json()]})
    assert lens.capture_layers == [1, 3] and lens.steering[0].layer_indices == [2]
    lens.check_model(num_layers=4, hidden_size=8, max_positions=10, max_capture_bytes=2**30)
    with pytest.raises(ValueError, match="out of range"):
        lens.check_model(num_layers=3, hidden_size=8, max_positions=10, max_capture_bytes=2**30)
    with pytest.raises(ValueError, match="hidden size 8 does not match the model's 16"):
        lens.check_model(num_layers=4, hidden_size=16, max_positions=10, max_capture_bytes=2**30)
    with pytest.raises(ValueError, match="over the per-request limit"):
        lens.check_model(num_layers=4, hidden_size=8, max_positions=10, max_capture_bytes=100)
    for bad, message in [
        ("x", "string is not valid JSON"),
        ({"a": 1}, "must be a list"),
        (False, "asks for nothing"),
        ([1, 1], "duplicate"),
        ([True], "integers"),
        ([], "at least one"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_lens_args({"output_residual_stream": bad})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_lens_args({"apply_steering_vectors": ["{broken"]})
    with pytest.raises(ValueError, match="unknown steering vector fields"):
        parse_lens_args({"apply_steering_vectors": [{"activations": [[1.0]], "layer_indices": [0], "evil": 1}]})


def test_linear_probe_wire_and_json_round_trip() -> None:
    probe = LinearProbe(name="honesty", layer=3, weights=np.arange(8), bias=-0.5)
    assert probe.weights.dtype == np.float32
    for form in (probe, probe.to_wire(), probe.to_json()):
        back = LinearProbe.from_wire(form)
        assert (back.name, back.layer, back.bias) == ("honesty", 3, -0.5)
        np.testing.assert_array_equal(back.weights, probe.weights)
    lens = parse_lens_args({"output_probe_scores": [probe.to_json(), LinearProbe(name="b", layer=0, weights=np.ones(8))]})
    assert [p.name for p in lens.probes] == ["honesty", "b"] and lens.active
    lens.check_model(num_layers=4, hidden_size=8, max_positions=10, max_capture_bytes=2**30)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        lens.check_model(num_layers=3, hidden_size=8, max_positions=10, max_capture_bytes=2**30)
    with pytest.raises(ValueError, match="weights length 8 does not match the model's hidden size 16"):
        lens.check_model(num_layers=4, hidden_size=16, max_positions=10, max_capture_bytes=2**30)


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"name": "p", "layer": 0, "weights": [[1.0, 2.0]]}, "1-D"),
        ({"name": "p", "layer": 0, "weights": []}, "non-empty"),
        ({"name": "p", "layer": 0, "weights": [1.0, float("inf")]}, "NaN or inf"),
        ({"name": "p", "layer": -1, "weights": [1.0]}, "greater than or equal to 0"),
        ({"name": "p", "layer": True, "weights": [1.0]}, "valid integer"),
        ({"name": " ", "layer": 0, "weights": [1.0]}, "must not be empty"),
        ({"name": "p", "layer": 0, "weights": [1.0], "bias": float("nan")}, "bias\n.*must be finite"),
        ({"name": "p", "layer": 0, "weights": [1.0], "evil": 1}, "unknown probe fields"),
        ({"name": "p", "layer": 0, "weights": {"encoding": "pickle", "data": ""}}, "unknown tensor encoding"),
        ("{oops", "not valid JSON"),
        ("[1, 2]", "must be an object"),
    ],
)
def test_bad_linear_probes(payload: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinearProbe.from_wire(payload)


def test_probe_names_are_unique_per_request() -> None:
    probe = LinearProbe(name="x", layer=0, weights=np.ones(4))
    with pytest.raises(ValueError, match=r"unique per request, duplicated: \['x'\]"):
        parse_lens_args({"output_probe_scores": [probe, probe.to_wire()]})
    with pytest.raises(ValueError, match=r"output_probe_scores\[1\]: probe string is not valid JSON"):
        parse_lens_args({"output_probe_scores": [probe, "{"]})
    with pytest.raises(ValueError, match="must be a list of probes"):
        parse_lens_args({"output_probe_scores": 3})


def test_client_side_imports_without_vllm_or_torch() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
        "import numpy as np, lens_evals\n"
        "v = lens_evals.SteeringVector(activations=np.ones((1, 4)), layer_indices=[0])\n"
        "print(lens_evals.SteeringVector.from_wire(v.to_json()).layer_indices)\n"
        "p = lens_evals.LinearProbe(name='p', layer=2, weights=np.ones(4))\n"
        "print(lens_evals.LinearProbe.from_wire(p.to_json()).layer)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[0]", "2"]


def test_tree_round_trip_keeps_structure_and_integer_arrays() -> None:
    tree = {
        "n": 3,
        "x": 0.5,
        "s": "a",
        "none": None,
        "flag": True,
        "ids": np.arange(4, dtype=np.int64),
        "nested": [{"mask": np.array([True, False])}, np.float32(2.5)],
        "h": np.ones((2, 3), np.float32),
    }
    encoded = json.loads(json.dumps(wire.encode_tree(tree)))
    back = wire.decode_tree(encoded)
    assert back["n"] == 3 and back["s"] == "a" and back["none"] is None and back["nested"][1] == 2.5
    np.testing.assert_array_equal(back["ids"], tree["ids"])
    assert back["ids"].dtype == np.int64 and back["nested"][0]["mask"].dtype == np.bool_
    with pytest.raises(wire.WireError, match="not allowed"):  # steering payloads stay floating point only
        wire.decode_array(encoded["ids"])


@pytest.mark.parametrize(
    "value, message",
    [
        ({"f": float("nan")}, "non-finite"),
        ({1: 2}, "keys must be strings"),
        ({"o": object()}, "unsupported type object"),
        ({"a": np.array(["x"])}, "dtype <U1 not allowed"),
        ({"t": {"encoding": wire.ENCODING, "data": ""}}, "reserved for arrays"),
    ],
)
def test_tree_encoding_refuses_what_json_cannot_carry_safely(value: object, message: str) -> None:
    with pytest.raises(wire.WireError, match=message):
        wire.encode_tree(value)


def test_deep_trees_are_refused() -> None:
    deep: list = []
    for _ in range(wire.MAX_TREE_DEPTH + 2):
        deep = [deep]
    with pytest.raises(wire.WireError, match="deeper than"):
        wire.decode_tree(deep)


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than Python's JSON parser goes (its recursion limit)


@pytest.mark.parametrize("key", ["output_residual_stream", "apply_steering_vectors", "output_probe_scores", "apply_hooks"])
@pytest.mark.parametrize("form", ["whole", "item"])
def test_json_nested_too_deeply_is_a_value_error_naming_the_key(key: str, form: str) -> None:
    """Was a RecursionError (an HTTP 500 with an empty message); now bad JSON like any other."""
    value = DEEP if form == "whole" or key == "output_residual_stream" else ['{"a": ' + DEEP + "}"]
    with pytest.raises(ValueError, match=f"{key}.*not valid JSON.*: JSON nested too deeply"):
        parse_lens_args({key: value})


def test_a_safetensors_header_nested_too_deeply_is_refused() -> None:
    header = DEEP.encode()
    raw = len(header).to_bytes(8, "little") + header
    with pytest.raises(wire.WireError, match="header is not JSON: JSON nested too deeply"):
        wire.decode_array({"encoding": wire.ENCODING, "data": base64.b64encode(raw).decode()})


RESPONSE_ITEM = {"residual_stream": wire.encode_array(np.ones(2, np.float32))}


@pytest.mark.parametrize(
    "body, message",
    [
        ({"activations": "x"}, "activations must be an object, got str"),
        ({"activations": [RESPONSE_ITEM, 5]}, "got int"),
        ({"activations": {"probe_scores": [1, 2]}}, "probe_scores must be an object, got list"),
        ({"hook_results": ["x"]}, "hook_results must be an object, got list"),
        ({"results": 5}, "results must be a list"),
        ({"results": ["x"]}, "a hook set result must be an object"),
        ({"results": [{"saved": {}}]}, "needs 'request_id' and 'saved'"),
    ],
)
def test_client_decoders_refuse_hostile_response_shapes_with_wire_errors(body: dict, message: str) -> None:
    """A response is data from the network: a wrong shape is a WireError saying what is wrong
    (was AttributeError / TypeError / KeyError from deep inside the decoder)."""
    from lens_evals import client

    decoders = [client.activations_from_response, client.decode_activations]
    if isinstance(body.get("activations"), list):  # vllm-lens's decode_activations reads one prompt's
        decoders = [client.activations_from_response, lambda b: client.decode_activations({"activations": b["activations"][-1]})]
    if "hook_results" in body:
        decoders = [lambda b: client.deserialize_hook_results(b["hook_results"])]
    if "results" in body:
        decoders = [client.hook_results_from_response]
    for decode in decoders:
        with pytest.raises(wire.WireError, match=message):
            decode(body)
    assert client.activations_from_response({"activations": RESPONSE_ITEM})["residual_stream"].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_probe_keeps_its_weights_when_the_caller_reuses_the_array(kind) -> None:
    """A sweep that refills one buffer for each probe must not change the probes built before."""
    import torch

    buffer = np.arange(8, dtype=np.float32) if kind == "numpy" else torch.arange(8, dtype=torch.float32)
    probe = LinearProbe(name="p", layer=0, weights=buffer)
    buffer[:] = -1.0
    np.testing.assert_array_equal(probe.weights, np.arange(8, dtype=np.float32))
