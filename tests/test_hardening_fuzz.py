"""Property-based fuzzing of the wire decoder and the request objects: random JSON-like payloads
and mutations of valid payloads raise only ValueError (WireError / pydantic ValidationError are
ValueErrors), never another exception, never a crash. No engine needed."""

from __future__ import annotations

import base64
import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lens_evals import wire
from lens_evals.spec import LinearProbe, SteeringVector, parse_lens_args

EXAMPLES = 150
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)

VALID_ARRAY = wire.encode_array(np.arange(6, dtype=np.float32).reshape(2, 3))
VALID_RAW = base64.b64decode(VALID_ARRAY["data"])
VALID_STEER = SteeringVector(activations=np.ones((1, 8), np.float32), layer_indices=[0], scale=2.0).to_wire()
VALID_PROBE = LinearProbe(name="p", layer=0, weights=np.ones(8, np.float32), bias=0.5).to_wire()
TRIED: dict[str, int] = {}


def refused_cleanly(decode, payload) -> bool:
    """True if ``decode`` raised ValueError, False if it accepted; any other exception fails the test."""
    try:
        decode(payload)
    except ValueError:
        return True
    return False


def count(name: str) -> None:
    TRIED[name] = TRIED.get(name, 0) + 1


@FUZZ_SETTINGS
@given(payload=json_values)
def test_random_json_never_escapes_as_another_exception(payload) -> None:
    count("random json")
    for decode in (wire.decode_array, SteeringVector.from_wire, LinearProbe.from_wire):
        refused_cleanly(decode, payload)
    refused_cleanly(SteeringVector.from_wire, json.dumps(payload))
    if isinstance(payload, dict):
        refused_cleanly(parse_lens_args, {"output_residual_stream": payload.get("", [0])})


def _mutate(raw: bytes, data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "header"]))
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw)))]
    if kind == "insert":
        at = data.draw(st.integers(0, len(raw)))
        return raw[:at] + data.draw(st.binary(min_size=1, max_size=16)) + raw[at:]
    if kind == "header":  # a new, fuzzed JSON header in front of the original body
        header = json.dumps(data.draw(json_values)).encode()
        return len(header).to_bytes(8, "little") + header + raw[8 + int.from_bytes(raw[:8], "little"):]
    at = data.draw(st.integers(0, len(raw) - 1))
    return raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1 :]


@FUZZ_SETTINGS
@given(data=st.data())
def test_mutated_safetensors_payloads_are_refused_or_decoded_as_floats(data) -> None:
    count("mutated payload")
    payload = {"encoding": wire.ENCODING, "data": base64.b64encode(_mutate(VALID_RAW, data)).decode()}
    try:
        array = wire.decode_array(payload)
    except ValueError:
        return
    assert array.dtype.kind == "f"  # anything accepted is a float array, never objects


def _header_entries() -> st.SearchStrategy:
    return st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(["F32", "F16", "F64", "I64", "BOOL", "object", "U8", "float32"]) | json_values,
            "shape": st.lists(st.integers(-2, 2**40), max_size=4) | json_values,
            "data_offsets": st.lists(st.integers(-2, 64) | json_values, max_size=3) | json_values,
        }
    )


@FUZZ_SETTINGS
@given(entry=_header_entries(), body=st.binary(max_size=64))
def test_fuzzed_header_entries_are_refused_or_float(entry, body) -> None:
    count("fuzzed header")
    header = json.dumps({"tensor": entry}).encode()
    raw = len(header).to_bytes(8, "little") + header + body
    payload = {"encoding": wire.ENCODING, "data": base64.b64encode(raw).decode()}
    try:
        array = wire.decode_array(payload)
    except ValueError:
        return
    assert array.dtype.kind == "f"


@FUZZ_SETTINGS
@given(data=st.data())
def test_mutated_steering_and_probe_objects_are_refused_cleanly(data) -> None:
    count("mutated object")
    for valid, model in ((VALID_STEER, SteeringVector), (VALID_PROBE, LinearProbe)):
        obj = json.loads(json.dumps(valid))
        key = data.draw(st.sampled_from(sorted(obj) + ["extra"]))
        obj[key] = data.draw(json_values)
        text = json.dumps(obj)
        if data.draw(st.booleans()):
            cut = data.draw(st.integers(0, len(text)))
            text = text[:cut]
        refused_cleanly(model.from_wire, text)


def test_report_fuzz_counts() -> None:
    """Printed with -s; the counts above run before this test in file order."""
    print(f"\nfuzz examples per property: {TRIED}")
    if TRIED:
        assert all(n >= 1 for n in TRIED.values())
