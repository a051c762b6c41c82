"""Issue #19, in-process: vllm-lens's request forms, wire format and persistent-hook API work
here (written from its documented behaviour; none of its code or tests). Wire checks use
safetensors.torch as the independent decoder; engine checks compare each vllm-lens form with
our own form of the same request, and hook results with the engine's capture, on one tiny engine."""

from __future__ import annotations

import base64
import io
import json
import re
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load as safetensors_load

import lens_evals
from lens_evals.client import (
    decode_activations,
    deserialize_hook_results,
    deserialize_tensor,
    serialize_activations,
    serialize_hook_results,
    serialize_tensor,
)
from lens_evals.engine import plugin
from lens_evals.request.args import parse_lens_args
from lens_evals.request.hooks import Hook
from lens_evals.request.spec import SteeringVector
from lens_evals.wire import formats as wire
from tests.conftest import TINY_PROMPTS, capture, greedy
from tests.tolerance import assert_stream_close

HIDDEN = 128
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# --------------------------------------------------------------------------- wire
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("encoding", wire.JSON_ENCODINGS)
def test_every_encoding_keeps_the_native_dtype_bit_for_bit(dtype: torch.dtype, encoding: str) -> None:
    tensor = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    payload = json.loads(json.dumps(wire.encode_array(tensor, encoding)))
    back = wire.decode_tensor(payload)
    assert back.dtype == dtype and torch.equal(back, tensor)
    assert np.array_equal(wire.decode_array(payload), tensor.float().numpy())  # numpy: widened exactly
    if encoding == wire.SAFETENSORS:  # the file is what safetensors itself reads
        assert torch.equal(safetensors_load(base64.b64decode(payload["data"]))["tensor"], tensor)


