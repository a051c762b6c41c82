"""Cheap correctness checks across systems: generated tokens against pure vLLM's (greedy), and
the hooked layer's stream against the HF forward hook's on the first prompts."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.config import BenchConfig
from benchmarks.measure import Result
from benchmarks.systems import ALL_SYSTEMS, BASELINE, GRAPHS, HF_FORWARD, REFERENCE


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading token ids two generations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def token_check(result: Result, baseline: Result | None, cfg: BenchConfig) -> Result:
    """{"tokens_equal": bool | None, "prompts_equal": k} against the baseline's ids."""
    if result.get("status") != "ok" or baseline is None or baseline.get("status") != "ok":
        return {"tokens_equal": None}
    system = ALL_SYSTEMS[result["system"]]
    if system.lens == "steer-1" and cfg.steer_scale != 0.0:
        return {"tokens_equal": None, "tokens_note": "steered (scale != 0): tokens differ by design"}
    ours, base = result["token_ids"], baseline["token_ids"]
    equal = sum(a == b for a, b in zip(ours, base))
    if system.name == GRAPHS:
        return {
            "tokens_equal": None,
            "prompts_equal": equal,
            "tokens_note": f"{equal}/{len(base)} equal to eager (compiled kernels: informational)",
        }
    found = {"tokens_equal": equal == len(base) == len(ours), "prompts_equal": equal}
    floor = baseline.get("runs_agree")
    if not found["tokens_equal"] and floor is not None and floor < len(base):
        # The baseline disagrees with itself between its own runs: a difference here is noise.
        return {
            "tokens_equal": None,
            "prompts_equal": equal,
            "tokens_note": f"{equal}/{len(base)} equal; {baseline['system']} agrees with itself on {floor}/{len(base)} (noise floor)",
        }
    return found


def _same_token_positions(result: Result, other: Result, index: int, cfg: BenchConfig) -> int:
    """Positions of prompt ``index`` where both runs saw the same input: the prompt plus the
    generated tokens up to the first difference (later positions see different inputs)."""
    return len(cfg.prompts[index]) + common_prefix(result["token_ids"][index], other["token_ids"][index])


def _samples(result: Result, out_dir: Path) -> dict[int, torch.Tensor] | None:
    name = result.get("samples_file")
    if result.get("status") != "ok" or not name:
        return None
    return {int(k): v for k, v in load_file(str(out_dir / "systems" / name)).items()}


def capture_check(result: Result, reference: Result | None, cfg: BenchConfig, out_dir: Path) -> Result:
    """Max abs diff of the hooked layer's stream vs the reference on the first prompts, over the
    positions where both generated the same tokens (later ones see different inputs)."""
    ours, ref = _samples(result, out_dir), (_samples(reference, out_dir) if reference else None)
    if ours is None or ref is None or reference is None or result is reference:
        return {}
    worst, compared = 0.0, 0
    for index in sorted(set(ours) & set(ref)):
        n = min(_same_token_positions(result, reference, index, cfg), ours[index].shape[0], ref[index].shape[0])
        diff = (ours[index][:n] - ref[index][:n]).abs().max().item() if n else 0.0
        worst, compared = max(worst, diff), compared + n
    scale = max(v.abs().max().item() for v in ref.values())
    return {"capture_max_abs_diff": worst, "capture_positions": compared, "capture_ref_max_abs": scale}


def probe_check(result: Result, capture: Result | None, cfg: BenchConfig, out_dir: Path) -> Result:
    """Probe scores on the worker against ``w . h + b`` computed from our captured stream of
    another run, over the positions where both runs generated the same tokens."""
    from benchmarks.vllm_systems import PROBE_BIAS, probe_weights

    scores, streams = _samples(result, out_dir), (_samples(capture, out_dir) if capture else None)
    if scores is None or streams is None or capture is None:
        return {}
    weights = torch.from_numpy(probe_weights(cfg.hidden_size))
    worst, compared = 0.0, 0
    for index in sorted(set(scores) & set(streams)):
        n = min(_same_token_positions(result, capture, index, cfg), scores[index].shape[0], streams[index].shape[0])
        if n:
            expected = streams[index][:n] @ weights + PROBE_BIAS
            worst = max(worst, (scores[index][:n] - expected).abs().max().item())
        compared += n
    return {"probe_max_abs_diff": worst, "probe_positions": compared, "probe_against": capture["system"]}


def annotate(results: list[Result], cfg: BenchConfig, out_dir: Path) -> None:
    """Add the checks to each result in place."""
    by_name = {r["system"]: r for r in results}
    baseline = by_name.get(BASELINE)
    # HF first (generate + hook, or forward + hook on the prefill workload), else our capture
    candidates = [by_name.get(name) for name in (REFERENCE, HF_FORWARD, "lens-capture-1")]
    reference = next((r for r in candidates if r is not None and r.get("status") == "ok"), None)
    for result in results:
        system = ALL_SYSTEMS[result["system"]]
        # graph-mode rows against pure vLLM with graphs (the same kernels), the others against eager
        result.update(token_check(result, by_name.get(GRAPHS) if system.graph_mode else baseline, cfg))
        if system.lens == "probe":
            capture = by_name.get("lens-graphs-capture-1" if system.graph_mode else "lens-capture-1")
            result.update(probe_check(result, capture, cfg, out_dir))
        elif system.captures_layer:
            result.update(capture_check(result, reference, cfg, out_dir))
        if result.get("capture_max_abs_diff") is not None and reference is not None:
            result["capture_reference"] = reference["system"]
