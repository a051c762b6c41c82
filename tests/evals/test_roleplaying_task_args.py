"""``lens_evals/roleplaying_probe``'s ``-T`` arguments: the probe-set form (``probes=`` /
``probe_set=``) runs off-policy on the worker, so an argument it cannot honour is refused by
name, never dropped (``mode=on_policy`` with ``probes=`` used to run off-policy without a word);
an on-policy answer needs at least one token."""

from __future__ import annotations

import pytest

from lens_evals.evals.roleplaying.roleplaying import roleplaying_probe


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ({"mode": "on_policy", "grader": "mockllm/model"}, "mode, grader"),
        ({"probe": "probes/x.safetensors"}, "probe"),
        ({"max_tokens": 16}, "max_tokens"),
        ({"on_worker": False}, "on_worker"),
    ],
)
def test_probe_set_task_refuses_what_it_cannot_honour(args, named, tmp_path) -> None:
    for form in ({"probes": "ip-lr"}, {"probe_set": str(tmp_path / "set")}):
        with pytest.raises(ValueError, match=f"; {named} cannot be combined"):
            roleplaying_probe(**form, **args)


def test_on_policy_answers_need_a_token(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_tokens must be at least 1.*got 0"):
        roleplaying_probe(probe=str(tmp_path / "p.safetensors"), mode="on_policy", grader="mockllm/model", max_tokens=0)
