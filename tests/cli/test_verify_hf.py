"""``lens-evals verify MODEL`` against HF transformers (lens_evals/cli/verify_hf.py): capture and
steering of every layer on SmolLM2 and on a tiny zoo model of the ``stream`` contract (GPT-2)
within the dtype's bound, the table printed, exit 0; a deliberately wrong contract fails against
HF by orders of magnitude (exit 1), with the self-check off (HF alone) and on (the check fails
first and the comparison is not run: lens requests are refused)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from lens_evals.cli.verify import run_verify
from lens_evals.cli.verify_hf import HFComparison, LayerRow, compared_layers, hf_unloadable
from lens_evals.engine.compat import architectures
from tests.arch_zoo import build


def verify(
    capsys: pytest.CaptureFixture[str], model: str | Path, engine_args: dict[str, Any], **options: Any
) -> tuple[int, dict[str, Any]]:
    """(exit status, the JSON printed) of ``lens-evals verify MODEL --json``, run in this process
    (the CLI end to end: tests/engine/test_self_check.py); the HF reference runs in a process of its own."""
    status = run_verify(str(model), engine_args, as_json=True, **options)
    out = "\n" + capsys.readouterr().out  # vLLM may log to stdout before the JSON
    return status, json.loads(out[out.rindex("\n{\n") + 1 :])


def assert_within_bound(hf: dict[str, Any], num_layers: int) -> None:
    assert hf["skipped"] is None and hf["error"] is None and hf["passed"] is True, hf
    assert [row["layer"] for row in hf["rows"]] == list(range(num_layers))
    for row in hf["rows"]:
        assert row["capture"] <= hf["bound"] and row["steering"] <= hf["bound"] and row["passed"], row
        # steering moved the stream far more than the error: the comparison can tell it landed
        assert row["effect"] > 100 * max(row["steering"], hf["bound"] / 100), row


@pytest.mark.parametrize("model, num_layers", [("smollm2-135m-instruct", 30), ("zoo:GPT2LMHeadModel", 2)])
def test_verify_compares_every_layer_with_hf(model: str, num_layers: int, monkeypatch, capsys) -> None:
    """SmolLM2 (fused contract, 30 layers) and the tiny GPT-2 (stream contract, LayerNorm): every
    layer's capture and steering within the fp32 bound, steering's effect ~1e5 times the error."""
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "0")  # restored after the test (run_verify sets it)
    path = build(model.removeprefix("zoo:")) if model.startswith("zoo:") else model
    status, printed = verify(capsys, path, {"dtype": "float32"})
    assert status == 0, printed
    assert printed["passed"] is True and printed["skipped"] is None  # the self-check ran and passed
    hf = printed["hf"]
    assert hf["dtype"] == "float32" and hf["bound"] == 1e-4 and hf["prompts"] == 2
    assert_within_bound(hf, num_layers)
    fields = {k: v for k, v in hf.items() if k != "passed"} | {"rows": [LayerRow(**row) for row in hf["rows"]]}
    table = HFComparison(**fields).table().splitlines()
    print("\n".join(table))
    assert "PASS" in table[0] and "engine float32" in table[0]
    assert table[1].split() == ["layer", "capture", "steering", "effect", "bound", "result"]
    assert [line.split()[0] for line in table[2:-1]] == [str(n) for n in range(num_layers)]
    assert all(line.endswith("pass") for line in table[2:-1]) and table[-1].startswith("largest prompt log-prob gap")


# The tiny Llama's contract (fused: the layer returns (hidden, residual)) swapped: read as
# ``stream_first`` (the layer's output without its residual taken for the stream) the numbers are
# wrong; read as ``stream`` (a tensor expected) the tap fails.
@pytest.mark.parametrize(
    "swapped, self_check",
    [
        ("stream_first", False),
        pytest.param("stream_first", True, marks=pytest.mark.slow),
        pytest.param("stream", False, marks=pytest.mark.slow),
    ],
)
def test_a_wrong_contract_fails_against_hf(tiny_path, monkeypatch, capsys, swapped: str, self_check: bool) -> None:
    arch = "LlamaForCausalLM"
    contract = {"stream_first": architectures.STREAM_FIRST, "stream": architectures.STREAM}[swapped]
    monkeypatch.setitem(architectures.VERIFIED, arch, dataclasses.replace(architectures.VERIFIED[arch], contract=contract))
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "0")  # restored after the test (run_verify sets it)
    status, printed = verify(capsys, tiny_path, {"dtype": "float32"}, self_check=self_check)
    assert status == 1
    hf = printed["hf"]
    if self_check:  # the self-check fails first; lens requests are refused, so HF is not compared
        assert printed["passed"] is False and hf["skipped"] == "lens requests are refused: the self-check failed"
        return
    assert printed["skipped"] == "LENS_EVALS_SELF_CHECK=0" and hf["passed"] is False, hf
    if swapped == "stream":
        assert "a 'stream' decoder layer returned a tuple of (Tensor, Tensor)" in hf["error"], hf
        return
    assert [row["layer"] for row in hf["rows"]] == [0, 1, 2, 3]
    print(json.dumps(hf["rows"], indent=1))
    for row in hf["rows"]:
        assert row["capture"] > 100 * hf["bound"] and row["steering"] > 100 * hf["bound"] and not row["passed"], row


def test_what_hf_cannot_load_is_said_and_not_compared(tmp_path, tiny_path) -> None:
    assert hf_unloadable(str(tiny_path)) is None
    assert "not a local model directory" in str(hf_unloadable("org/some-model"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    assert "has no class ['NoSuchForCausalLM']" in str(hf_unloadable(str(tmp_path)))
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "fp8"}})
    )
    assert "a quantised checkpoint (fp8)" in str(hf_unloadable(str(tmp_path)))
    assert compared_layers(0, 4) == [0, 1, 3] and compared_layers(3, 4) == [3] and compared_layers(2, 4) == [2, 3]
