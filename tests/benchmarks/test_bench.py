"""``lens-evals bench`` end to end on the tiny Llama (each system in its own process), and the
pieces that need no engine."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from benchmarks.config import BenchConfig
from benchmarks.interleaved import FEATURES, rotated, summarise
from benchmarks.prompts import MAX_TOKENS, MIN_TOKENS, make_prompts
from benchmarks.systems import ALL_SYSTEMS
from benchmarks.vllm_systems import lens_extra_args
from lens_evals.cli.app import main
from lens_evals.request import spec
from tests.conftest import on_gpu
from tests.tolerance import stream_bound


def test_bench_end_to_end(tiny_path, tmp_path) -> None:
    out = tmp_path / "bench"
    systems = ["vllm-eager", "lens-capture-1", "lens-mixed", "hf-hook"]
    code = main(
        ["bench", "--model", str(tiny_path), "--prompts", "2", "--max-tokens", "2", "--systems", ",".join(systems), "--out", str(out)]
    )
    report = json.loads((out / "bench.json").read_text())
    rows = {row["system"]: row for row in report["rows"]}
    assert list(rows) == systems
    for name in systems:
        assert rows[name]["status"] == "ok", rows[name].get("reason")
        assert rows[name]["seconds"] > 0 and rows[name]["peak_rss_bytes"] > 0
        assert rows[name]["generated_tokens"] == 4
        assert rows[name]["tokens_equal"] is True, f"{name}: generated tokens differ from pure vLLM"
    assert rows["vllm-eager"]["x_eager"] == pytest.approx(1.0)
    # Our capture of the hooked layer against the HF forward hook on the same positions.
    assert rows["lens-capture-1"]["capture_reference"] == "hf-hook"
    assert rows["lens-capture-1"]["capture_positions"] == sum(len(p) + 2 - 1 for p in _prompts(out))
    # fp32 on CPU: within 1e-3. On a GPU vLLM's fp32 matmuls run in TF32 (HF here on the CPU):
    # the backend's relative bound times the largest |h| (TF32 rounding simulated on the CPU moved
    # this layer by up to 6.9e-3 at |h| <= 6.5, against a bound of ~0.13; a shifted row is off by ~|h|)
    capture_bound = stream_bound() * rows["lens-capture-1"]["capture_ref_max_abs"] if on_gpu() else 1e-3
    assert rows["lens-capture-1"]["capture_max_abs_diff"] < capture_bound
    # One engine, every feature in alternating rounds: each timed per round, tokens as plain's.
    mixed = rows["lens-mixed"]["interleaved"]
    assert set(mixed["summary"]) == set(FEATURES)
    assert all(len(mixed["times"][f]) == 2 and min(mixed["times"][f]) > 0 for f in FEATURES)
    assert all("tokens equal plain on 2/2" in note for note in rows["lens-mixed"]["notes"][:3])
    assert "| lens-mixed | steer-1 |" in (out / "bench.md").read_text()
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| lens-capture-1 |" in (out / "bench.md").read_text()
    assert code == 0


def _prompts(out) -> list[list[int]]:
    return BenchConfig.load(out / "config.json").prompts


def test_prompt_set_is_deterministic_and_varied(tiny_path) -> None:
    first = make_prompts(32, tiny_path, vocab_size=512)
    assert first == make_prompts(32, tiny_path, vocab_size=512)
    lengths = [len(p) for p in first]
    assert min(lengths) >= MIN_TOKENS and max(lengths) <= MAX_TOKENS and len(set(lengths)) > 8
    assert len({tuple(p) for p in first}) == 32
    no_tokenizer = make_prompts(8, tiny_path / "missing", vocab_size=128256)
    assert all(1000 <= t < 128256 for p in no_tokenizer for t in p)


def test_probe_system_asks_for_one_fixed_probe_on_the_bench_layer() -> None:
    """The probe is the same in every system's process (its scores are checked against w.h + b
    of the capture), on the configured layer and of the model's hidden size."""
    cfg = BenchConfig(model_dir="", prompts=[[1]], max_tokens=1, layer=1, num_layers=2, hidden_size=8)
    (probe,) = lens_extra_args(ALL_SYSTEMS["lens-probe"], cfg)[spec.PROBE_KEY]
    assert isinstance(probe, spec.LinearProbe) and probe.layer == 1 and probe.weights.shape == (8,)
    (again,) = lens_extra_args(ALL_SYSTEMS["lens-probe"], cfg)[spec.PROBE_KEY]
    assert again.name == probe.name and again.bias == probe.bias and (again.weights == probe.weights).all()
    assert lens_extra_args(ALL_SYSTEMS["lens-probe"], replace(cfg, layer=0))[spec.PROBE_KEY][0].layer == 0


