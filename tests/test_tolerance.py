"""The comparison helpers of tests/tolerance.py themselves (issue #45): a comparison of nothing
fails unless the caller says it may be empty, an error over the bound fails at the row it names,
and the same-rows probe-score bound is the rounding of two dot products alone, far tighter than
the two-runs bound. References: hand-built tensors whose errors are computed here."""

from __future__ import annotations

import pytest
import torch

from tests.tolerance import (
    HOST_UNIT_ROUNDOFF,
    PROBABILISTIC_LAMBDA,
    assert_dialogue_scores_close,
    assert_scores_close,
    assert_stream_close,
    score_bound,
    stream_bound,
    unit_roundoff,
)


def test_an_empty_comparison_fails_unless_allowed() -> None:
    stream = torch.ones(2, 5, 8)
    with pytest.raises(AssertionError, match="nothing compared"):
        assert_stream_close(stream[:, :0], stream[:, :0], "a slice gone empty")
    assert assert_stream_close(stream[:, :0], stream[:, :0], "meant to be empty", allow_empty=True) == 0.0
    with pytest.raises(AssertionError, match="no dialogue scores compared"):
        assert_dialogue_scores_close([], [], "no dialogues")
    with pytest.raises(AssertionError, match="no scores compared"):
        assert_scores_close(torch.zeros(0), torch.zeros(0), torch.ones(8), torch.ones(0, 8), "no tokens")


def test_a_row_over_the_bound_fails_and_is_named() -> None:
    ref = torch.ones(2, 3, 4, dtype=torch.float64)  # every row's norm is 2
    got = ref.clone()
    got[1, 2, 0] += 4 * stream_bound()  # layer row 1, token 2: relative error 2 x the bound
    with pytest.raises(AssertionError, match=r"at layer row 1, token 2 .*1 of 6 rows over the bound"):
        assert_stream_close(got, ref, "one row off")
    got[1, 2, 0] = 1 + stream_bound()  # half the bound: passes, and the error is returned
    assert assert_stream_close(got, ref, "within") == pytest.approx(stream_bound() / 2)


def test_same_rows_score_bound_is_the_two_dot_products_rounding() -> None:
    generator = torch.Generator().manual_seed(0)
    weights, rows = torch.randn(64, generator=generator), torch.randn(3, 64, generator=generator) * 10
    same = score_bound(weights, rows, same_rows=True, bias=0.5)
    magnitude = rows.double().abs() @ weights.double().abs() + 0.5
    expected = PROBABILISTIC_LAMBDA * 65**0.5 * (unit_roundoff() + HOST_UNIT_ROUNDOFF) * magnitude
    torch.testing.assert_close(same, expected, rtol=1e-12, atol=0)
    two_runs = score_bound(weights, rows)
    assert (same < two_runs).all(), (same, two_runs)  # no stream term: tighter than the two-runs bound
    exact = rows.double() @ weights.double() + 0.5
    with pytest.raises(AssertionError, match="at token 1"):
        assert_scores_close(exact + torch.tensor([0.0, 2.0, 0.0]) * same, exact, weights, rows, "two bounds off", same_rows=True, bias=0.5)
