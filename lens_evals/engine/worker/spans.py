"""Rows of the step's token batch given as (start, length) spans, one per request: as row
indices, or as one slice when they follow one another (the planners' and readouts' layouts)."""

from __future__ import annotations

import numpy as np


def rows_of(spans: list[tuple[int, int]]) -> np.ndarray:
    """The row indices of (start, length) spans, concatenated."""
    starts = np.fromiter((s for s, _ in spans), dtype=np.int64, count=len(spans))
    lengths = np.fromiter((n for _, n in spans), dtype=np.int64, count=len(spans))
    total = int(lengths.sum())
    offsets = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return offsets + np.arange(total, dtype=np.int64)


def span_of(spans: list[tuple[int, int]]) -> tuple[int, int] | None:
    """(start, stop) when the spans follow one another without gaps, else None."""
    expected = spans[0][0]
    for start, length in spans:
        if start != expected:
            return None
        expected += length
    return spans[0][0], expected
