"""One chat turn against the lens server, as events for the page.

Colouring happens at the end of the turn: the text streams in as the server sends it, and the
probe scores, the lens and the SAE latents of every token arrive in the response's final event
(the one SSE event that carries activations, docs/usage.md). One request per turn keeps the reply
exactly what one generation gives (sampling, steering, stop) at no extra cost; colouring while
streaming would mean asking for the answer in short continuations, i.e. a request per few tokens.

A token is shown with what the model read when it chose it: the probe score and the lens at the
position before it (its prediction), so the last layer's lens top-1 is the token itself under
greedy decoding."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lens_evals.chat.oracle_box import ask
from lens_evals.chat.steering import Steering, SteeringChoice
from lens_evals.chat.token_details import DetailsRequest, details_xargs, token_details
from lens_evals.chat.upstream import Upstream, UpstreamError
from lens_evals.client import activations_from_response, lens_xargs
from lens_evals.oracle.inference import OracleSettings
from lens_evals.request.spec import LinearProbe


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=20000)


class Turn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[Message] = Field(min_length=1, max_length=200)
    max_tokens: int = Field(default=64, ge=1, le=2048)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    steering: SteeringChoice | None = None


class OracleQuestion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    messages: list[Message] = Field(min_length=1, max_length=200)
    question: str = Field(min_length=1, max_length=2000)


@dataclass
class ChatBackend:
    upstream: Upstream
    model: str
    probes: dict[str, LinearProbe]
    details: DetailsRequest
    steering: Steering
    oracle_lora: str
    oracle: OracleSettings
    num_layers: int
    extra: dict[str, Any] = field(default_factory=dict)

    def info(self) -> dict[str, Any]:
        return {
            "server": self.upstream.url,
            "model": self.model,
            "num_layers": self.num_layers,
            "probes": [{"name": p.name, "layer": p.layer} for p in self.probes.values()],
            "vectors": sorted(self.steering.vectors),
            "lens_layers": self.details.layers,
            "sae": None if self.details.sae is None else {"name": self.details.sae_label, "layer": self.details.sae.layer},
            "oracle_lora": self.oracle_lora,
        }

    def turn(self, turn: Turn) -> Iterator[dict[str, Any]]:
        """``{"type": "token", "text"}`` per streamed piece, then ``{"type": "done", "tokens": [...]}``;
        ``{"type": "error", "message"}`` on failure (the page shows it)."""
        try:
            xargs = lens_xargs(probes=list(self.probes.values()), steering=[self.steering.vector(turn.steering)] if turn.steering else None)
            xargs.update(details_xargs(self.details))
            body = {
                "model": self.model,
                "messages": [m.model_dump() for m in turn.messages],
                "max_tokens": turn.max_tokens,
                "temperature": turn.temperature,
                "return_token_ids": True,
                "vllm_xargs": xargs,
            }
            n_prompt, activations, shown = 0, None, 0
            pieces: list[dict[str, Any]] = []
            for chunk in self.upstream.stream("/v1/chat/completions", body):
                n_prompt = len(chunk.get("prompt_token_ids") or []) or n_prompt
                if "activations" in chunk:
                    activations = activations_from_response(chunk)
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    text = (choice.get("delta") or {}).get("content") or ""
                    if ids:
                        pieces.append({"text": text, "ids": ids, "position": n_prompt + shown})
                        shown += len(ids)
                        yield {"type": "token", "text": text}
            if not isinstance(activations, dict):
                raise UpstreamError("the reply carried no activations: is the server a lens server (lens_evals in its vLLM)?")
            yield {"type": "done", "tokens": self._annotate(pieces, activations)}
        except (UpstreamError, ValueError) as exc:
            yield {"type": "error", "message": str(exc)}

    def _annotate(self, pieces: list[dict[str, Any]], activations: dict[str, Any]) -> list[dict[str, Any]]:
        read_at = [piece["position"] - 1 for piece in pieces]
        details = token_details(activations, read_at, self.details, lambda ids: self.upstream.token_texts(self.model, ids))
        scores = activations.get("probe_scores") or {}
        for piece, at, detail in zip(pieces, read_at, details):
            piece["scores"] = {name: float(values[at]) for name, values in scores.items() if at < len(values)}
            piece.update(detail)
        return pieces

    def ask_oracle(self, question: OracleQuestion) -> dict[str, Any]:
        return ask(self.upstream, self.model, self.oracle_lora, self.oracle, [m.model_dump() for m in question.messages], question.question)
