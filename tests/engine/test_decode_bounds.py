"""Arrays in a request are decoded only as far as the model can use them (issue #40): a payload
declaring more than the largest legal array of its field (a probe: the hidden size; a steering
vector: layers x positions x hidden; a hook argument) or more than the request's budget
(``LENS_EVALS_MAX_REQUEST_ARRAYS_GIB``) is refused before its base64 is decoded or its zstd frame
inflated, and a refused request leaves nothing in the frontend's caches. References: the sizes
computed here by hand, the process's RSS (psutil), and the real zstd inflater and base64 decoder,
counted where they are called."""

from __future__ import annotations

import base64
import gc
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import zstandard

from lens_evals.request.args import LensLimits, parse_lens_args
from lens_evals.request.spec import HOOKS_KEY, PROBE_KEY, STEERING_KEY, LinearProbe
from lens_evals.wire import codec as wire_codec
from lens_evals.wire import formats as wire
from tests.conftest import greedy

PROMPT = "the cat reads a book."
HIDDEN, LAYERS = 128, 4  # the tiny Llama's
BOMB_BYTES = 256 * 2**20


def bomb_ours(nbytes: int = BOMB_BYTES) -> dict[str, Any]:
    """Our form: a zstd frame of ``nbytes`` zeros that honestly declares its size (~11 KiB)."""
    frame = zstandard.ZstdCompressor().compress(bytes(nbytes))
    return {"encoding": wire.ENCODING, "data": base64.b64encode(frame).decode(), "compression": "zstd", "nbytes": nbytes}


