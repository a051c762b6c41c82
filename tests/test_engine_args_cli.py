"""Every ``lens-evals`` command that opens a vLLM engine takes ``--engine-arg KEY=VALUE`` and its
engine gets it (a researcher sharing a GPU sets ``gpu_memory_utilization`` so). Evidence from the
engine itself: with ``max_model_len=8`` vLLM refuses the command's first prompt as longer than
its maximum length of 8 tokens, where the default (1024) serves it."""

from __future__ import annotations

import pytest

from lens_evals.cli.app import main

COMMANDS = {
    "demo": ["demo", "--model", "tiny-llama", "--layer", "1"],
    "probes train": ["probes", "train", "--model", "tiny-llama", "--layer", "1", "--limit", "4", "--out", "{tmp}"],
    "probes sweep": ["probes", "sweep", "--model", "tiny-llama", "--limit", "4", "--no-roleplaying", "--out", "{tmp}/sweep"],
    "probes train-set": ["probes", "train-set", "--model", "tiny-llama", "--layer", "1", "--limit", "4", "--control-limit", "2"],
    "probes science": ["probes", "science", "--model", "tiny-llama", "--limit", "4", "--control-limit", "2", "--out", "{tmp}"],
    "oracle train": ["oracle", "train", "--train-per-family", "1", "--eval-per-family", "1", "--epochs", "1"],
}


# vLLM's refusal: 0.32 "maximum context length is 8 tokens", earlier "maximum model length of 8"
LONGER_THAN_8 = r"maximum (context length is 8 tokens|model length of 8)"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_engine_arg_reaches_the_commands_engine(command, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("LENS_EVALS_PROBE_DIR", str(tmp_path / "probes"))
    monkeypatch.setenv("LENS_EVALS_ORACLE_DIR", str(tmp_path / "oracles"))
    argv = [arg.format(tmp=tmp_path) for arg in COMMANDS[command]]
    from vllm.exceptions import VLLMValidationError  # a ValueError in vLLM 0.26, not in 0.32

    with pytest.raises((ValueError, VLLMValidationError), match=LONGER_THAN_8):
        main([*argv, "--engine-arg", "max_model_len=8"])
