"""Three probes in one engine pass: thresholds (hand-computed), grouped cross-validation (no
scenario on both sides), save/load, and the Inspect task through a real tiny-llama server, whose
three-probe scores equal three single-probe runs and the readouts applied to an offline capture."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from inspect_ai import eval as inspect_eval
from inspect_ai.model import get_model

from lens_evals.evals.roleplaying.multi_probe import roleplaying_probes_task
from lens_evals.inspect_kit.provider.server import LensServer
from lens_evals.probing import datasets
from lens_evals.probing.dialogues import Dialogue
from lens_evals.probing.extract import extract_features
from lens_evals.probing.multi import (
    ProbeSet,
    Readout,
    evaluate_offline,
    fit_logistic,
    fit_probe_set,
    grouped_folds,
    load_probe_set,
    scenario_key,
    threshold_interval,
)
from tests.conftest import make_llm
from tests.tolerance import assert_dialogue_scores_close, score_bound

HIDDEN = 128
N_SCENARIOS = 4


def one_token_features(values) -> list[np.ndarray]:
    return [np.array([[v]], dtype=np.float32) for v in values]


def test_threshold_is_the_99th_percentile_of_control_scores_hand_computed():
    # scores 0, 1, ..., 9 (mean over one token of weight 1, bias 0): the 0.99 quantile with
    # linear interpolation is 8 + 0.91 * (9 - 8) = 8.91; for 0..100 it is exactly 99.
    probes = ProbeSet("m", 0, {"ip-lr": Readout("ip-lr", 0, np.ones(1, np.float32), 0.0)})
    probes.calibrate(one_token_features(range(10)))
    assert probes.readouts["ip-lr"].threshold == pytest.approx(8.91)
    probes.calibrate(one_token_features(np.random.default_rng(0).permutation(101)))
    assert probes.readouts["ip-lr"].threshold == pytest.approx(99.0)
    # a readout's dialogue score is the mean over its tokens, bias added once
    readout = Readout("x", 0, np.array([2.0], np.float32), 1.0)
    assert readout.scores([np.array([[1.0], [3.0]], np.float32)])[0] == pytest.approx(2.0 * 2.0 + 1.0)


def test_threshold_interval_brackets_the_threshold_and_narrows_with_more_control_samples():
    rng = np.random.default_rng(1)
    assert threshold_interval(np.full(50, 2.5)) == (2.5, 2.5)
    small, large = rng.normal(size=250), rng.normal(size=4000)
    low_s, high_s = threshold_interval(small)
    low_l, high_l = threshold_interval(large)
    assert low_s <= np.quantile(small, 0.99) <= high_s and low_l <= np.quantile(large, 0.99) <= high_l
    assert high_l - low_l < (high_s - low_s) / 2
    assert low_l < 2.326 < high_l  # the normal's 99th percentile


def synthetic_roleplaying(n_scenarios: int = 6) -> list[Dialogue]:
    return datasets.roleplaying_dialogues()[: 2 * n_scenarios]


def random_features(n: int, seed: int, tokens: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(tokens, HIDDEN)).astype(np.float32) for _ in range(n)]


def test_grouped_folds_never_put_a_scenario_on_both_sides():
    dialogues = datasets.roleplaying_dialogues()
    keys = [scenario_key(d) for d in dialogues]
    assert len(set(keys)) == len(dialogues) // 2  # honest and deceptive of one scenario share a key
    tested = []
    for train, test in grouped_folds(keys, 5):
        assert not {keys[i] for i in train} & {keys[i] for i in test}
        tested += [keys[i] for i in test]
    assert sorted(tested) == sorted(keys)  # every dialogue scored exactly once


def test_each_roleplaying_fold_probe_is_trained_without_the_scenarios_it_scores():
    dialogues = synthetic_roleplaying(6)
    features, labels = random_features(len(dialogues), 1), [d.label for d in dialogues]
    pairs = random_features(8, 2)
    probes = fit_probe_set("m", 1, pairs, [0, 1] * 4, features, dialogues, n_folds=3)
    keys = [scenario_key(d) for d in dialogues]
    assert set(probes.fold_of) == set(keys) and set(probes.fold_of.values()) == {0, 1, 2}
    for fold in range(3):
        train = [i for i, k in enumerate(keys) if probes.fold_of[k] != fold]
        expected = fit_logistic("ref", 1, [features[i] for i in train], [labels[i] for i in train])
        np.testing.assert_allclose(probes.readouts[f"rp-lr/fold{fold}"].weights, expected.weights, rtol=1e-5)
    for key, fold in probes.fold_of.items():
        assert probes.readout_for("rp-lr", key).name == f"rp-lr/fold{fold}"
    with pytest.raises(KeyError, match="another Roleplaying file"):
        probes.readout_for("rp-lr", "not-a-scenario")
    with pytest.raises(ValueError, match="choose from ip-lr, ip-dom, rp-lr"):
        probes.select("ip-lr,nope")


def test_difference_of_means_and_no_intercept_logistic_regression():
    rng = np.random.default_rng(3)
    honest = [rng.normal(size=(2, HIDDEN)).astype(np.float32) for _ in range(20)]
    deceptive = [(h + 1.0).astype(np.float32) for h in honest]
    probes = fit_probe_set("m", 0, honest + deceptive, [0] * 20 + [1] * 20, *_tiny_roleplaying())
    dom = probes.readouts["ip-dom"]
    np.testing.assert_allclose(dom.weights, np.ones(HIDDEN), rtol=1e-5)  # mean(deceptive) - mean(honest)
    assert dom.scores([np.concatenate(honest + deceptive)])[0] == pytest.approx(0.0, abs=1e-3)  # midpoint scores 0
    lr = probes.readouts["ip-lr"]
    scaled_mean = np.concatenate(honest + deceptive).mean(axis=0)
    assert float(scaled_mean @ lr.weights + lr.bias) == pytest.approx(0.0, abs=1e-4)  # no intercept: the mean scores 0


def _tiny_roleplaying():
    dialogues = synthetic_roleplaying(N_SCENARIOS)
    return random_features(len(dialogues), 4), dialogues


def test_probe_set_round_trips_without_pickle(tmp_path):
    probes = fit_probe_set("m", 2, random_features(8, 5), [0, 1] * 4, *_tiny_roleplaying(), n_folds=2)
    probes.calibrate(random_features(30, 6))
    saved = probes.save(tmp_path / "qwen2.5-coder-0.5b-instruct__probe-set")  # dots in the name
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "qwen2.5-coder-0.5b-instruct__probe-set.json",
        "qwen2.5-coder-0.5b-instruct__probe-set.npz",
    ]
    loaded = load_probe_set(saved)
    with pytest.raises(FileNotFoundError, match="probe set missing"):
        load_probe_set(tmp_path / "other")
    assert loaded.fold_of == probes.fold_of and loaded.layer == 2
    for name, readout in probes.readouts.items():
        np.testing.assert_array_equal(loaded.readouts[name].weights, readout.weights)
        assert (loaded.readouts[name].bias, loaded.readouts[name].threshold) == (readout.bias, readout.threshold)


@pytest.fixture(scope="module")
def tiny_probe_set(tmp_path_factory, tiny_path):
    """Random readouts at three layers of tiny-llama, calibrated on random control rows."""
    dialogues = synthetic_roleplaying(N_SCENARIOS)
    probes = fit_probe_set("tiny-llama", 1, random_features(8, 7), [0, 1] * 4, random_features(len(dialogues), 8), dialogues, n_folds=2)
    rng = np.random.default_rng(9)
    probes.readouts = {
        n: Readout(n, layer, rng.normal(size=HIDDEN).astype(np.float32), float(rng.normal()))
        for n, layer in zip(probes.readouts, (1, 2, 3, 0))
    }
    probes.calibrate(random_features(50, 10))
    return probes.save(tmp_path_factory.mktemp("probes") / "tiny"), dialogues


def test_three_readouts_in_one_request_equal_three_single_readout_requests(tiny_path, tiny_probe_set):
    """Engine level (offline, tiny-llama): one request carrying the three readouts returns, per
    readout, the scores of a request carrying it alone, and the dialogue score equals the readout
    applied on the host to the captured stream."""
    from vllm import SamplingParams

    from lens_evals.probing.dialogues import tokenize_dialogue
    from lens_evals.request.spec import CAPTURE_KEY, PROBE_KEY

    path, dialogues = tiny_probe_set
    probes = load_probe_set(path)
    with make_llm(tiny_path, enable_prefix_caching=False) as llm:
        tokenizer = llm.get_tokenizer()
        for dialogue in dialogues[:4]:
            chosen = [probes.readout_for(kind, scenario_key(dialogue)) for kind in ("ip-lr", "ip-dom", "rp-lr")]
            tokenized = tokenize_dialogue(tokenizer, dialogue)
            prompt = {"prompt_token_ids": tokenized.token_ids}

            def run(readouts, capture_layers=None, prompt=prompt):
                extra = {PROBE_KEY: [r.linear_probe() for r in readouts]}
                if capture_layers:
                    extra[CAPTURE_KEY] = capture_layers
                params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
                return llm.generate([prompt], params, use_tqdm=False)[0].activations

            together = run(chosen, capture_layers=[0, 1, 2, 3])
            for readout in chosen:
                alone = run([readout])["probe_scores"][readout.name].double().numpy()
                np.testing.assert_allclose(together["probe_scores"][readout.name].double().numpy(), alone, rtol=1e-6, atol=1e-6)
                stream = together["residual_stream"][readout.layer].double().numpy()
                scored = stream[tokenized.scored_positions]
                expected = readout.scores([scored])[0]
                # the worker's fp32 dot products (TF32 where the GPU's matmuls use it) against the
                # host's fp64 ones on the very rows it read: their rounding alone, averaged
                weights = torch.from_numpy(readout.weights)
                tolerance = score_bound(weights, torch.from_numpy(scored), same_rows=True, bias=readout.bias).mean().item()
                got = together["probe_scores"][readout.name].double().numpy()[tokenized.scored_positions].mean()
                assert got == pytest.approx(expected, rel=0, abs=tolerance), f"{readout.name}: bound {tolerance:.2e}"
                print(f"{readout.name}: |mean score - host| {abs(got - expected):.2e}, bound {tolerance:.2e}")


@pytest.mark.slow
def test_three_probes_in_one_pass_equal_three_single_probe_runs_and_offline(tiny_path, tiny_probe_set, tmp_path):
    path, dialogues = tiny_probe_set
    probes = load_probe_set(path)
    kinds = ["ip-lr", "ip-dom", "rp-lr"]
    tasks = [roleplaying_probes_task(path, tokenizer=str(tiny_path))]
    tasks += [roleplaying_probes_task(path, probes=kind, tokenizer=str(tiny_path)) for kind in kinds]
    server = LensServer(str(tiny_path), served_name="tiny-llama", server_args={"dtype": "float32", "max_model_len": 1024, "seed": 0})
    server.start()
    try:
        logs = inspect_eval(
            tasks,
            model=get_model("vllm-lens/tiny-llama", base_url=f"{server.url}/v1"),
            limit=2 * N_SCENARIOS,
            log_dir=str(tmp_path / "logs"),
            display="none",
            max_tasks=1,
        )
    finally:
        server.stop()
    assert [log.status for log in logs] == ["success"] * 4, [log.error for log in logs]
    together = {s.id: s.metadata["probes"] for s in logs[0].samples}
    assert all(set(r) == set(kinds) for r in together.values())
    for kind, single_log in zip(kinds, logs[1:]):
        for sample in single_log.samples:
            alone = sample.metadata["probes"][kind]
            assert alone["readout"] == together[sample.id][kind]["readout"]
            assert_dialogue_scores_close([alone["score"]], [together[sample.id][kind]["score"]], f"{kind} {sample.id}: alone vs together")
            assert sample.scores[f"probe_{kind}"].value == pytest.approx(alone["score"])

    # independent reference: the same readouts applied on the host to an offline capture
    with make_llm(tiny_path, enable_prefix_caching=False) as llm:
        features = extract_features(llm, dialogues, [0, 1, 2, 3])
    ids = [f"{i // 2}-{'honest' if i % 2 == 0 else 'deceptive'}" for i in range(len(dialogues))]
    for kind in kinds:
        for sample_id, dialogue, feature in zip(ids, dialogues, features):
            readout = probes.readout_for(kind, scenario_key(dialogue))
            expected = readout.scores([feature[readout.layer]])[0]
            assert_dialogue_scores_close([together[sample_id][kind]["score"]], [expected], f"{kind} {sample_id} vs offline")
    metrics = {s.name: {n: m.value for n, m in s.metrics.items()} for s in logs[0].results.scores}
    assert set(metrics) == {f"probe_{k}" for k in kinds}
    offline = {
        r.probe: r for r in evaluate_offline(probes, [f[probes.readout_for("ip-lr", None).layer] for f in features], dialogues, ["ip-lr"])
    }
    assert metrics["probe_ip-lr"]["probe_auroc"] == pytest.approx(offline["ip-lr"].auroc)
    assert metrics["probe_ip-lr"]["recall_at_1pct_fpr"] == pytest.approx(offline["ip-lr"].recall_at_1pct_fpr)


def test_a_single_probe_whose_model_name_has_dots_saves_and_loads(tmp_path):
    """load_probe used with_suffix, which ate "0.5b-instruct__..." of a Qwen probe's name."""
    from lens_evals.probing.probe import Probe, ProbeCard, load_probe
    from lens_evals.probing.train import fit_pipeline

    name = "qwen2.5-coder-0.5b-instruct__instructed-pairs"
    card = ProbeCard(
        name=name,
        model="qwen2.5-coder-0.5b-instruct",
        layer=8,
        hidden_size=HIDDEN,
        token_selection="all",
        training_set="instructed-pairs",
        n_train_dialogues=8,
        n_val_dialogues=0,
        n_train_tokens=24,
        regularization_C=0.1,
        validation_auroc=0.5,
        threshold=1.0,
        control_set="none",
        n_control=0,
        versions={},
        created="today",
    )
    probe = Probe(pipeline=fit_pipeline(random_features(8, 11), [0, 1] * 4), card=card)
    path = probe.save(tmp_path)
    assert path.name == f"{name}.safetensors" and (tmp_path / f"{name}.json").is_file()
    for given in (path, tmp_path / f"{name}.json", tmp_path / name):
        assert load_probe(given).card.name == name
