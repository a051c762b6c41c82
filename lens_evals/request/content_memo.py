"""What admission computes from a request object's content (that its arrays passed the checks, its
digest, its wire form), kept with the object so the copies vLLM makes of it for every request
(``SamplingParams.clone`` deep-copies ``extra_args``) do not compute it again: an eval sends the
same steering vector or probes with each of thousands of requests.

A memo holds the content it was made for (the object's arrays and fields as bytes) and is used
only while the object still holds exactly that content, compared on every use: a vector changed
in place gets a new memo, never the old one's results. Comparing the content (its small fields,
and its arrays as bytes: a copy and a ``memcmp``, ~1 us for a 4,096-wide vector) costs far less
than hashing or checking the arrays again."""

from __future__ import annotations

from typing import Any


class ContentMemo:
    """Values computed from ``content``; shared by an object and the copies made of it while it
    held that content."""

    __slots__ = ("content", "values")

    def __init__(self, content: tuple[Any, ...]) -> None:
        self.content = content
        self.values: dict[str, Any] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        return (ContentMemo, ((),))  # a pickled object carries no memo (an empty content matches none)


def current_values(memo: ContentMemo | None, content: tuple[Any, ...] | None) -> tuple[ContentMemo | None, dict[str, Any]]:
    """(the memo to keep, its values) for an object whose content is now ``content``: ``memo``
    itself if it was made for that content, else a new one. ``content`` None: the object keeps no
    memo (a fresh dict each time)."""
    if content is None:
        return None, {}
    if memo is None or memo.content != content:
        memo = ContentMemo(content)
    return memo, memo.values
