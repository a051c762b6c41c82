"""What lens-evals keeps per engine in the frontend process: one :class:`LensFrontendState` per
vLLM input processor (the frontend's counterpart of ``worker/state.py``'s ``LensWorkerState``),
attached to it once through ``compat.frontend.lens_state`` at its first use."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from lens_evals import settings
from lens_evals.engine import compat
from lens_evals.engine.frontend import budget as frontend_budget
from lens_evals.engine.frontend.fetch_batch import FetchBatcher
from lens_evals.engine.frontend.hook_set_store import HookSetStore
from lens_evals.engine.frontend.pending import PendingLensRequests
from lens_evals.engine.frontend.self_check import SelfCheck
from lens_evals.engine.transport.graph_layers import configured_layers


@dataclass(frozen=True)
class EngineFacts:
    """What admission needs of the engine, read from its config once per input processor: the
    model's shape, the graph-mode layers (None: eager mode) and why the engine takes no lens
    requests (its configuration, or an unverified architecture; None: it takes them). The
    limits (``LENS_EVALS_MAX_CAPTURE_GIB``) are read per request: they may change while it runs."""

    shape: compat.config.ModelShape
    tapped: list[int] | None
    refusal: str | None
    step: frontend_budget.StepFacts
    workers_share_host: bool  # readout weights may reach them through files (transport/readout_files.py)

    @classmethod
    def read(cls, config: Any) -> EngineFacts:
        shape = compat.config.model_shape(config)
        refused = compat.frontend.engine_refusal(config) or compat.architectures.frontend_refusal(config.model_config)
        act_bytes, step_rows = compat.frontend.step_limits(config)
        step = frontend_budget.StepFacts(shape.hidden_size, act_bytes, step_rows, shape.vocab_size)
        shared = compat.config.workers_share_host(config)
        return cls(shape, configured_layers(config, shape.num_layers), refused, step, shared)


def max_capture_bytes() -> int:
    return settings.MAX_CAPTURE_GIB.in_bytes()


class LensFrontendState:
    """One engine's lens state on the frontend: the admitted requests waiting for their fetch,
    the hook sets and their results, the engine's facts, the fetch batcher and the self-check."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.pending = PendingLensRequests()
        self.hook_sets = HookSetStore()
        self.self_check: SelfCheck | None = None  # the stream-contract check's result, once run
        self.self_check_task: asyncio.Task[SelfCheck] | None = None  # AsyncLLM: the check running
        self._facts: EngineFacts | None = None
        self._batcher: FetchBatcher | None = None

    @property
    def facts(self) -> EngineFacts:
        """Read at the first lens request (the config is complete by then)."""
        if self._facts is None:
            self._facts = EngineFacts.read(self.processor.vllm_config)
        return self._facts

    def batcher(self, engine: Any) -> FetchBatcher:
        if self._batcher is None:
            self._batcher = FetchBatcher(engine, self.processor)
        return self._batcher


def frontend_state(processor: Any) -> LensFrontendState:
    """The lens state of the engine whose input processor this is (made at its first use)."""
    return compat.frontend.lens_state(processor, LensFrontendState)
