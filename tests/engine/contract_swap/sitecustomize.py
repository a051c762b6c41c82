"""Imported at start by every Python process of a test that puts this folder on ``PYTHONPATH``
(vLLM's CPU workers are spawned, not forked: a contract swapped in the test process alone would
not reach them): swaps the decoder-layer contract named by ``LENS_TEST_SWAP_CONTRACT``
(``Architecture=kind``) in lens_evals' table, as tests/engine/test_self_check_modes.py does in its own
process."""

from __future__ import annotations

import os

_SPEC = os.environ.get("LENS_TEST_SWAP_CONTRACT", "")
if _SPEC:
    import dataclasses

    from lens_evals.engine.compat import architectures

    _ARCH, _KIND = _SPEC.split("=")
    _CONTRACTS = {"fused": architectures.FUSED, "stream": architectures.STREAM, "stream_first": architectures.STREAM_FIRST}
    architectures.VERIFIED[_ARCH] = dataclasses.replace(architectures.VERIFIED[_ARCH], contract=_CONTRACTS[_KIND])
