"""A researcher's mistakes on the `lens-evals` command line (models, roleplaying, oracle, probes):
exit 2 with a message that names the bad value and what was expected, before any engine starts.
They used to be tracebacks from deep inside (a KeyError from models.py, an OSError from the HF
hub, a LensValidationError from the engine), runs of an oracle with 0 epochs, or a Roleplaying
eval with `--limit -1` that silently left out the last scenario (Inspect slices [0:-1])."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.main import build_parser as build_bench_parser
from lens_evals.cli.app import build_parser, main
from lens_evals.probing.probe import Probe
from lens_evals.probing.train import fit_pipeline
from tests.test_probing import _card


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("models path nosuch", "name: unknown model 'nosuch'; expected one of"),
        ("probes train --model nosuch", "--model: unknown model 'nosuch'; expected one of"),
        ("probes sweep --model /no/such/dir", "--model: unknown model '/no/such/dir'; expected one of"),
        ("probes train-set --model nosuch", "--model: unknown model 'nosuch'"),
        ("probes science --model nosuch", "--model: unknown model 'nosuch'"),
        ("roleplaying --model nosuch", "--model: unknown model 'nosuch'"),
        ("roleplaying --limit 0", "--limit: must be a positive integer, got 0"),
        ("roleplaying --limit -1", "--limit: must be a positive integer, got -1"),
        ("oracle train --epochs 0", "--epochs: must be a positive integer, got 0"),
        ("oracle train --train-per-family -3", "--train-per-family: must be a positive integer, got -3"),
        ("oracle train --eval-per-family 0", "--eval-per-family: must be a positive integer, got 0"),
        ("oracle train --name nosuch", "--name: unknown oracle recipe 'nosuch'; expected one of smollm2-135m-oracle"),
        ("probes train --name runs/p1", "--name: a probe name is a file name without '/', got 'runs/p1' (--out picks the directory)"),
        ("probes train --name ..", "--name: a probe name is a file name without '/', got '..'"),
        ("capture p.jsonl --layers 1 --out o --model nosuch", "--model: unknown model 'nosuch'"),
        ("roleplaying --dataset /no/such.yaml", "--dataset: no such file: /no/such.yaml"),
        ("probes train-set --roleplaying /no/such.yaml", "--roleplaying: no such file: /no/such.yaml"),
        # bench: 0 used to become the default silently (`args.prompts or 64`), the rest tracebacks
        ("bench --prompts 0", "--prompts: must be a positive integer, got 0"),
        ("bench --max-tokens 0", "--max-tokens: must be a positive integer, got 0"),
        ("bench --repeats 0", "--repeats: must be a positive integer, got 0"),
        ("bench --hf-batch 0", "--hf-batch: must be a positive integer, got 0"),
        ("bench --check-prompts -1", "--check-prompts: must be 0 or more, got -1"),
        ("bench --hf-batches 4,x", "--hf-batches: expected comma-separated positive integers, e.g. 4,8,16; got '4,x'"),
        ("bench --systems lens-plain,bogus", "--systems: unknown system 'bogus'; expected some of vllm-graphs, vllm-eager"),
        ("bench --timeout 0", "--timeout: must be a positive finite number, got 0"),
        ("bench --layer -1", "--layer: a layer index is 0 or more, got -1"),
        ("bench --model nosuch", "--model: unknown model 'nosuch'"),
        ("demo --model nosuch", "--model: unknown model 'nosuch'"),
        ("demo --layer -1", "--layer: a layer index is 0 or more, got -1"),
    ],
)
def test_a_wrong_argument_exits_2_naming_it(argv: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    words = argv.split()
    # `lens-evals bench` hands its arguments to the checkout's benchmarks/ parser
    parser = build_bench_parser() if words[0] == "bench" else build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(words[1:] if words[0] == "bench" else words)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_model_directory_is_still_a_model(tiny_path) -> None:
    args = build_parser().parse_args(["probes", "train", "--model", str(tiny_path)])
    assert args.model == str(tiny_path)


@pytest.mark.parametrize("command", ["train", "train-set"])
def test_a_layer_past_the_models_last_is_refused_before_the_engine(command: str, tiny_path, capsys: pytest.CaptureFixture[str]) -> None:
    # tiny-llama has 4 decoder layers (its config.json): 4 is one past the last
    with pytest.raises(SystemExit) as exit_info:
        main(["probes", command, "--model", "tiny-llama", "--layer", "4"])
    assert exit_info.value.code == 2
    assert "--layer: 4 is past the last layer of tiny-llama (4 layers: 0..3)" in capsys.readouterr().err


def test_a_bench_layer_past_the_models_last_is_refused(tiny_path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--model", "tiny-llama", "--layer", "4", "--out", "/nonexistent/never-written"])
    assert exit_info.value.code == 2
    assert "--layer: 4 is past the last layer of tiny-llama (4 layers: 0..3)" in capsys.readouterr().err


def _save_probe(directory, hidden: int, **card) -> str:
    rng = np.random.default_rng(0)
    features = [rng.normal(size=(3, hidden)) + label for label in (0, 1) * 5]
    return str(Probe(fit_pipeline(features, [0, 1] * 5), _card(hidden_size=hidden, **card)).save(directory))


def test_roleplaying_refuses_a_probe_that_does_not_fit_the_model(tmp_path, tiny_path, capsys: pytest.CaptureFixture[str]) -> None:
    """tiny-llama: hidden 128, 4 layers. Each probe is refused before the engine starts, naming why."""
    cases = [
        (str(tmp_path / "missing.safetensors"), "--probe: probe file missing:"),
        (_save_probe(tmp_path / "other", 128, model="smollm2-135m-instruct", layer=1), "trained on smollm2-135m-instruct, not tiny-llama"),
        (_save_probe(tmp_path / "wide", 64, model="tiny-llama", layer=1), "reads hidden size 64 but tiny-llama's is 128"),
        (_save_probe(tmp_path / "deep", 128, model="tiny-llama", layer=15), "reads layer 15 but tiny-llama has 4 layers (0..3)"),
    ]
    for probe, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["roleplaying", "--model", "tiny-llama", "--probe", probe, "--log-dir", str(tmp_path / "logs")])
        assert exit_info.value.code == 2, probe
        assert message in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # no eval ran


def test_a_damaged_oracle_card_is_named_not_a_traceback(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    (tmp_path / "card.json").write_text("{broken")
    assert main(["oracle", "card", str(tmp_path)]) == 1
    assert f"{tmp_path / 'card.json'}: not a JSON oracle card (" in capsys.readouterr().err


def test_a_demo_layer_past_the_models_last_is_refused(tiny_path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", "tiny-llama", "--layer", "4"])
    assert exit_info.value.code == 2
    assert "--layer: 4 is past the last layer of tiny-llama (4 layers: 0..3)" in capsys.readouterr().err
