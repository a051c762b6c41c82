"""The lens server, as the chat page's backend sees it: OpenAI-compatible HTTP plus vLLM's
``/tokenize`` and ``/detokenize`` (urllib3, the package client's pool)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lens_evals.client import activations_from_response, http_pool
from lens_evals.request.spec import CAPTURE_KEY


class UpstreamError(RuntimeError):
    """The lens server refused a request or could not be reached; the message says why."""


@dataclass
class Upstream:
    url: str
    api_key: str | None = None
    timeout: float = 600.0
    _pool: Any = field(init=False, repr=False)
    _token_text: dict[int, str] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._pool = http_pool(timeout=self.timeout, connections=8, headers=headers)

    def _request(self, method: str, path: str, body: Mapping[str, Any] | None = None, stream: bool = False) -> Any:
        import urllib3

        try:
            resp = self._pool.request(
                method,
                self.url + path,
                body=None if body is None else json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
                preload_content=not stream,
            )
        except urllib3.exceptions.HTTPError as exc:
            raise UpstreamError(f"the lens server at {self.url} cannot be reached: {exc}") from exc
        if resp.status != 200:
            text = resp.data.decode(errors="replace") if not stream else resp.read().decode(errors="replace")
            raise UpstreamError(f"the lens server answered {resp.status} to {path}: {_reason(text)}")
        return resp

    def get_json(self, path: str) -> Any:
        return json.loads(self._request("GET", path).data)

    def post_json(self, path: str, body: Mapping[str, Any]) -> Any:
        return json.loads(self._request("POST", path, body).data)

    def stream(self, path: str, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON objects of a streamed (SSE) response, ``[DONE]`` excluded."""
        resp = self._request("POST", path, {**body, "stream": True}, stream=True)
        try:
            buffer = b""
            for chunk in resp.stream(4096):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.startswith(b"data: ") and line[6:].strip() != b"[DONE]":
                        event = json.loads(line[6:])
                        if isinstance(event, dict) and "error" in event:  # refused after the 200 (vLLM streams it)
                            raise UpstreamError(f"the lens server refused the request: {_reason(line[6:].decode())}")
                        yield event
        finally:
            resp.release_conn()

    def models(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self.get_json("/v1/models")["data"]
        return data

    def token_texts(self, model: str, ids: Sequence[int]) -> dict[int, str]:
        """Each id's text alone (vLLM's /detokenize, cached per id)."""
        for token_id in {int(i) for i in ids} - set(self._token_text):
            self._token_text[token_id] = self.post_json("/detokenize", {"model": model, "tokens": [token_id]})["prompt"]
        return {int(i): self._token_text[int(i)] for i in ids}

    def tokenize(self, model: str, **what: Any) -> list[int]:
        tokens: list[int] = self.post_json("/tokenize", {"model": model, **what})["tokens"]
        return tokens

    def capture(self, model: str, layer: int, prompt: str | None = None, messages: Any = None) -> np.ndarray:
        """The residual stream after ``layer`` on a prompt or a conversation: (n_prompt, hidden)."""
        body: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0, "vllm_xargs": {CAPTURE_KEY: [layer]}}
        if messages is not None:
            answer = self.post_json("/v1/chat/completions", {**body, "messages": messages})
        else:
            answer = self.post_json("/v1/completions", {**body, "prompt": prompt})
        acts = activations_from_response(answer)
        if not isinstance(acts, dict) or "residual_stream" not in acts:
            raise UpstreamError("the server returned no activations: is it a lens server (lens_evals installed in its vLLM)?")
        stream: np.ndarray = np.asarray(acts["residual_stream"][0], dtype=np.float32)
        return stream


def _reason(text: str) -> str:
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:1000]
