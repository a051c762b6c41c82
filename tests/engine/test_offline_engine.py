"""lens_evals.engine.frontend.offline: one set of defaults for every offline engine the package opens,
and no other place in the package that constructs ``vllm.LLM``. No engine is started."""

from __future__ import annotations

import ast
from pathlib import Path

from lens_evals.engine.frontend.offline import offline_engine_args
from lens_evals.models.registry import model_path
from tests.conftest import gpu_share, on_gpu

PACKAGE = Path(__file__).resolve().parents[2] / "lens_evals"


def test_defaults_and_overrides(tmp_path: Path) -> None:
    share = gpu_share()  # on a GPU the conftest adds the tests' device share to the defaults
    embedded = offline_engine_args("tiny-llama")
    assert embedded == {
        "model": str(model_path("tiny-llama", prepare=False)),
        "dtype": "float32",
        "max_model_len": 1024,
        "seed": 0,
        **share,
    }
    assert offline_engine_args(str(tmp_path)) == {"model": str(tmp_path), "dtype": "auto", "max_model_len": 1024, "seed": 0, **share}
    overridden = offline_engine_args(str(tmp_path), dtype="bfloat16", max_model_len=4096, enable_lora=True)
    assert overridden == {"model": str(tmp_path), "dtype": "bfloat16", "max_model_len": 4096, "seed": 0, "enable_lora": True, **share}


def test_lora_engines_are_bf16_on_a_gpu() -> None:
    """vLLM's GPU LoRA kernels assert fp16/bf16 adapter weights (0.26; 2026-12-04 the oracle's
    training engine failed so on the H200): a float32 LoRA engine becomes bf16 there; the CPU
    build keeps float32, and other dtypes and engines without LoRA are left alone."""
    lora = offline_engine_args("tiny-llama", enable_lora=True)
    assert lora["dtype"] == ("bfloat16" if on_gpu() else "float32")
    assert offline_engine_args("tiny-llama")["dtype"] == "float32"
    assert offline_engine_args("tiny-llama", enable_lora=True, dtype="float16")["dtype"] == "float16"


# The benchmark times the constructor alone (vllm imported before), with offline_engine_args's options.
TIMED_START = "benchmarks/vllm_systems.py"


def test_the_package_opens_offline_engines_in_one_place() -> None:
    """Every ``LLM(...)`` call in the package (and the checkout's benchmarks/) is in engine/frontend/offline.py,
    but the benchmark's timed one."""
    calls = []
    root = PACKAGE.parent
    for path in sorted([*PACKAGE.rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("LLM", "vllm.LLM"):
                calls.append(f"{path.relative_to(root).as_posix()}:{node.lineno}")
    assert sorted(call.split(":")[0] for call in calls) == [TIMED_START, "lens_evals/engine/frontend/offline.py"], calls
    assert "offline_engine_args(" in (root / TIMED_START).read_text(encoding="utf-8")
