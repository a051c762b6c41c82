"""`-T trajectories=` of the coup probe task: a missing file is a FileNotFoundError naming the
argument (it was Python's bare "[Errno 2] No such file or directory"). No engine."""

from __future__ import annotations

import pytest

from lens_evals.evals.coup.coup import read_trajectories


def test_missing_trajectories_name_the_argument(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"trajectories: no such file: .*nope\.jsonl \(JSONL, one \{\"messages\""):
        read_trajectories(tmp_path / "nope.jsonl")
    (tmp_path / "one.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}], "label": 1}\n'
    )
    assert [d.label for d in read_trajectories(tmp_path / "one.jsonl")] == [1]