def test_vllm_lens_helpers_round_trip_and_read_the_legacy_form() -> None:
    tensor = torch.randn(4, 8).to(torch.bfloat16)
    encoded = serialize_tensor(tensor)
    assert encoded["dtype"] == "int16" and encoded["original_dtype"] == "torch.bfloat16" and encoded["compression"] == "zstd"
    assert zstandard.ZstdDecompressor().decompress(base64.b64decode(encoded["data"])) == tensor.view(torch.int16).numpy().tobytes()
    assert torch.equal(deserialize_tensor(encoded), tensor)
    legacy = {"data": base64.b64encode(np.arange(6, dtype=np.float32).tobytes()).decode(), "dtype": "float32", "shape": [2, 3]}
    assert torch.equal(deserialize_tensor(legacy), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    both = {"activations": {"residual_stream": wire.encode_array(tensor)}}
    assert torch.equal(decode_activations(both)["residual_stream"], tensor)
    assert torch.equal(decode_activations({"activations": serialize_activations({"r": tensor})})["r"], tensor)
    assert decode_activations({}) == {}
    results = {"0": {"norm": tensor, "n": 3, "tags": ["a"]}}
    back = deserialize_hook_results(json.loads(json.dumps(serialize_hook_results(results))))
    assert torch.equal(back["0"]["norm"], tensor) and back["0"]["n"] == 3 and back["0"]["tags"] == ["a"]
    with pytest.raises(wire.WireError, match="never unpickled"):
        deserialize_hook_results({"0": {"x": {"__type__": "cloudpickle", "data": "gASVAAAAAAAAAACMBG9zlC4="}}})
    with pytest.raises(wire.WireError, match="unsupported type"):
        serialize_hook_results({"0": {"obj": object()}})  # never pickled


def _their_form(raw: bytes, dtype: str, shape: list[int], original: str | None = None) -> dict:
    payload = {"data": base64.b64encode(raw).decode(), "dtype": dtype, "shape": shape, "compression": "zstd"}
    return payload if original is None else {**payload, "original_dtype": original}


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` memory field (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        match = re.search(rf"^{field}:\s+(\d+) kB$", status.read(), re.MULTILINE)
    assert match, f"no {field} in /proc/self/status"
    return int(match.group(1)) * 1024


def _peak_bytes(call) -> tuple[int, Exception | None]:
    """What ``call`` allocated at its peak: the process's resident set (``VmHWM``, reset first
    through ``/proc/self/clear_refs``) over what it held before, which sees the C allocations
    (zstd, torch, numpy) that tracemalloc cannot, or tracemalloc's peak (Python objects on pages
    already resident), whichever is larger."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")  # resets the peak resident set to the current one (Linux)
    before = _status_bytes("VmRSS")
    tracemalloc.start()
    error = None
    try:
        call()
    except ValueError as exc:
        error = exc
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return max(traced, _status_bytes("VmHWM") - before), error


def _unsized_frame(data: bytes) -> bytes:
    """A zstd frame that does not declare its content size (a streaming writer's frame)."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor(write_content_size=False).stream_writer(out, closefd=False) as writer:
        writer.write(data)
    return out.getvalue()


def test_zip_bombs_are_refused_before_inflating_and_bad_payloads_say_why() -> None:
    big = 256 * 2**20  # 256 MiB of zeros: ~8 KiB compressed
    declared = zstandard.ZstdCompressor().compress(bytes(big))
    unsized = _unsized_frame(bytes(big))
    assert zstandard.frame_content_size(declared) == big and zstandard.frame_content_size(unsized) == -1
    cases = [
        (_their_form(declared, "float32", [65536]), "declares 268435456 bytes but the tensor needs 262144"),
        (_their_form(unsized, "float32", [65536]), "inflates past the 262144 bytes"),
        (_their_form(declared, "float32", [4]), "encoded tensor too large"),  # more bytes than 16 could ever need
        (_their_form(declared, "float32", [2**31]), "over the bound"),  # shape alone is over MAX_DECODED_BYTES
        (
            {"encoding": wire.ENCODING, "data": base64.b64encode(unsized).decode(), "compression": "zstd", "nbytes": 2**20},
            "inflates past the 1048576 bytes",
        ),
    ]
    for payload, message in cases:
        peak, error = _peak_bytes(lambda payload=payload: wire.decode_array(payload))
        assert error is not None and message in str(error), (message, error)
        assert peak < 8 * 2**20, f"{message}: {peak} bytes allocated while refusing"
    good = zstandard.ZstdCompressor().compress(np.ones(64, np.float32).tobytes())
    for payload, message in [
        (_their_form(good[:-6], "float32", [64]), "truncated"),
        (_their_form(b"not zstd at all", "float32", [64]), "not a zstd frame"),
        (_their_form(good, "int16", [64], "torch.float32"), "does not match the storage dtype"),
        (_their_form(good, "complex64", [32]), "unknown storage dtype"),
        (_their_form(good, "int64", [32]), "dtype int64 not allowed"),  # steering vectors are floats
        (_their_form(good, "float32", [64], "torch.float32") | {"compression": "lz4"}, "unknown compression"),
        (_their_form(good, "float32", [-1]), "non-negative integers"),
    ]:
        with pytest.raises(wire.WireError, match=message):
            wire.decode_array(payload)
    assert np.array_equal(wire.decode_array(_their_form(good, "float32", [64])), np.ones(64, np.float32))


def test_client_decodes_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['vllm'] = None\n"
        "import json, numpy as np\n"
        "from lens_evals import client\nfrom lens_evals.wire import formats as wire\n"
        "bits = np.array([0x3f80, 0xc040], dtype=np.uint16)  # bfloat16 1.0, -3.0\n"
        "payload = {'data': __import__('base64').b64encode(bits.tobytes()).decode(), 'dtype': 'int16', "
        "'original_dtype': 'torch.bfloat16', 'shape': [2]}\n"
        "print(client.deserialize_tensor(payload).tolist(), client.activations_from_response("
        "{'activations': {'r': wire.encode_array(np.ones(2, np.float32), 'safetensors-zstd')}})['r'].tolist())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[1.0,", "-3.0]", "[1.0,", "1.0]"]


# --------------------------------------------------------------------------- request forms
def test_request_forms_of_vllm_lens() -> None:
    assert parse_lens_args({"output_residual_stream": True}).capture_all
    assert parse_lens_args({"output_residual_stream": "true"}).for_model(4).capture_layers == [0, 1, 2, 3]
    assert parse_lens_args({"output_residual_stream": "[3, 1]"}).capture_layers == [1, 3]
    with pytest.raises(ValueError, match="output_residual_stream string is not valid JSON"):
        parse_lens_args({"output_residual_stream": "[15"})
    vec = SteeringVector(activations=torch.ones(1, 3, 8), layer_indices=[1])
    assert vec.position_indices == [0, 1, 2]
    assert isinstance(vec.activations, torch.Tensor) and torch.equal(vec.activations.clone(), torch.ones(1, 3, 8))
    dumped = json.loads(json.dumps(vec.model_dump(mode="json")))
    assert SteeringVector.model_validate(dumped).position_indices == [0, 1, 2]
    theirs = {
        "activations": serialize_tensor(torch.full((1, 8), 2.0, dtype=torch.bfloat16)),
        "layer_indices": [2],
        "scale": 0.5,
        "norm_match": False,
        "position_indices": None,
    }
    parsed = parse_lens_args({"apply_steering_vectors": json.dumps([dumped, theirs])}).steering
    assert [v.layer_indices for v in parsed] == [[1], [2]] and torch.equal(parsed[1].activations, torch.full((1, 8), 2.0))
    with pytest.raises(ValueError, match="apply_steering_vectors string is not valid JSON"):
        parse_lens_args({"apply_steering_vectors": "[{"})


def test_hooks_by_name_only_over_json_and_root_exports() -> None:
    assert lens_evals.Hook is Hook and lens_evals.HookContext.__name__ == "HookContext"
    pickled = {"fn": {"cloudpickle": base64.b64encode(b"\x80\x05N.").decode()}, "layer_indices": [0], "pre": False}
    for form in (pickled, json.dumps(pickled), json.dumps([pickled])):
        with pytest.raises(ValueError, match="never runs code sent over the network.*LENS_EVALS_HOOKS=.*record_norm"):
            parse_lens_args({"apply_hooks": form})


def test_vllm_lens_disable_is_honoured(monkeypatch) -> None:
    for value, on in [("1", False), ("true", False), ("on", False), ("0", True), ("", True)]:
        monkeypatch.setenv("VLLM_LENS_DISABLE", value)
        assert plugin.enabled() is on and (plugin.disabled_by() == "VLLM_LENS_DISABLE") is (not on)


# --------------------------------------------------------------------------- engine
SEQ_LENS: list[int] = []


def record_seq_len(ctx, hidden):
    """A hook in vllm-lens's style: ctx.seq_len and ctx.saved."""
    ctx.saved.setdefault("seq_lens", []).append(ctx.seq_len)
    ctx.saved.setdefault(f"rows.{ctx.layer_idx}", []).append(hidden.clone())


def test_capture_steering_and_hook_forms_on_the_engine(llm) -> None:
    prompt = TINY_PROMPTS[0]
    every = llm.generate([prompt], greedy(4, output_residual_stream=True))[0]
    listed = llm.generate([prompt], greedy(4, output_residual_stream="[0, 1, 2, 3]"))[0]
    assert torch.equal(capture(every), capture(listed)) and capture(every).shape[0] == 4
    n = len(every.prompt_token_ids)
    vec = torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(3)) * 4
    implicit = SteeringVector(activations=vec, layer_indices=[1])
    explicit = SteeringVector(activations=vec.numpy(), layer_indices=[1], position_indices=list(range(n)))
    wire_string = json.dumps([implicit.model_dump(mode="json")])
    runs = [
        llm.generate([prompt], greedy(4, output_residual_stream=[1, 2], apply_steering_vectors=form))[0]
        for form in ([implicit], [explicit], wire_string)
    ]
    for run in runs[1:]:
        assert run.outputs[0].token_ids == runs[0].outputs[0].token_ids and torch.equal(capture(run), capture(runs[0]))
    plain = llm.generate([prompt], greedy(4, output_residual_stream=[1, 2]))[0]
    # the reference: the steered layer's prompt rows are the plain ones plus scale * v (scale 1)
    assert_stream_close(capture(runs[0])[0, :n], capture(plain)[0, :n] + vec[0], "steered layer 1 vs plain + v")
    assert not torch.allclose(capture(runs[0])[1, :n], capture(plain)[1, :n])  # and the layer above moved
    hooks = [Hook(fn=record_seq_len, layer_indices=[1, 3]), Hook("record_norm", [1])]
    hooked = llm.generate([prompt], greedy(4, apply_hooks=hooks, output_residual_stream=[1, 3]))[0]
    assert set(hooked.hook_results) == {"0", "1"}
    mine = hooked.hook_results["0"]
    assert mine["seq_lens"] == [n, n] + [1, 1] * 3  # per step per layer: the prefill's n rows, then 3 decode steps of one
    for i, layer in enumerate([1, 3]):  # the rows the hook saw are the capture's rows, bit for bit
        rows, captured = torch.cat(mine[f"rows.{layer}"]), capture(hooked)[i]
        assert rows.shape == captured.shape, f"hook rows at layer {layer}: {tuple(rows.shape)} vs {tuple(captured.shape)}"
        assert torch.equal(rows, captured), f"hook rows at layer {layer}: largest |diff| {float((rows - captured).abs().max()):.3e}"
    assert_stream_close(hooked.hook_results["1"]["norm.1"][: n + 3], capture(hooked)[0].norm(dim=-1), "record_norm")
    assert hooked.activations["saved"].keys() == mine.keys() | hooked.hook_results["1"].keys()


def test_persistent_hooks_offline(llm) -> None:
    prompts = TINY_PROMPTS[1:3]
    llm.register_hooks([Hook("record_norm", [1])])
    first = llm.generate(prompts, greedy(3, output_residual_stream=[1]))
    results = llm.collect_hook_results()
    assert set(results) == {out.request_id for out in first}
    for out in first:
        norms = results[out.request_id]["0"]["norm.1"]
        assert_stream_close(norms[: len(out.prompt_token_ids) + 2], capture(out)[0].norm(dim=-1), "persistent hook")
    assert llm.collect_hook_results().keys() == results.keys()  # collecting does not drain
    llm.register_hooks([Hook("record_norm", [2])])  # appends: hook 1 beside hook 0
    second = llm.generate([prompts[0]], greedy(3))[0]
    assert set(llm.collect_hook_results()[second.request_id]) == {"0", "1"}
    assert set(llm.collect_hook_results()) == results.keys() | {second.request_id}
    llm.clear_hook_results()
    assert llm.collect_hook_results() == {}
    llm.clear_hooks()
    after = llm.generate([prompts[0]], greedy(3))[0]
    assert llm.collect_hook_results() == {} and getattr(after, "hook_results", None) is None
