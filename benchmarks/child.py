"""One system in its own process: ``python -m benchmarks.child CONFIG SYSTEM RESULT``.

Writes RESULT (JSON) with the timings, generated token ids and, for capturing systems, a
safetensors file beside it holding the hooked layer's stream on the first prompts."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks.config import BenchConfig
from benchmarks.measure import Measured, Result, SystemUnavailable, own_max_rss_bytes, write_result
from benchmarks.systems import ALL_SYSTEMS, System


def _runner(kind: str) -> Callable[[System, BenchConfig], Measured]:
    if kind == "vllm":
        from benchmarks.vllm_systems import run_vllm

        return run_vllm
    if kind in ("hf", "nnsight-hf", "tl"):
        from benchmarks import hf_systems

        return {"hf": hf_systems.run_hf_hook, "nnsight-hf": hf_systems.run_nnsight_hf, "tl": hf_systems.run_tl_bridge}[kind]
    if kind == "hf-forward":
        from benchmarks.hf_forward import run_hf_forward

        return run_hf_forward
    if kind == "vllm-mixed":
        from benchmarks.interleaved import run_mixed

        return run_mixed
    if kind == "nnsight-vllm":
        from benchmarks.nnsight_vllm import run_nnsight_vllm

        return run_nnsight_vllm
    raise ValueError(f"unknown system kind {kind!r}")


def run(config_path: Path, name: str, result_path: Path) -> Result:
    cfg = BenchConfig.load(config_path)
    system = ALL_SYSTEMS[name]
    result: Result = {"system": name}
    try:
        measured = _runner(system.kind)(system, cfg)
    except SystemUnavailable as exc:
        result.update(status="unavailable", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - the row reports the failure; the run goes on
        traceback.print_exc()
        result.update(status="failed", reason=f"{type(exc).__name__}: {exc}"[:500])
    else:
        result.update(
            status="ok",
            start_seconds=measured.start_seconds,
            warmup_seconds=measured.warmup_seconds,
            seconds=measured.seconds,
            all_seconds=measured.all_seconds,
            generated_tokens=sum(len(t) for t in measured.token_ids),
            token_ids=measured.token_ids,
            notes=measured.notes,
            runs_agree=measured.runs_agree,
        )
        if measured.interleaved:
            result["interleaved"] = measured.interleaved
        if measured.samples:
            from safetensors.torch import save_file

            sample_path = result_path.with_suffix(".samples.safetensors")
            save_file({str(i): t.contiguous() for i, t in measured.samples.items()}, str(sample_path))
            result["samples_file"] = sample_path.name
    result["child_max_rss_bytes"] = own_max_rss_bytes()
    write_result(result_path, result)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m benchmarks.child CONFIG SYSTEM RESULT", file=sys.stderr)
        return 2
    result = run(Path(args[0]), args[1], Path(args[2]))
    return 0 if result["status"] in ("ok", "unavailable") else 1


if __name__ == "__main__":
    sys.exit(main())
