"""A model whose logits barely depend on the stream (vLLM's ``load_format=dummy`` weights on the
GPU, 2026-12-07: a random vector moved the log-probs 5.7e-6) cannot show whether doubling the
stream leaves the log-probs alone: the steer check is not judged there, and lens requests are
served — before, such an engine refused every lens request although its contract was right."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lens_evals.engine.frontend import self_check, self_check_run
from tests.conftest import greedy, make_llm


def flat_logits_model(tiny_path: Path, out: Path) -> Path:
    """The tiny Llama with its final norm's weight scaled by 1e-7: every stream maps to almost
    the same logits (the decoder layers, and so the stream contract, unchanged)."""
    shutil.copytree(tiny_path, out)
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1e-7
    save_file(tensors, weights, metadata={"format": "pt"})
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    return out


def test_flat_logits_leave_the_steer_check_unjudged_and_lens_requests_served(tiny_path, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")
    with make_llm(flat_logits_model(tiny_path, tmp_path / "flat"), max_model_len=512) as llm:
        out = llm.generate(["the cat reads a book."], greedy(2, output_residual_stream=[0, 1]))
        stream = out[0].activations["residual_stream"]
        assert stream.shape[0] == 2 and torch.isfinite(stream.float()).all()
        checked = self_check_run.result_of(llm.llm_engine.input_processor)
        assert checked is not None, "the self-check did not run"
        last = checked.layers[-1]
        assert last.control < self_check.CONTROL_MIN, checked.table()  # the logits really are flat
        assert checked.passed and checked.inconclusive, checked.table()
        assert "steer not judged" in checked.table() and checked.to_json()["inconclusive"] is True


def test_a_right_contract_in_bfloat16_passes(tiny_path, monkeypatch) -> None:
    """bfloat16 rounds the doubled stream: its log-probs move ~1e-2 with the right contract (the
    float32 bound), which refused lens requests on a correct model before the bound per dtype."""
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")
    with make_llm(tiny_path, max_model_len=512, dtype="bfloat16") as llm:
        out = llm.generate(["the cat reads a book."], greedy(2, output_residual_stream=[0]))
        assert out[0].activations["residual_stream"].shape[0] == 1
        checked = self_check_run.result_of(llm.llm_engine.input_processor)
        assert checked is not None and checked.dtype == "bfloat16" and checked.passed, checked and checked.table()
        assert checked.layers[-1].steer <= self_check.steer_bound("bfloat16"), checked.table()


def test_smollm2_in_bfloat16_on_the_cpu_passes(monkeypatch) -> None:
    """vLLM's CPU kernels add a fused layer's hidden and residual in float32; the identity's
    write-back is their rounded bfloat16 sum, which moved SmolLM2's log-probs by 0.13-0.22
    through 30 layers with the right contract, over the old fixed 1e-1: lens requests were
    refused. The rounding control (a rounding-sized change of the stream) measures that movement
    on the model itself (0.10-0.23): judged against it, the check passes."""
    from lens_evals.models.registry import model_path

    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")
    with make_llm(model_path("smollm2-135m-instruct"), max_model_len=512, dtype="bfloat16", enable_prefix_caching=False) as llm:
        out = llm.generate(["the cat reads a book."], greedy(1, output_residual_stream=[0]))
        assert out[0].activations["residual_stream"].shape[0] == 1  # served
        checked = self_check_run.result_of(llm.llm_engine.input_processor)
        assert checked is not None and checked.dtype == "bfloat16" and checked.passed, checked and checked.table()
        for layer in checked.layers:
            assert layer.rounding > 0 and layer.identity <= layer.identity_bound("bfloat16"), checked.table()
        assert max(c.identity for c in checked.layers) > self_check.bounds("bfloat16")[0], "the floor alone now suffices: test moot"
