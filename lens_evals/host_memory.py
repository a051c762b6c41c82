"""The host's memory, for the defaults that are a share of it (``settings``: the hand-off pool,
the held-capture bound). No environment reads: the variables themselves are read in ``settings``."""

from __future__ import annotations

import os
from pathlib import Path

UNIT_BYTES = {"bytes": 1, "MiB": 2**20, "GiB": 2**30}


POOL_FLOOR_MIB = 4096.0


def host_memory_bytes() -> int | None:
    """This host's memory for us: physical memory, or the cgroup (v2) limit where one is lower;
    None where neither can be read."""
    try:
        total: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit():
        total = int(limit) if total is None else min(total, int(limit))
    return total


def quarter_of_host(floor: float, unit: str) -> float:
    """A quarter of the host's memory in ``unit``, at least ``floor``."""
    memory = host_memory_bytes()
    return floor if memory is None else max(floor, memory / 4 / UNIT_BYTES[unit])


def pool_default_mib() -> float:
    """A quarter of the host's memory, at least :data:`POOL_FLOOR_MIB`: a loop of calls whose
    captures the caller holds one at a time needs two calls' rows in the pool (issue #21: 22 GB
    for 8 layers of the 1,000-prompt prefill capture of an 8B model, on a 126 GiB host)."""
    return quarter_of_host(POOL_FLOOR_MIB, "MiB")


HELD_FLOOR_GIB = 8.0


def held_default_gib() -> float:
    """A quarter of the host's memory, at least :data:`HELD_FLOOR_GIB`: an offline call holds
    every request's rows the pool does not take until its one fetch, and a fixed 8 GiB dropped
    most of an 11 GB capture of 8 layers on a 128 GB host (issue #47)."""
    return quarter_of_host(HELD_FLOOR_GIB, "GiB")
