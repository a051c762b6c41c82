"""The per-request work done once (issue #21, item 4): probes encoded once per distinct probe on
the frontend and decoded once per digest on the worker, probes sent as JSON strings parsed once
(once a request sending them is accepted),
the engine's facts read once per input processor. No engine. References: the uncached forms
(``LinearProbe.to_wire``, a fresh parse, SHA-256 of the weights and bias computed here)."""

from __future__ import annotations

import copy
import hashlib
import json
import pickle
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from lens_evals.engine import compat
from lens_evals.engine.frontend import admit as frontend_admit
from lens_evals.engine.transport.probe_cache import LRU, encode_probe, encode_steering, probe_digest, steering_wire_digest
from lens_evals.engine.worker.requests import decode_worker_request
from lens_evals.request.args import parse_lens_args, remember_probes
from lens_evals.request.spec import CAPTURE_KEY, INTERNAL_KEY, PROBE_KEY, STEERING_KEY, LinearProbe, SteeringVector

HIDDEN = 64


def probe(seed: int, name: str = "p", bias: float = 0.5) -> LinearProbe:
    return LinearProbe(name=name, layer=2, weights=np.random.default_rng(seed).normal(size=HIDDEN).astype(np.float32), bias=bias)


def test_lru_keeps_the_most_recently_used() -> None:
    cache: LRU[str, int] = LRU(size=2)
    made: list[str] = []

    def make(key: str) -> int:
        made.append(key)
        return len(made)

    for key in ("a", "b", "a", "c", "a", "b"):
        cache.get_or_make(key, lambda key=key: make(key))
    assert made == ["a", "b", "c", "b"]  # "a" was used again before "c" came, so "b" went first
    assert len(cache) == 2


def test_a_probe_is_encoded_once_per_content() -> None:
    first = probe(1)
    wire, digest = encode_probe(first)
    assert wire == first.to_wire()
    expected = hashlib.sha256(first.weights.astype(np.float32).tobytes() + np.float64(0.5).tobytes()).hexdigest()
    assert digest == probe_digest(first.weights, first.bias) == expected
    same = probe(1)  # another object, the same probe
    assert encode_probe(same)[0] is wire
    assert encode_probe(probe(1, name="q"))[0]["name"] == "q"  # the name is part of what is sent
    assert encode_probe(probe(1, bias=0.25))[1] != digest
    first.weights[0] += 1.0  # changed in place: a new probe, not the cached one
    changed, changed_digest = encode_probe(first)
    assert changed is not wire and changed_digest != digest and changed == first.to_wire()


def test_probe_json_strings_are_parsed_once_and_errors_still_name_the_item() -> None:
    texts = [probe(2, "a").to_json(), probe(3, "b").to_json()]
    one = parse_lens_args({PROBE_KEY: list(texts)})
    assert not any(x is y for x, y in zip(one.probes, parse_lens_args({PROBE_KEY: list(texts)}).probes))  # not accepted yet
    remember_probes({PROBE_KEY: texts}, one.probes)  # what admission does once the request is accepted
    again = parse_lens_args({PROBE_KEY: list(texts)})
    assert [p.name for p in one.probes] == ["a", "b"]
    assert all(x is y for x, y in zip(one.probes, again.probes))  # the same parsed objects
    np.testing.assert_array_equal(one.probes[1].weights, probe(3).weights)
    whole = json.dumps([json.loads(text) for text in texts])  # vllm-lens's form: one string of the list
    assert [p.name for p in parse_lens_args({PROBE_KEY: whole}).probes] == ["a", "b"]
    remember_probes({PROBE_KEY: whole}, parse_lens_args({PROBE_KEY: whole}).probes)
    assert parse_lens_args({PROBE_KEY: whole}).probes[0] is parse_lens_args({PROBE_KEY: whole}).probes[0]
    bad = json.dumps({**json.loads(texts[1]), "layer": -1})
    with pytest.raises(ValueError, match=r"output_probe_scores\[1\]"):
        parse_lens_args({PROBE_KEY: [texts[0], bad]})
    with pytest.raises(ValueError, match=r"output_probe_scores\[0\]: a probe must be an object, got list"):
        parse_lens_args({PROBE_KEY: ["[1, 2]"]})  # a list string as an item is refused, cached or not


