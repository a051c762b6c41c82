"""Petri end to end: Petri's audit runs in its own Python 3.12 venv with a client-only lens_evals
(scripts/setup_petri.sh); the target is SmolLM2 on a lens server started from this venv that also
serves the trained oracle adapter (smollm2-135m-oracle-small, trained first if the cache has none)
and parses tool calls (the ChatML tool template, vLLM's hermes parser); synthetic target tools are
on; the auditor and judge are scripted (tests/scripts/petri_e2e.py).

It checks: the target makes a tool call that the log shows, the auditor answers it and the target
goes on; every oracle answer equals the offline oracle's (``lens_evals.oracle.inference``) on
activations captured offline at token positions found independently (character offsets of the HF
tokenizer's rendering), the quoted span included; the probe's score equals the probe on the
offline capture; a layer out of range and an empty span come back to the auditor as tool errors
and the audit goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from lens_evals.inspect_kit.provider.lora_args import lora_server_args
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.oracle.adapters import RECIPES, SMALL_ORACLE, oracle_path, read_card
from lens_evals.oracle.inference import OracleSettings
from lens_evals.probing.probe import Probe
from tests.conftest import make_llm
from tests.petri_reference import TOOL_TEMPLATE, capture_ids, offline_oracle, random_probe, turn_by_characters
from tests.tolerance import assert_dialogue_scores_close

ROOT = Path(__file__).resolve().parents[1]
PETRI_PYTHON = ROOT / ".venv-petri" / "bin" / "python"
PROBE_LAYER = 15
MAX_POSITIONS, MAX_TOKENS = 64, 16  # OracleInspector's defaults


def trained_oracle() -> tuple[Path, float]:
    """The small oracle's directory (trained now if the cache has none) and the training's seconds."""
    from lens_evals.oracle.build import build_oracle

    try:
        return oracle_path(SMALL_ORACLE), 0.0
    except FileNotFoundError:
        started = time.monotonic()
        directory, _ = build_oracle(SMALL_ORACLE, RECIPES[SMALL_ORACLE])
        return directory, time.monotonic() - started


def quick_probe(directory: Path) -> Probe:
    """A probe fitted to random features: only the alignment of its scores is checked here."""
    probe = random_probe("random-576", "smollm2-135m-instruct", PROBE_LAYER, 576)
    probe.save(directory)
    return probe


def conversation_upto(messages: list[dict[str, Any]], message_id: str) -> list[dict[str, Any]]:
    index = next(n for n, message in enumerate(messages) if message["id"] == message_id)
    return [{key: value for key, value in message.items() if key != "id"} for message in messages[: index + 1]]


@pytest.mark.slow
def test_petri_audit_with_oracle_probe_and_target_tools(smollm2_path, tmp_path) -> None:
    from transformers import AutoTokenizer
    from vllm.lora.request import LoRARequest

    subprocess.run(["bash", str(ROOT / "scripts" / "setup_petri.sh")], check=True, cwd=ROOT)
    oracle_dir, train_seconds = trained_oracle()
    probe = quick_probe(tmp_path)
    args = lora_server_args(
        {
            "dtype": "float32",
            "max_model_len": 2048,
            "lora_modules": f"oracle={oracle_dir}",
            "chat_template": str(TOOL_TEMPLATE),
            "tool_call_parser": "hermes",
            "enable_auto_tool_choice": True,
        }
    )
    server = LensServer(str(smollm2_path), "smollm2-135m-instruct", args).start()
    try:
        started = time.monotonic()
        run = subprocess.run(
            [
                str(PETRI_PYTHON),
                str(ROOT / "tests" / "scripts" / "petri_e2e.py"),
                "--base-url",
                f"{server.url}/v1",
                "--probe",
                str(tmp_path / "random-576.safetensors"),
                "--oracle",
                str(oracle_dir),
                "--log-dir",
                str(tmp_path / "logs"),
                "--out",
                str(tmp_path / "result.json"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        audit_seconds = time.monotonic() - started
    finally:
        server.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "success", result

    messages = result["target_messages"]
    calls = [call for message in messages if message["role"] == "assistant" for call in message.get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "bash", messages
    assert [m["role"] for m in messages].count("tool") >= 1 and messages[-1]["role"] == "assistant"

    errors = [call for call in result["tool_calls"] if call["error"]]
    assert [call["arguments"].get("layer") for call in errors] == [99, None]
    assert "capture layer 99 out of range: the model has 30 layers" in errors[0]["error"]
    assert "the span is empty" in errors[1]["error"]
    inspections = result["inspections"]
    oracle_records = [r for r in inspections if r["inspector"] == "oracle"]
    [probe_record] = [r for r in inspections if r["inspector"] == "probe"]
    assert len(oracle_records) == 3 and len(result["tool_calls"]) == 6  # four answered, two after the errors

    settings = OracleSettings(
        **{key: read_card(str(oracle_dir))["oracle"][key] for key in ("target_layer", "injection_layer", "placeholder", "coefficient")},
        num_tokens=None,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_path))
    lora = LoRARequest("oracle", 1, str(oracle_dir))
    with make_llm(smollm2_path, enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=False) as llm:
        for record in [*oracle_records, probe_record]:
            chat = conversation_upto(messages, record["target_message_id"])
            ids, positions = turn_by_characters(tokenizer, chat, result["tools"], record["span"])
            assert list(range(*record["read_tokens"])) == positions and record["n_prompt"] == len(ids), record
            if record["inspector"] == "probe":
                stream = capture_ids(llm, ids, PROBE_LAYER)
                assert_dialogue_scores_close([record["score"]], [probe.score(stream[positions])], f"probe record {record}")
                continue
            stream = capture_ids(llm, ids, settings.target_layer)
            offline = offline_oracle(llm, tokenizer, lora, settings, stream[positions][-MAX_POSITIONS:], record["question"], MAX_TOKENS)
            assert record["answer"] == offline, record
    assert any(r["span"] == "/models" for r in oracle_records)
    print(
        f"\nPetri audit (Python {sys.version_info.major}.{sys.version_info.minor} here, 3.12 there): oracle training "
        f"{train_seconds:.0f} s (0: cached), audit subprocess {audit_seconds:.0f} s (audit itself {result['seconds']} s); "
        f"tool call {calls[0]['function']}; oracle answers {[r['answer'] for r in oracle_records]}; "
        f"probe score {probe_record['score']:.3f}"
    )
