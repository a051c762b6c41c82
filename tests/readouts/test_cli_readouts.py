"""``lens-evals readouts``: fit-tuned, fit-jacobian and kl on a tiny random Llama write and read
the contract's files; bad arguments are parser errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from lens_evals.cli.app import main
from lens_evals.readouts.lens_files import load_affine_lens
from tests.arch_zoo import build


def test_fit_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = str(build("LlamaForCausalLM"))
    common = ["--model", model, "--n-prompts", "8", "--max-tokens", "12", "--held-out", "0.25", "--quiet"]
    assert main(["readouts", "fit-tuned", *common, "--steps", "3", "--vocab", "64", "--out", str(tmp_path / "t.safetensors")]) == 0
    assert main(["readouts", "fit-jacobian", *common, "--layers", "0", "--fit-prompts", "2", "--out", str(tmp_path / "j.safetensors")]) == 0
    tuned, jacobian = load_affine_lens(tmp_path / "t.safetensors"), load_affine_lens(tmp_path / "j.safetensors")
    assert (tuned.kind, tuned.layers, tuned.meta["model"], tuned.meta["train_vocab"]) == ("tuned", [0, 1], model, "64")
    assert (jacobian.kind, jacobian.layers) == ("jacobian", [0, 1])
    capsys.readouterr()
    lenses = ["--lens", f"tuned={tmp_path / 't.safetensors'}", "--lens", f"jacobian={tmp_path / 'j.safetensors'}"]
    loud = [arg for arg in common if arg != "--quiet"]
    assert main(["readouts", "kl", *loud, *lenses, "--plot", str(tmp_path / "kl.png"), "--json", str(tmp_path / "kl.json")]) == 0
    table, err = capsys.readouterr()
    assert "streams" in err and "kl: 100%" in err  # progress: the held-out prompts' forwards, then the KL
    assert "| layer | logit | tuned | jacobian |" in table and (tmp_path / "kl.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["readouts", "kl", "--lens", "nopath"], "--lens takes NAME=PATH"),
        (["readouts", "fit-tuned", "--out", "x", "--held-out", "1.5"], "expected a fraction between 0 and 1"),
        (["readouts", "fit-tuned", "--out", "x", "--layers", "a,b"], "--layers takes comma-separated integers"),
    ],
)
def test_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