def bomb_theirs(nbytes: int = BOMB_BYTES) -> dict[str, Any]:
    """vllm-lens's form of the same: float32 of shape (nbytes / 4,)."""
    frame = zstandard.ZstdCompressor().compress(bytes(nbytes))
    return {"data": base64.b64encode(frame).decode(), "dtype": "float32", "shape": [nbytes // 4], "compression": "zstd"}


@pytest.fixture
def decoder_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """How often the real zstd inflater and base64 decoder ran (each still does its work)."""
    calls = {"inflate": 0, "b64decode": 0}

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            calls[name] += 1
            return real(*args)

        return call

    monkeypatch.setattr(wire_codec, "inflate", counted("inflate", wire_codec.inflate))
    monkeypatch.setattr(wire_codec, "b64decode", counted("b64decode", wire_codec.b64decode))
    yield calls


def test_declared_sizes_over_the_models_are_refused_unread(decoder_calls: dict[str, int]) -> None:
    limits = LensLimits.for_model(LAYERS, HIDDEN, 10)  # steering: 4 x 10 x 128 = 5,120 elements
    plain = wire.encode_array(np.ones(100_000, np.float32))  # uncompressed: its base64 length is too long
    cases = {
        "probe, ours": {PROBE_KEY: [{"name": "p", "layer": 0, "weights": bomb_ours()}]},
        "probe, theirs": {PROBE_KEY: [{"name": "p", "layer": 0, "weights": bomb_theirs()}]},
        "probe, JSON string": {PROBE_KEY: [json.dumps({"name": "p", "layer": 0, "weights": bomb_ours()})]},
        "probe, whole list string": {PROBE_KEY: json.dumps([{"name": "p", "layer": 0, "weights": bomb_theirs()}])},
        "steering, ours": {STEERING_KEY: [{"activations": bomb_ours(), "layer_indices": [0]}]},
        "steering, theirs": {STEERING_KEY: [{"activations": bomb_theirs(), "layer_indices": [0]}]},
        "hook arg": {HOOKS_KEY: [{"name": "add", "layer_indices": [0], "args": {"vector": bomb_ours()}}]},
        "hook arg, nested": {
            HOOKS_KEY: [{"name": "add", "layer_indices": [0], "args": {"x": [{"v": {"__type__": "tensor", **bomb_theirs()}}]}}]
        },
        "probe, uncompressed 100,000 floats": {PROBE_KEY: [{"name": "p", "layer": 0, "weights": plain}]},
    }
    for name, extra in cases.items():
        with pytest.raises(ValueError, match="refused before decoding") as info:
            parse_lens_args(extra, limits)
        assert decoder_calls == {"inflate": 0, "b64decode": 0}, f"{name}: decoded before refusing: {info.value}"
    # Within the bound (the largest legal payloads): decoded, equal to what was sent.
    weights = np.arange(HIDDEN, dtype=np.float32)
    vectors = np.ones((LAYERS, 10, HIDDEN), np.float64)  # float64: 8 bytes an element, the widest
    legal = {
        PROBE_KEY: [LinearProbe(name="p", layer=0, weights=weights).to_json()],
        STEERING_KEY: [{"activations": wire.encode_arrays({"t": vectors}, compress=True), "layer_indices": list(range(LAYERS))}],
    }
    parsed = parse_lens_args(legal, limits)
    np.testing.assert_array_equal(parsed.probes[0].weights, weights)
    np.testing.assert_array_equal(parsed.steering[0].array, vectors.astype(np.float32))
    assert decoder_calls == {"inflate": 1, "b64decode": 2}
    # 129 elements: over a probe's 128, though its bytes (with float32) would fit a float64 128
    over = wire.encode_arrays({"t": np.ones(HIDDEN + 1, np.float32)}, compress=True)
    with pytest.raises(ValueError, match="129 elements, over the 128 that a probe's weights"):
        parse_lens_args({PROBE_KEY: [{"name": "p", "layer": 0, "weights": over}]}, limits)


def test_a_requests_arrays_share_one_budget(monkeypatch: pytest.MonkeyPatch, decoder_calls: dict[str, int]) -> None:
    """Each vector is legal; three of them pass the request's budget (2 x 40 KiB fits in 100 KiB,
    the third does not) and the third is refused before it is inflated."""
    monkeypatch.setenv("LENS_EVALS_MAX_REQUEST_ARRAYS_GIB", str(100 * 2**10 / 2**30))
    vector = {"activations": wire.encode_arrays({"t": np.ones((4, 10, HIDDEN), np.float64)}, compress=True), "layer_indices": [0, 1, 2, 3]}
    limits = LensLimits.for_model(LAYERS, HIDDEN, 10)
    assert len(parse_lens_args({STEERING_KEY: [vector, vector]}, limits).steering) == 2
    decoder_calls["inflate"] = 0
    with pytest.raises(ValueError, match=r"(?s)apply_steering_vectors\[2\].*LENS_EVALS_MAX_REQUEST_ARRAYS_GIB"):
        parse_lens_args({STEERING_KEY: [vector, vector, vector]}, limits)
    assert decoder_calls["inflate"] == 2  # the third never


def rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


def test_refused_bombs_cost_nothing_and_leave_nothing_cached(llm, decoder_calls: dict[str, int]) -> None:
    """Offline, through the engine's own admission: six 256 MiB probes / steering vectors / hook
    args of ~11 KiB each are refused (ValueError) without inflating and the process's RSS does
    not grow; a probe string refused for its layer is parsed again when sent again (not kept);
    a legal probe string works, and is parsed once."""
    before = rss()
    bombs = [{PROBE_KEY: [json.dumps({"name": f"p{n}", "layer": 0, "weights": bomb_ours()})]} for n in range(3)] + [
        {PROBE_KEY: json.dumps([{"name": "p", "layer": 0, "weights": bomb_theirs()}])},
        {STEERING_KEY: [{"activations": bomb_ours(), "layer_indices": [0]}]},
        {HOOKS_KEY: [{"name": "add", "layer_indices": [0], "args": {"vector": {"__type__": "tensor", **bomb_theirs()}}}]},
    ]
    for extra in bombs:
        with pytest.raises(ValueError, match="refused before decoding"):
            llm.generate([PROMPT], greedy(4, **extra), use_tqdm=False)
    grown = rss() - before
    assert decoder_calls["inflate"] == 0
    assert grown < 32 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB refusing {len(bombs)} bombs"

    weights = np.linspace(-1, 1, HIDDEN, dtype=np.float32)
    out_of_range = LinearProbe(name="far", layer=LAYERS, weights=weights).to_json()  # legal size, bad layer
    decodes = decoder_calls["b64decode"]
    for _ in range(2):
        with pytest.raises(ValueError, match="out of range"):
            llm.generate([PROMPT], greedy(4, **{PROBE_KEY: [out_of_range]}), use_tqdm=False)
    assert decoder_calls["b64decode"] == decodes + 2, "a refused request's probe string was kept parsed"

    good = LinearProbe(name="good", layer=1, weights=weights, bias=0.25)
    extra = {PROBE_KEY: [good.to_json()], "output_residual_stream": [1]}
    first = llm.generate([PROMPT], greedy(4, **extra), use_tqdm=False)[0]
    decodes = decoder_calls["b64decode"]  # the frontend's parse and the in-process worker's
    second = llm.generate([PROMPT], greedy(4, **extra), use_tqdm=False)[0]
    assert decoder_calls["b64decode"] == decodes, "an accepted probe string is parsed once"
    for out in (first, second):
        stream = np.asarray(out.activations["residual_stream"][0], dtype=np.float64)  # (positions, hidden) after layer 1
        expected = stream @ weights.astype(np.float64) + 0.25
        np.testing.assert_allclose(np.asarray(out.activations["probe_scores"]["good"], dtype=np.float64), expected, rtol=1e-4, atol=1e-4)
