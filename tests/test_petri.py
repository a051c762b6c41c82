"""Petri end to end: Petri's audit runs in its own Python 3.12 venv with a client-only lens_evals
(scripts/setup_petri.sh), the target is SmolLM2 on a lens server started from this venv, the
auditor and judge are scripted. The auditor's ``target_activations`` tool must return the probe
score of the target's real reply, equal to an offline-engine capture of the same conversation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lens_evals.evals.server_process import LensServer
from lens_evals.probing.dialogues import Dialogue
from lens_evals.probing.extract import extract_features
from lens_evals.probing.train import train_probe
from tests.conftest import make_llm

ROOT = Path(__file__).resolve().parents[1]
PETRI_PYTHON = ROOT / ".venv-petri" / "bin" / "python"
LAYER = 15


@pytest.mark.slow
def test_petri_audit_with_probe_tool(smollm2_path, tmp_path) -> None:
    subprocess.run(["bash", str(ROOT / "scripts" / "setup_petri.sh")], check=True, cwd=ROOT)
    with make_llm(smollm2_path, enable_prefix_caching=False) as llm:
        probe = train_probe(str(smollm2_path), layer=LAYER, training_set="coup", llm=llm, limit=160, control_limit=12,
                            control_max_tokens=16, out_dir=tmp_path, name="coup-small")
    server = LensServer(str(smollm2_path), "smollm2-135m-instruct", {"dtype": "float32", "max_model_len": 2048}).start()
    try:
        started = time.monotonic()
        run = subprocess.run([str(PETRI_PYTHON), str(ROOT / "tests" / "scripts" / "petri_e2e.py"),
                              "--base-url", f"{server.url}/v1", "--probe", str(tmp_path / "coup-small.joblib"),
                              "--log-dir", str(tmp_path / "logs"), "--out", str(tmp_path / "result.json")],
                             cwd=ROOT, capture_output=True, text=True, timeout=900)
        audit_seconds = time.monotonic() - started
    finally:
        server.stop()
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "success", result
    chat = [{"role": m["role"], "content": m["content"]} for m in result["target_messages"]]
    assert [m["role"] for m in chat] == ["system", "user", "assistant"] and chat[-1]["content"].strip()
    [inspection] = result["inspections"]
    assert inspection["target_message_id"] == result["target_messages"][-1]["id"]
    assert inspection["probe"] == "coup-small" and inspection["layer"] == LAYER
    [answer] = result["tool_answers"]
    assert f"{inspection['score']:.3f}" in answer and ("FLAGGED" in answer) == inspection["flagged"]

    with make_llm(smollm2_path, enable_prefix_caching=False) as llm:
        [features] = extract_features(llm, [Dialogue(messages=chat, label=None)], [LAYER])
    assert inspection["score"] == pytest.approx(probe.score(features[0]), abs=1e-3)
    assert inspection["n_tokens"] == features.shape[1]
    print(f"\nPetri audit (Python {sys.version_info.major}.{sys.version_info.minor} here, 3.12 there): "
          f"{audit_seconds:.0f} s for the audit subprocess; target said {chat[-1]['content'][:80]!r}; "
          f"probe score {inspection['score']:.3f}")
