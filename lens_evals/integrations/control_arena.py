"""A ControlArena monitor that reads the untrusted model's residual stream with a linear probe.

``probe_monitor(probe=...)`` is an ``@control_agent`` monitor: for each step it sends the step's
action (the last assistant message: its text and its tool calls as ``name({json args})``) to the
untrusted model served by ``vllm-lens``, captures the probe's layer, and returns the probe's
score as ``MonitorResponse(suspicion_score, reason)``. Use it inside a micro-protocol::

    from control_arena.micro_protocol import trusted_monitoring_builder
    protocol = trusted_monitoring_builder(monitor=probe_monitor(probe="probes/smollm2-135m-instruct__coup.safetensors"))

or post hoc on saved trajectories (no sandbox needed; name the model, since no eval binds roles)::

    from control_arena.eval import evaluate_monitors_post_hoc
    await evaluate_monitors_post_hoc(log, [probe_monitor(probe=..., model_role=None,
                                                         model="vllm-lens/smollm2-135m-instruct")], out_dir)

``context="action"`` (default) frames the action exactly as coup-probe training did (the agent
is asked for its next action and answers with it); ``context="trajectory"`` sends the whole
conversation so far, tool results as user turns, and scores the last assistant turn.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from control_arena import ModelRole
from control_arena._control_agent import control_agent
from control_arena.monitor import MonitorResponse, get_last_assistant_message, monitor
from inspect_ai.agent import Agent, AgentState
from inspect_ai.model import get_model
from inspect_ai.tool import Tool
from pydantic import Field

from lens_evals.inspect_kit.turn_probe import message_text, plain_chat, probe_last_turn
from lens_evals.probing.datasets import coup_messages
from lens_evals.probing.probe import Probe, load_probe


@lru_cache(maxsize=8)
def _probe(path: str) -> Probe:
    return load_probe(path)


@control_agent
def probe_monitor(
    probe: str = Field(description="Probe file (NAME.safetensors with its NAME.json card), e.g. a coup probe."),
    model_role: ModelRole | None = Field(
        default="untrusted", description="Whose activations to read: the model bound to this role (a vllm-lens model)."
    ),
    model: str | None = Field(default=None, description="A vllm-lens/<model> to read when model_role is None or not bound (post hoc)."),
    context: Literal["action", "trajectory"] = Field(
        default="action",
        description="'action': the last action alone, framed as in coup-probe training; "
        "'trajectory': the conversation so far, ending with the action.",
    ),
    score: Literal["probability", "log_odds"] = Field(
        default="probability", description="suspicion_score as sigmoid(probe score) in (0, 1), or the raw log-odds."
    ),
) -> Agent:
    """Linear-probe monitor on the untrusted model's residual stream (served by vllm-lens)."""
    if model_role is None and model is None:
        raise ValueError("probe_monitor needs model_role or model (a vllm-lens/<model>)")
    loaded = _probe(str(probe))

    @monitor
    async def impl(state: AgentState, tools: list[Tool]) -> MonitorResponse:
        action = get_last_assistant_message(state.messages)
        if context == "action":
            text = message_text(action)
            if not text:
                return MonitorResponse(suspicion_score=0.0, reason="empty action: nothing to probe", score_parsed=False)
            chat = coup_messages(text)
        else:
            last = max(i for i, message in enumerate(state.messages) if message is action)
            chat = plain_chat(state.messages[: last + 1])
        result = await probe_last_turn(get_model(model=model, role=model_role), loaded, chat)
        suspicion = result.probability if score == "probability" else result.score
        return MonitorResponse(suspicion_score=suspicion, reason=result.summary())

    return impl
