"""``lens-evals chat``'s refusals before any page is served: a server that cannot be reached, a
missing probe file, a bad SAE folder (a clear message and a non-zero exit)."""

from __future__ import annotations

import pytest

from lens_evals.cli.app import main
from lens_evals.inspect_kit.provider.server import free_port


def test_an_unreachable_server_is_named(capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["chat", "--server", url]) == 2
    assert f"the lens server at {url} cannot be reached" in capsys.readouterr().err


def test_a_missing_probe_file_is_a_usage_error(capsys, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "--server", "http://127.0.0.1:1", "--probe", str(tmp_path / "nope.safetensors")])
    assert exit_info.value.code == 2 and "no such file" in capsys.readouterr().err
