"""HTTP client side for a lens-enabled OpenAI-compatible server. No vllm needed; torch optional
(tensors come back as torch where it is installed, else numpy; :func:`activations_from_response`
always gives numpy).

* :class:`LensClient` (alias ``VLLMLensClient``): what vllm-lens's client does (generate / chat
  with capture, steering, hooks; persistent hooks), against our server.
* vllm-lens's six helpers under their names (defined in ``lens_evals.vllm_lens_helpers``, also at
  the package root): ``serialize_tensor``, ``deserialize_tensor``, ``serialize_activations``,
  ``decode_activations``, ``serialize_hook_results``, ``deserialize_hook_results``. Both wire
  encodings decode everywhere (``lens_evals.wire``).
* Request builders: :func:`lens_xargs`, :func:`hook_set_body`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lens_evals.request.hooks import Hook
from lens_evals.request.readouts import LensReadout, SaeReadout, parse_readout
from lens_evals.request.spec import (
    CAPTURE_KEY,
    ENCODING_KEY,
    HOOK_SET_KEY,
    HOOKS_KEY,
    PROBE_KEY,
    READOUTS_KEY,
    STEERING_KEY,
    LinearProbe,
    SteeringVector,
)
from lens_evals.vllm_lens_helpers import (
    as_object,
    decode_activations,
    decode_item,
    deserialize_hook_results,
    deserialize_tensor,
    serialize_activations,
    serialize_hook_results,
    serialize_tensor,
)
from lens_evals.wire import formats as wire
from lens_evals.wire import frame as wire_frame

if TYPE_CHECKING:
    import urllib3

__all__ = [
    "GenerateOutput",
    "LensClient",
    "VLLMLensClient",
    "activations_from_response",
    "decode_activations",
    "deserialize_hook_results",
    "deserialize_tensor",
    "hook_results_from_response",
    "hook_set_body",
    "http_pool",
    "lens_xargs",
    "serialize_activations",
    "serialize_hook_results",
    "serialize_tensor",
]

# "residual_stream": array, "probe_scores": {name: array}, "saved": hook results (arrays decoded)
ActivationsDict = dict[str, Any]


# --------------------------------------------------------------------------- transport
def http_pool(timeout: float | None = 600.0, connections: int = 64, headers: Mapping[str, str] | None = None) -> urllib3.PoolManager:
    """The client's connection pool (``urllib3.PoolManager``; thread-safe, ``connections`` kept
    per server). urllib3 reads a response body through ``http.client`` in C: for a capture's 1.4 MB
    frame with 64 threads it spends ~1 ms of CPU where httpx's pure-Python HTTP parser spends ~3.4
    (docs/benchmarks.md, "Over HTTP vs offline"), and a Python client holding its GIL was what capped the
    over-HTTP capture. No retries, as httpx's default: a POST is not sent twice."""
    import urllib3

    return urllib3.PoolManager(
        maxsize=connections, timeout=urllib3.Timeout(connect=timeout, read=timeout), retries=False, headers=dict(headers or {})
    )