def test_interleaved_rounds_rotate_and_ratios_pair_rounds() -> None:
    assert [rotated(("a", "b", "c"), i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    times = {"plain": [2.0, 4.0, 3.0], "steer-1": [3.0, 4.4, 3.0]}
    summary = summarise(times)
    # per round 1.5, 1.1, 1.0: median 1.1; the bests 3.0 / 2.0
    assert summary["steer-1"]["x_plain_paired_median"] == pytest.approx(1.1)
    assert (summary["steer-1"]["x_plain_paired_min"], summary["steer-1"]["x_plain_paired_max"]) == pytest.approx((1.0, 1.5))
    assert summary["steer-1"]["x_plain_best"] == pytest.approx(1.5)
    assert summary["plain"]["median_s"] == pytest.approx(3.0)


def test_token_check_reports_differences_under_the_baselines_own_noise_floor() -> None:
    from benchmarks.checks import token_check

    cfg = BenchConfig(model_dir="", prompts=[[1], [2], [3]], max_tokens=1, layer=1, num_layers=2, hidden_size=8)
    ours = {"system": "lens-capture-1", "status": "ok", "token_ids": [[5], [6], [9]]}
    steady = {"system": "vllm-eager", "status": "ok", "token_ids": [[5], [6], [7]], "runs_agree": 3}
    assert token_check(ours, steady, cfg) == {"tokens_equal": False, "prompts_equal": 2}
    flaky = {**steady, "runs_agree": 1}  # the baseline itself changed 2 of 3 outputs between runs
    found = token_check(ours, flaky, cfg)
    assert found["tokens_equal"] is None and "1/3 (noise floor)" in found["tokens_note"]
    assert token_check({**ours, "token_ids": steady["token_ids"]}, flaky, cfg)["tokens_equal"] is True
    graphs = token_check({**ours, "system": "vllm-graphs"}, steady, cfg)
    assert graphs["tokens_equal"] is None and graphs["prompts_equal"] == 2


@pytest.mark.slow  # ~60 s on 2 CPU cores; test_bench_end_to_end runs the bench by default
def test_prefill_workload_captures_every_prompt_token(tiny_path, tmp_path) -> None:
    """``--workload prefill``: Alpaca-like lengths, one new token, every prompt token captured.
    Our capture (a batch of prompts, several layers) and HF forward + hook (right-padded,
    length-sorted batches) each equal a single-prompt HF forward on the first prompts."""
    from safetensors.torch import load_file

    from benchmarks.prefill import PREFILL_MAX, PREFILL_MIN, capture_layers
    from tests.hf_reference import HFReference
    from tests.tolerance import assert_stream_close

    out = tmp_path / "prefill"
    systems = ["vllm-eager", "lens-capture-8", "lens-mixed", "hf-forward"]
    code = main(
        [
            "bench",
            "--workload",
            "prefill",
            "--model",
            str(tiny_path),
            "--prompts",
            "3",
            "--hf-batches",
            "1,2",
            "--systems",
            ",".join(systems),
            "--out",
            str(out),
        ]
    )
    cfg = BenchConfig.load(out / "config.json")
    assert cfg.workload == "prefill" and cfg.max_tokens == 1 and cfg.probe_count == 3
    assert all(PREFILL_MIN <= len(p) <= PREFILL_MAX for p in cfg.prompts)
    report = json.loads((out / "bench.json").read_text())
    rows = {row["system"]: row for row in report["rows"]}
    assert list(rows) == systems
    for name in systems:
        assert rows[name]["status"] == "ok", rows[name].get("reason")
        assert rows[name]["generated_tokens"] == 3 and rows[name]["tokens_equal"] is True, name
    # the tiny Llama has 4 layers: "8 layers" are all of them, the bench layer among them
    assert capture_layers("capture-8", cfg.num_layers, cfg.layer) == [0, 1, 2, 3]
    reference = HFReference(tiny_path)
    for name in ("lens-capture-8", "hf-forward"):
        samples = load_file(str(out / "systems" / rows[name]["samples_file"]))
        assert sorted(samples) == ["0", "1"]
        for index in (0, 1):
            expected = reference.residual_stream(cfg.prompts[index], [cfg.layer])[0]
            assert samples[str(index)].shape == expected.shape  # every prompt token, no more
            assert_stream_close(samples[str(index)], expected, f"{name}, prompt {index}")
    assert rows["lens-capture-8"]["capture_reference"] == "hf-forward"
    assert rows["lens-capture-8"]["capture_positions"] == len(cfg.prompts[0]) + len(cfg.prompts[1])
    moved = sum(len(p) for p in cfg.prompts) * 4 * cfg.hidden_size * 4  # 4 layers, float32
    assert f"= {moved / 1e9:.3f} GB moved" in " ".join(rows["lens-capture-8"]["notes"])
    assert "batch " in rows["hf-forward"]["notes"][0]
    # one engine, paired rounds: plain and each feature (capture 1 and 8 layers, steering, 3 probes)
    mixed = rows["lens-mixed"]["interleaved"]
    assert set(mixed["summary"]) == {"plain", "capture-1", "capture-8", "steer-1", "probe"}
    text = (out / "bench.md").read_text()
    assert "Workload prefill" in text and "| lens-mixed | capture-8 |" in text and "Targets (issue #21)" in text
    assert code == 0


def test_prefill_lengths_and_layer_sets() -> None:
    from benchmarks.prefill import PREFILL_MAX, PREFILL_MIN, many_layers, prefill_lengths

    lengths = prefill_lengths(1000)
    assert lengths == prefill_lengths(1000) and lengths != prefill_lengths(1000, seed=1)
    assert min(lengths) >= PREFILL_MIN and max(lengths) <= PREFILL_MAX
    assert 150 < sum(lengths) / len(lengths) < 190  # the set: 169,905 tokens in 1,000 prompts
    assert many_layers(32, 16) == [0, 4, 9, 13, 16, 22, 27, 31]
    assert many_layers(30, 15) == sorted(set(many_layers(30, 15))) and len(many_layers(30, 15)) == 8 and 15 in many_layers(30, 15)


def test_phase_log_is_read_fetch_by_fetch(tmp_path) -> None:
    """``benchmarks.phases`` joins each fetch's worker and frontend timing lines (the worker's
    with or without the prefix vLLM gives an engine core's lines)."""
    from benchmarks.phases import fetches

    log = tmp_path / "mixed.log"
    log.write_text(
        "INFO other line\n"
        "lens_evals timing (worker): fetch: release 0.3 ms / 1, plan 1.5 ms / 6, taps (queued) 22.6 ms / 6\n"
        "lens_evals timing (frontend): fetch: attach to outputs 5.6 ms / 1\n"
        "(EngineCore pid=1407) lens_evals timing (worker): store 89.8 ms / 6\n"  # a multiprocess engine's line
        "lens_evals timing (frontend): fetch: worker round trip 16.6 ms / 1\n"
    )
    assert fetches(log) == [
        {"fetch: release": 0.3, "plan": 1.5, "taps (queued)": 22.6, "fetch: attach to outputs": 5.6},
        {"store": 89.8, "fetch: worker round trip": 16.6},
    ]


def test_gpu_prefill_pairs_each_capture_with_its_round_without_copy_overlap() -> None:
    """The ``-sync`` rounds (GPU, prefill) ask for the same capture with the copy overlap off for
    that round alone, and fail loudly when the worker did not turn it off."""
    from benchmarks.interleaved import copy_overlap, features_of
    from lens_evals.engine.transport.protocol import COPY_METHOD

    cfg = BenchConfig(model_dir="m", prompts=[[1, 2]], max_tokens=1, layer=1, num_layers=4, hidden_size=8, workload="prefill")
    eager, graphs = ALL_SYSTEMS["lens-mixed"], ALL_SYSTEMS["lens-graphs-mixed"]
    assert not any(f.endswith("-sync") for f in features_of(eager, cfg))  # on CPU there is no copy to overlap
    gpu = replace(cfg, device="cuda")
    assert features_of(eager, gpu)[-2:] == ("capture-1-sync", "capture-8-sync")
    assert features_of(graphs, gpu) == (*FEATURES, "capture-1-sync")
    assert not any(f.endswith("-sync") for f in features_of(eager, replace(gpu, workload="decode")))

    class Engine:
        def __init__(self, honours: bool) -> None:
            self.calls: list[tuple[str, tuple]] = []
            self.honours = honours

        def collective_rpc(self, method: str, args: tuple) -> list[dict]:
            self.calls.append((method, args))
            return [{"overlap": bool(args[0]) or not self.honours}]

    engine = Engine(honours=True)
    with copy_overlap(engine, "capture-1"):
        assert engine.calls == []
    with copy_overlap(engine, "capture-8-sync"):
        assert engine.calls == [(COPY_METHOD, (False,))]
    assert engine.calls == [(COPY_METHOD, (False,)), (COPY_METHOD, (True,))]  # back on after the round
    with pytest.raises(RuntimeError, match="did not turn the copy overlap off"):
        with copy_overlap(Engine(honours=False), "capture-1-sync"):
            pass


def test_report_gives_the_paired_overlap_ratio_and_no_target_for_the_sync_rounds() -> None:
    from benchmarks.interleaved import summarise
    from benchmarks.report import interleaved_markdown, prefill_targets

    times = {"plain": [1.0, 1.0, 1.0], "capture-1": [1.2, 1.1, 1.3], "capture-1-sync": [1.5, 1.0, 1.3]}
    row = {"system": "lens-mixed", "status": "ok", "interleaved": {"times": times, "summary": summarise(times)}}
    text = "\n".join(interleaved_markdown([row]))
    assert "| lens-mixed | capture-1-sync |" in text
    assert "capture-1 with the step copies on a side stream" in text and "median 1.000x, range 0.800-1.100 over 3 rounds" in text
    goals = [goal["target"] for goal in prefill_targets([row], "cuda")]
    assert any(goal.startswith("capture-1 <=") for goal in goals) and not any("sync" in goal for goal in goals)


def test_sync_systems_run_ours_with_the_copy_overlap_off_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from benchmarks.launcher import system_env
    from benchmarks.systems import default_systems

    cfg = BenchConfig(model_dir="m", prompts=[[1, 2]], max_tokens=1, layer=1, num_layers=4, hidden_size=8, device="cuda")
    for name in ("lens-capture-1-sync", "lens-graphs-capture-1-sync"):
        system = ALL_SYSTEMS[name]
        assert system_env(system, cfg)["LENS_EVALS_COPY_OVERLAP"] == "0"
        assert lens_extra_args(system, cfg) == lens_extra_args(ALL_SYSTEMS[name.removesuffix("-sync")], cfg)
        assert name not in default_systems(True) and name not in default_systems(True, "prefill")
    monkeypatch.delenv("LENS_EVALS_COPY_OVERLAP", raising=False)
    assert "LENS_EVALS_COPY_OVERLAP" not in system_env(ALL_SYSTEMS["lens-capture-1"], cfg)  # the default: overlapped