def _spec(probes: list[LinearProbe], digests: bool = True) -> dict[str, Any]:
    encoded = [encode_probe(p) for p in probes]
    spec: dict[str, Any] = {
        "key": "k",
        "capture_layers": [],
        "steering": [],
        "probes": [w for w, _ in encoded],
        "hooks": [],
        "hook_set": None,
    }
    if digests:
        spec["probe_digests"] = [d for _, d in encoded]
    return {INTERNAL_KEY: spec}


def test_the_worker_decodes_a_probe_once_per_digest() -> None:
    cpu = torch.device("cpu")
    probes = [probe(4, "a"), probe(5, "b", bias=-1.0)]
    first = decode_worker_request(_spec(probes), cpu, torch.float32, {})
    second = decode_worker_request(_spec(list(reversed(probes))), cpu, torch.float32, {})
    assert first is not None and second is not None
    assert [p.index for p in second.probes] == [0, 1] and [p.bias for p in second.probes] == [-1.0, 0.5]
    assert second.probes[0].weights is first.probes[1].weights  # decoded once, shared
    for decoded, original in zip(first.probes, probes):
        assert decoded.digest == probe_digest(original.weights, original.bias) and decoded.layer == 2
        assert torch.equal(decoded.weights, torch.from_numpy(original.weights))
    without = decode_worker_request(_spec(probes, digests=False), cpu, torch.float32, {})  # a spec without them
    assert without is not None and [p.digest for p in without.probes] == [p.digest for p in first.probes]
    broken = _spec(probes)
    broken[INTERNAL_KEY]["probe_digests"] = broken[INTERNAL_KEY]["probe_digests"][:1]
    with pytest.raises(ValueError, match="2 probes but 1 probe digests"):
        decode_worker_request(broken, cpu, torch.float32, {})


def vector(seed: int, scale: float = 2.0) -> SteeringVector:
    return SteeringVector(
        activations=np.random.default_rng(seed).normal(size=(1, HIDDEN)).astype(np.float32), layer_indices=[1], scale=scale
    )


def _steering_spec(vectors: list[SteeringVector], digests: bool = True) -> dict[str, Any]:
    encoded = [encode_steering(v) for v in vectors]
    spec = {"key": "k", "capture_layers": [], "steering": [w for w, _ in encoded], "probes": [], "hooks": [], "hook_set": None}
    if digests:
        spec["steering_digests"] = [d for _, d in encoded]
    return {INTERNAL_KEY: spec}


def test_a_steering_vector_is_encoded_and_decoded_once_per_content() -> None:
    """Reference: ``SteeringVector.to_wire`` and the worker's decode of a spec without digests."""
    cpu = torch.device("cpu")
    first = vector(7)
    wire, digest = encode_steering(first)
    assert wire == first.to_wire()
    assert encode_steering(vector(7))[0] is wire  # another object, the same vector
    assert encode_steering(vector(7, scale=3.0))[1] != digest  # the scale is part of what is sent
    one = decode_worker_request(_steering_spec([first]), cpu, torch.float32, {})
    two = decode_worker_request(_steering_spec([vector(7)]), cpu, torch.float32, {})
    assert one is not None and two is not None and two.steering[0] is one.steering[0]  # decoded once, shared
    first.activations.mul_(-1.5)  # changed in place: a new vector, not the cached one
    changed, changed_digest = encode_steering(first)
    assert changed_digest != digest and changed == first.to_wire()
    after = decode_worker_request(_steering_spec([first]), cpu, torch.float32, {})
    fresh = decode_worker_request(_steering_spec([first], digests=False), cpu, torch.float32, {})
    assert after is not None and fresh is not None
    assert torch.equal(after.steering[0].vectors[1], fresh.steering[0].vectors[1])
    assert torch.equal(after.steering[0].vectors[1], torch.from_numpy(first.array))  # (1, hidden): every position
    broken = _steering_spec([first])
    broken[INTERNAL_KEY]["steering_digests"] *= 2
    with pytest.raises(ValueError, match="1 steering vectors but 2 steering digests"):
        decode_worker_request(broken, cpu, torch.float32, {})


