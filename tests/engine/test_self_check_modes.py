"""The stream-contract self-check (lens_evals.engine.frontend.self_check) in graph mode and with tensor /
pipeline parallelism (CPU here; engines started as tests/engine/test_graph_mode.py and
tests/engine/test_parallel.py start them): it runs, passes on the tiny Llama, and fails when the
contract is deliberately wrong (the tiny Llama's ``fused`` read as ``stream_first``: the layer's
output without its residual taken for the stream, which only the steer check sees; swapped in
this process and, through tests/engine/contract_swap/sitecustomize.py, in the spawned workers). Lens
requests are then refused with the numbers, plain ones served."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import pytest

from lens_evals.engine.compat import architectures
from lens_evals.engine.frontend import self_check, self_check_run
from tests.conftest import greedy, make_llm
from tests.engine.test_parallel import NEEDS_TWO_GPUS_ON_A_GPU, bind_two_workers  # noqa: F401 - a fixture

PROMPT = "the cat reads a book."
GRAPH = {"enforce_eager": False, "additional_config": {"lens_evals": {"graph_layers": "all"}}}
MODES = {"graph": GRAPH, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}


SWAP_DIR = Path(__file__).resolve().parent / "contract_swap"


def swap_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama's contract read as ``stream_first`` here and in every process started after."""
    arch = "LlamaForCausalLM"
    entry = architectures.VERIFIED[arch]
    monkeypatch.setitem(architectures.VERIFIED, arch, dataclasses.replace(entry, contract=architectures.STREAM_FIRST))
    monkeypatch.setenv("LENS_TEST_SWAP_CONTRACT", f"{arch}=stream_first")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(SWAP_DIR), os.environ.get("PYTHONPATH")])))


def checked_engine(tiny_path: Any, mode: str, wrong: bool) -> tuple[self_check.SelfCheck, Any, Any]:
    """(the check's result, a plain request's output, what a lens request raised or returned)."""
    with make_llm(tiny_path, max_model_len=512, enable_prefix_caching=False, **MODES[mode]) as llm:
        plain = llm.generate([PROMPT], greedy(4))[0]  # the process's first engine: checked as its first call starts
        result = self_check_run.result_of(llm.llm_engine.input_processor)
        try:
            lens: Any = llm.generate([PROMPT], greedy(2, output_residual_stream=[1]))[0]
        except ValueError as refused:
            lens = refused
    assert result is not None, "the self-check did not run"
    return result, plain, lens


def assert_outcome(result: self_check.SelfCheck, plain: Any, lens: Any, mode: str, wrong: bool) -> None:
    print(result.table())
    assert result.skipped is None and result.error is None, result.table()
    assert len(plain.outputs[0].token_ids) == 4  # plain requests served either way
    assert [c.layer for c in result.layers] == [0, 2, 3]
    if mode == "graph":  # no hooks in graph mode: identity by a zero steer, no handoff
        assert all(math.isnan(c.handoff) for c in result.layers)
    if not wrong:
        assert result.passed, result.table()
        assert lens.activations["residual_stream"].shape[0] == 1
        assert result.layers[-1].steer < 1e-3 and result.layers[-1].control > self_check.CONTROL_MIN, result.table()
        return
    assert not result.passed, result.table()
    # caught by the steer check, orders of magnitude over its bound (Qwen3 swapped the same way: 0.56)
    assert result.layers[-1].steer > 10 * self_check.STEER_BOUND, result.table()
    assert isinstance(lens, ValueError) and "self-check at engine start failed" in str(lens), lens


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LENS_EVALS_SELF_CHECK", "1")


@pytest.mark.parametrize("wrong", [False, True])
def test_self_check_in_graph_mode(tiny_path, checked, monkeypatch, wrong: bool) -> None:
    if wrong:
        swap_contract(monkeypatch)
    assert_outcome(*checked_engine(tiny_path, "graph", wrong), "graph", wrong)


@NEEDS_TWO_GPUS_ON_A_GPU
# slow: PP=2 (either way) and TP=2 with the swap (its spawned workers import torch and the package
# at start): 110-190 s each at load ~10 on the 2-core machine (2026-12-07)
@pytest.mark.parametrize(
    "mode, wrong",
    [("tp2", False), pytest.param("tp2", True, marks=pytest.mark.slow)]
    + [pytest.param("pp2", wrong, marks=pytest.mark.slow) for wrong in (False, True)],
)
def test_self_check_with_two_workers(tiny_path, checked, bind_two_workers, monkeypatch, mode: str, wrong: bool) -> None:  # noqa: F811
    if wrong:
        swap_contract(monkeypatch)
    assert_outcome(*checked_engine(tiny_path, mode, wrong), mode, wrong)
