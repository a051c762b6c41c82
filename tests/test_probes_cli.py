"""Nonsense `lens-evals probes` arguments: exit 2 with the reason, before any engine starts
(they used to pass the parser and fail minutes later, inside the run, with a traceback)."""

from __future__ import annotations

import pytest

from lens_evals.cli.app import build_parser, main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("train --C 0", "--C: must be a positive finite number"),
        ("sweep --C nan", "--C: must be a positive finite number"),
        ("train --limit -3", "--limit: must be a positive integer"),
        ("sweep --limit 0", "--limit: must be a positive integer"),
        ("train --layer -1", "--layer: a layer index is 0 or more"),
        ("train-set --layer -2", "--layer: a layer index is 0 or more"),
        ("train --dataset bogus", "--dataset: unknown training set 'bogus'"),
        ("sweep --dataset geometry-of-truth:nope", "unknown Geometry of Truth set 'nope'"),
        ("science --control-limit 0", "--control-limit: must be a positive integer"),
        ("train-set --control-max-tokens 0", "--control-max-tokens: must be a positive integer"),
        ("science --roleplaying-limit -1", "--roleplaying-limit: must be a positive integer"),
    ],
)
def test_nonsense_probe_arguments_exit_2_before_any_engine(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["probes", *argv.split()])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_of_a_missing_or_foreign_file_exits_2(tmp_path, capsys) -> None:
    foreign = tmp_path / "other.json"
    foreign.write_text("{}")
    assert main(["probes", "plot", str(tmp_path / "missing.json")]) == 2
    assert "cannot read it as JSON" in capsys.readouterr().err
    assert main(["probes", "plot", str(foreign), "--out", str(tmp_path / "p.png")]) == 2
    assert "not a `probes science` result (no model," in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
