"""A probe (or probe set) applied by an Inspect task to a model other than the one it was trained
on is refused with a message naming both. tiny-moe has tiny-llama's shape (hidden 128, 4 layers),
so neither the engine's hidden-size check nor its layer check can tell: the eval used to succeed,
reporting AUROC and recall of a probe reading another model's activations."""

from __future__ import annotations

import json

import numpy as np
from inspect_ai import eval as inspect_eval

from lens_evals.evals.roleplaying import roleplaying_task
from lens_evals.evals.roleplaying.multi_probe import roleplaying_probes_task
from lens_evals.probing.multi import ProbeSet, Readout
from tests.report.test_report import random_probe


def test_a_probe_of_another_model_is_refused_by_the_eval(tmp_path, tiny_path) -> None:
    own = random_probe(tmp_path / "own")  # tiny-llama's layer 1, hidden 128
    other = random_probe(tmp_path / "other")
    card_file = other.with_suffix(".json")
    card_file.write_text(json.dumps({**json.loads(card_file.read_text()), "model": "tiny-moe"}))
    weights = np.random.default_rng(0).normal(size=128).astype(np.float32)
    other_set = ProbeSet("tiny-moe", 1, {"ip-lr": Readout("ip-lr", 1, weights, 0.0, 1.0)}).save(tmp_path / "moe__probe-set")
    tasks = [
        roleplaying_task(other, tokenizer=str(tiny_path)),
        roleplaying_probes_task(other_set, probes="ip-lr", tokenizer=str(tiny_path)),
        roleplaying_task(own, tokenizer=str(tiny_path)),
    ]
    logs = inspect_eval(tasks, model="vllm-lens/tiny-llama", limit=1, log_dir=str(tmp_path / "logs"), display="none", max_tasks=1)
    assert [log.status for log in logs] == ["error", "error", "success"], [log.error for log in logs]
    messages = [log.error.message if log.error else "" for log in logs[:2]]
    assert "probe tiny-random-0 was trained on tiny-moe, not on the evaluated model tiny-llama" in messages[0]
    assert "probe set was trained on tiny-moe, not on the evaluated model tiny-llama" in messages[1]
