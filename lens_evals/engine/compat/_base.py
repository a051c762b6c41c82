"""Shared by the compat modules: the logger and idempotent monkey-patching."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("lens_evals")

_PATCHED_ATTR = "__lens_evals_patched__"
# a vLLM method we wrap, and the wrapper that replaces it
Method = Callable[..., Any]


def _patch(owner: Any, name: str, make_wrapper: Callable[[Method], Method]) -> None:
    original = getattr(owner, name)
    if getattr(original, _PATCHED_ATTR, False):
        return
    wrapper = make_wrapper(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, _PATCHED_ATTR, True)
    setattr(owner, name, wrapper)