# --------------------------------------------------------------------------- request builders
def lens_xargs(
    capture_layers: Sequence[int] | bool | None = None,
    steering: Sequence[SteeringVector] | None = None,
    probes: Sequence[LinearProbe] | None = None,
    hooks: Sequence[Hook] | None = None,
    hook_set: str | None = None,
    encoding: str | None = None,
    readouts: Sequence[LensReadout | SaeReadout | Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The ``vllm_xargs`` body field for a request (steering vectors, probes and registered
    hooks as JSON strings, since vLLM's ``vllm_xargs`` only carries strings and numbers).
    ``capture_layers=True``: every layer. ``encoding``: how the activations come back
    (``lens_evals.wire.formats.RESPONSE_ENCODINGS``; default ``wire.DEFAULT_RESPONSE_ENCODING``)."""
    xargs: dict[str, Any] = {}
    if capture_layers is True:
        xargs[CAPTURE_KEY] = "true"
    elif capture_layers:
        xargs[CAPTURE_KEY] = list(capture_layers)
    if steering:
        xargs[STEERING_KEY] = [vec.to_json() for vec in steering]
    if probes:
        xargs[PROBE_KEY] = [probe.to_json() for probe in probes]
    if hooks:
        xargs[HOOKS_KEY] = [hook.to_json() for hook in hooks]
    if hook_set:
        xargs[HOOK_SET_KEY] = hook_set
    if encoding:
        xargs[ENCODING_KEY] = encoding
    if readouts:  # lens / SAE readouts (request/readouts.py): objects or wire dicts
        xargs[READOUTS_KEY] = [parse_readout(readout).to_json() for readout in readouts]
    return xargs


def hook_set_body(hooks: Sequence[Hook]) -> dict[str, Any]:
    """The JSON body of ``POST /lens/hook_sets`` (registered hooks only)."""
    return {"hooks": [hook.to_wire() for hook in hooks]}


# --------------------------------------------------------------------------- decoding (numpy)
def hook_results_from_response(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Decode the ``results`` of ``POST /lens/hook_sets/{id}/collect``."""
    results = body.get("results", [])
    if not isinstance(results, list):
        raise wire.WireError(f"results must be a list, got {type(results).__name__}")
    decoded = []
    for result in results:
        result = as_object(result, "a hook set result")
        if not {"request_id", "saved"} <= set(result):
            raise wire.WireError(f"a hook set result needs 'request_id' and 'saved', got {sorted(result)}")
        decoded.append({"request_id": result["request_id"], "saved": wire.decode_tree(result["saved"])})
    return decoded


def activations_from_response(body: Mapping[str, Any]) -> ActivationsDict | list[ActivationsDict] | None:
    """Decode ``"activations"`` of a completion / chat response (a list for several prompts) as
    numpy: ``"residual_stream"`` -> (n_layers, n_tokens, hidden), ``"probe_scores"`` -> {name:
    (n_tokens,)}, ``"saved"`` -> the hooks' results. bfloat16 comes back widened to float32."""
    raw = body.get("activations")
    if raw is None:
        return None
    if isinstance(raw, list):
        return [decode_item(item, wire.decode_array, wire.decode_tree) for item in raw]
    return decode_item(raw, wire.decode_array, wire.decode_tree)


# --------------------------------------------------------------------------- the client
@dataclass
class GenerateOutput:
    text: str
    activations: ActivationsDict | list[ActivationsDict] | None = None  # a list for several prompts
    hook_results: dict[str, dict[str, Any]] | None = None
    logprobs: Any = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


class LensClient:
    """An HTTP client with vllm-lens's ``VLLMLensClient`` interface. Persistent hooks: the
    client registers a hook set and sends its id with its own requests (nobody else's requests
    run them); ``register_hooks`` appends, ``collect_hook_results`` does not drain.
    ``encoding``: how activations travel (``wire.RESPONSE_ENCODINGS``); by default as a binary
    frame (no base64; ``raw`` then holds each array's bytes as a memoryview), None for the
    server's default. Thread-safe: ``connections`` threads can each have a request in flight
    (:func:`http_pool`)."""

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        encoding: str | None = wire.SAFETENSORS_FRAME,
        connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._model = model
        self.encoding = encoding
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = http_pool(timeout, connections, headers)
        self._hooks: list[Hook] = []
        self.hook_set: str | None = None
        self._carried: dict[str, dict[str, Any]] = {}  # results of replaced sets

    @property
    def model(self) -> str:
        if self._model is None:
            self._model = self._json("GET", "/v1/models")["data"][0]["id"]
        return self._model

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """A response's body: JSON, or a frame unframed (``lens_evals.wire.frame``)."""
        response = self._http.request(method, f"{self.base_url}{path}", json=body)
        data = wire_frame.response_body(response.data, response.headers.get("content-type"))
        if response.status != 200 or (isinstance(data, dict) and "error" in data):
            error = data.get("error", data) if isinstance(data, dict) else data
            raise RuntimeError(f"HTTP {response.status}: {error.get('message', error) if isinstance(error, dict) else error}")
        return data

    def _xargs(self, hooks: Any, capture_layers: Any, steering_vectors: Any, probes: Any, readouts: Any = None) -> dict[str, Any]:
        return lens_xargs(capture_layers, steering_vectors, probes, hooks, self.hook_set, self.encoding, readouts)

    def _post(self, path: str, body: dict[str, Any], xargs: dict[str, Any]) -> GenerateOutput:
        if xargs:
            body["vllm_xargs"] = {**body.get("vllm_xargs", {}), **xargs}
        data = self._json("POST", path, body)
        choice = data["choices"][0]
        raw = data.get("activations")
        activations = None if raw is None else [decode_item(item) for item in raw] if isinstance(raw, list) else decode_item(raw)
        hook_results = deserialize_hook_results(data["hook_results"]) if "hook_results" in data else None
        return GenerateOutput(
            text=(choice.get("message") or {}).get("content") or choice.get("text", ""),
            activations=activations,
            hook_results=hook_results,
            logprobs=choice.get("logprobs"),
            prompt_token_ids=data.get("prompt_token_ids") or choice.get("prompt_token_ids"),
            token_ids=choice.get("token_ids"),
            raw=data,
        )

    def generate(
        self,
        prompt: str,
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        hooks: Sequence[Hook] | None = None,
        capture_layers: Sequence[int] | bool | None = None,
        steering_vectors: Sequence[SteeringVector] | None = None,
        probes: Sequence[LinearProbe] | None = None,
        readouts: Sequence[LensReadout | SaeReadout | Mapping[str, Any]] | None = None,
        logprobs: int | None = None,
        echo: bool = False,
        **kwargs: Any,
    ) -> GenerateOutput:
        """``/v1/completions`` (token ids come back: ``return_token_ids``)."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "return_token_ids": True,
            **kwargs,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        if echo:
            body["echo"] = True
        return self._post("/v1/completions", body, self._xargs(hooks, capture_layers, steering_vectors, probes, readouts))

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        hooks: Sequence[Hook] | None = None,
        capture_layers: Sequence[int] | bool | None = None,
        steering_vectors: Sequence[SteeringVector] | None = None,
        probes: Sequence[LinearProbe] | None = None,
        readouts: Sequence[LensReadout | SaeReadout | Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> GenerateOutput:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "return_token_ids": True,
            **kwargs,
        }
        return self._post("/v1/chat/completions", body, self._xargs(hooks, capture_layers, steering_vectors, probes, readouts))

    # persistent hooks
    def register_hooks(self, hooks: Sequence[Hook], prefetch_params: Sequence[str] | None = None) -> str:
        """Add hooks to this client's hook set (a new set holding all of them replaces the old
        one; the old one's results are kept for :meth:`collect_hook_results`). Returns its id."""
        combined = [*self._hooks, *hooks]
        made = self._json("POST", "/v1/hooks/register", {"hooks": [hook.to_wire() for hook in combined]})
        if self.hook_set is not None:
            self._carried.update(self._collect(self.hook_set))
            self._json("POST", "/v1/hooks/clear", {"id": self.hook_set})
        self._hooks, self.hook_set = combined, made["id"]
        if prefetch_params:
            self.prefetch_params(list(prefetch_params))
        return str(made["id"])

    def _collect(self, set_id: str) -> dict[str, dict[str, Any]]:
        raw = as_object(self._json("POST", "/v1/hooks/collect", {"id": set_id}).get("results"), "results")
        return {request_id: deserialize_hook_results(per_hook) for request_id, per_hook in raw.items()}

    def collect_hook_results(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{request_id: {hook_index: saved}}`` since the last clear (not drained)."""
        return {**self._carried, **(self._collect(self.hook_set) if self.hook_set else {})}

    def clear_hook_results(self) -> None:
        self._carried.clear()
        if self.hook_set is not None:
            self._json("POST", "/v1/hooks/clear_results", {"id": self.hook_set})

    def clear_hooks(self) -> None:
        if self.hook_set is not None:
            self._json("POST", "/v1/hooks/clear", {"id": self.hook_set})
        self._hooks, self.hook_set = [], None
        self._carried.clear()

    def prefetch_params(self, names: list[str]) -> None:
        self._json("POST", "/v1/hooks/prefetch", {"params": names})

    def clear_prefetched(self) -> None:
        self._json("POST", "/v1/hooks/clear_prefetched", {})

    def close(self) -> None:
        self._http.clear()


VLLMLensClient = LensClient  # vllm-lens's name, for code that changes only its import line