def test_a_deep_copy_of_a_request_object_shares_no_array() -> None:
    """vLLM deep-copies every request's ``SamplingParams`` (``extra_args`` too); our objects copy
    themselves cheaply, but a copy changed in place must leave the original as it was."""
    vec, pr = vector(8), probe(9)
    vec_wire, probe_wire = vec.to_wire(), pr.to_wire()
    copied = copy.deepcopy({"v": [vec, vec], "p": [pr]})
    assert copied["v"][0] is copied["v"][1]  # one object twice stays one object, as deepcopy does
    new_vec, new_probe = copied["v"][0], copied["p"][0]
    assert new_vec.to_wire() == vec_wire and new_probe.to_wire() == probe_wire
    new_vec.activations.mul_(2.0)
    new_vec.layer_indices.append(3)
    new_probe.weights[0] += 1.0
    assert vec.to_wire() == vec_wire and pr.to_wire() == probe_wire


def test_the_engines_facts_are_read_once_and_the_limit_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    hf_config = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=4, hidden_size=HIDDEN)
    model_config = SimpleNamespace(
        hf_config=hf_config, hf_text_config=hf_config, max_model_len=512, dtype=torch.float32, get_vocab_size=lambda: 1000
    )
    scheduler_config = SimpleNamespace(max_num_batched_tokens=2048)
    processor = SimpleNamespace(
        vllm_config=SimpleNamespace(
            model_config=model_config,
            scheduler_config=scheduler_config,
            parallel_config=SimpleNamespace(),  # vLLM's defaults: the workers share the frontend's host
            additional_config={},
            use_v2_model_runner=False,
            speculative_config=None,
        )
    )
    reads = []
    real = compat.config.model_shape
    monkeypatch.setattr(compat.config, "model_shape", lambda config: reads.append(config) or real(config))
    from vllm import SamplingParams

    def admit(extra: dict[str, Any]) -> Any:
        request = SimpleNamespace(
            sampling_params=copy.copy(SamplingParams(max_tokens=2, extra_args=extra)), prompt_token_ids=list(range(10)), cache_salt=None
        )
        frontend_admit.on_request(processor, "r", request)
        return request

    for _ in range(5):
        spec = admit({CAPTURE_KEY: [1], PROBE_KEY: [probe(6)]}).sampling_params.extra_args[INTERNAL_KEY]
    assert len(reads) == 1
    assert spec["probe_digests"] == [probe_digest(probe(6).weights, 0.5)] and spec["probes"] == [probe(6).to_wire()]
    monkeypatch.setenv("LENS_EVALS_MAX_CAPTURE_GIB", "1e-9")  # the limit is read per request
    with pytest.raises(ValueError, match="over the per-request limit"):
        admit({CAPTURE_KEY: [1, 2, 3]})


def test_copies_share_what_was_computed_from_their_content_until_it_changes() -> None:
    """vLLM copies a request's steering vectors and probes for every request: the copies share one
    memo (checks passed, digest, wire form), which is never used for other content. References:
    the digest and checks of a fresh object of the same content."""
    original = vector(7)
    copies = [copy.deepcopy(original) for _ in range(3)]
    digest = steering_wire_digest(copies[0])
    assert all(c._memo is original._memo for c in copies) and copies[1].memo()["digest"] == digest
    assert digest == steering_wire_digest(SteeringVector(**original.model_dump()))  # what a fresh vector gives
    original.array[0, 0] += 1.0  # changed in place, through the numpy view (torch's version counter does not see it)
    changed = copy.deepcopy(original)
    assert changed._memo is not copies[0]._memo and steering_wire_digest(changed) != digest
    assert steering_wire_digest(copies[2]) == digest  # the earlier copies keep their content, and their memo
    before = steering_wire_digest(original)
    original.layer_indices[0] = 2  # a list changed in place is a change too
    assert before != steering_wire_digest(original) == steering_wire_digest(SteeringVector(**original.model_dump()))
    original.array[0, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        parse_lens_args({STEERING_KEY: [copy.deepcopy(original)]})  # checked again, not taken from the memo
    assert pickle.loads(pickle.dumps(copies[0]))._memo.values == {}  # a pickled copy carries no results
    probes = [probe(8)]
    wire = encode_probe(copy.deepcopy(probes[0]))[0]
    probes[0].weights[3] = 2.0
    assert encode_probe(copy.deepcopy(probes[0]))[0] == probes[0].to_wire() != wire
