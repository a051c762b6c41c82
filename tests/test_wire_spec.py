"""Request side: wire format and SteeringVector validation (no engine, no vllm import)."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest

from lens_evals import SteeringVector, parse_lens_args, wire


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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"activations": np.ones((2, 8)), "layer_indices": [1]}, "2 layer rows but layer_indices has 1"),
        ({"activations": np.full((1, 8), np.nan), "layer_indices": [1]}, "NaN or inf"),
        ({"activations": np.ones((1, 8)), "layer_indices": [-1]}, "must be >= 0"),
        ({"activations": np.ones((1, 2, 8)), "layer_indices": [1]}, "need position_indices"),
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
    for bad, message in [("x", "must be a list"), ([1, 1], "duplicate"), ([True], "integers"), ([], "at least one")]:
        with pytest.raises(ValueError, match=message):
            parse_lens_args({"output_residual_stream": bad})
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_lens_args({"apply_steering_vectors": ["{broken"]})
    with pytest.raises(ValueError, match="unknown steering vector fields"):
        parse_lens_args({"apply_steering_vectors": [{"activations": [[1.0]], "layer_indices": [0], "evil": 1}]})


def test_client_side_imports_without_vllm_or_torch() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
        "import numpy as np, lens_evals\n"
        "v = lens_evals.SteeringVector(activations=np.ones((1, 4)), layer_indices=[0])\n"
        "print(lens_evals.SteeringVector.from_wire(v.to_json()).layer_indices)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[0]"
