"""Inspect AI model API ``vllm-lens/<model>``: a lens-enabled vLLM OpenAI server, started per
eval (or reached with ``-M base_url=...`` or the ``VLLM_LENS_BASE_URL`` environment variable),
whose activations land in ``ModelOutput.metadata["activations"]["residual_stream"]`` as a torch
tensor (a numpy array in a client-only install without torch).

Lens requests go through ``GenerateConfig(extra_body={"extra_args": {...}})``; they are sent as
``vllm_xargs`` (SteeringVector objects as JSON strings). ``"lora_request": {"lora_name": ...}``
in ``extra_body`` selects a LoRA adapter served by that name. Activations are taken out of the
HTTP response before Inspect records the model call, so ``.eval`` logs carry no tensors; the
request and generate config Inspect records hold each steering vector's / probe's arrays as a
digest (:mod:`lens_evals.inspect_kit.provider.logged_call`). With ``"return_token_ids": True`` in ``extra_body`` the
server's token ids land in ``ModelOutput.metadata["token_ids"]`` (``prompt``, ``completion``),
also kept out of the logged response; so do vLLM's ``"prompt_logprobs": 0`` (asked for in
``extra_body``): each prompt token's log-probability, in ``ModelOutput.metadata["prompt_logprobs"]``."""

from __future__ import annotations

import contextvars
import importlib.metadata
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import httpx
from inspect_ai.hooks import Hooks, RunEnd, hooks
from inspect_ai.model import GenerateConfig, ModelOutput, modelapi
from inspect_ai.model._providers.openai_compatible import OpenAICompatibleAPI  # not exported; Inspect's vllm provider subclasses it too

from lens_evals.inspect_kit.provider import frames
from lens_evals.inspect_kit.provider.logged_call import logged_extra_args, real_extra_args, split_xargs, wire_request
from lens_evals.inspect_kit.provider.lora_args import lora_server_args
from lens_evals.inspect_kit.provider.outputs import (
    ACTIVATIONS_KEY,
    HOOK_RESULTS_KEY,
    PROMPT_LOGPROBS_KEY,
    PROMPT_TOKEN_IDS_KEY,
    TOKEN_IDS_KEY,
    decode_activations,
    decode_hook_results,
    prompt_token_logprobs,
)
from lens_evals.inspect_kit.provider.server import LensServer, acquire_server, release_server, stop_shared_servers
from lens_evals.inspect_kit.provider.xargs import to_vllm_xargs
from lens_evals.request.spec import ENCODING_KEY
from lens_evals.wire import formats as wire

if TYPE_CHECKING:
    from inspect_ai.model import RetryDecision  # for the type checker only

logger = logging.getLogger("lens_evals")
PROVIDER_NAME = "vllm-lens"
BASE_URL_ENV = "VLLM_LENS_BASE_URL"  # Inspect's SERVICE_BASE_URL convention: reach a running server
API_KEY_ENV = "VLLM_LENS_API_KEY"  # and SERVICE_API_KEY: its key (a server started with --api-key)
_RAW_ACTIVATIONS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("lens_raw_activations", default=None)
# The real (array-carrying) vllm_xargs items of the request being built, keyed by their logged form.
_WIRE_PAYLOADS: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar("lens_wire_payloads", default=None)
# Token ids the server returned (``return_token_ids``), taken out of the logged response.
_TOKEN_IDS: contextvars.ContextVar[dict[str, list[int]] | None] = contextvars.ContextVar("lens_token_ids", default=None)
# Per-hook results of the request's own hooks ({hook index: saved}), taken out of the logged response.
_RAW_HOOK_RESULTS: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("lens_raw_hook_results", default=None)
# vLLM's prompt_logprobs (asked for in extra_body), taken out of the logged response.
_PROMPT_LOGPROBS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("lens_prompt_logprobs", default=None)
# model args that configure the provider itself, not the server
_PROVIDER_ARGS = {"base_url", "api_key", "server_timeout"}


def check_no_conflicting_provider() -> None:
    """The public vllm-lens package registers an Inspect provider of the same name."""
    for dist_name in ("vllm-lens", "vllm_lens"):
        try:
            version = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
        raise RuntimeError(
            f"both lens-evals and the package {dist_name} {version} are installed; both register the Inspect "
            f"provider '{PROVIDER_NAME}'. Uninstall one of them (pip uninstall {dist_name})."
        )


@modelapi(name=PROVIDER_NAME)
class VLLMLensAPI(OpenAICompatibleAPI):
    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig = GenerateConfig(),
        **model_args: Any,
    ) -> None:
        check_no_conflicting_provider()
        # A base_url taken from the environment is followed when the variable changes later
        # (Inspect memoises model instances by their arguments, not by the environment).
        self._env_base_url = None if base_url else os.environ.get(BASE_URL_ENV) or None
        base_url = base_url or self._env_base_url
        self.server: LensServer | None = None
        self._given_key = api_key or os.environ.get(API_KEY_ENV) or None  # a server we start takes it, else a random key
        self._server_spec: tuple[str, str, dict[str, Any], float] | None = None
        server_timeout = _server_timeout(model_args.pop("server_timeout", 600))
        self._own_server_args = (dict(model_args), server_timeout)
        if api_key == _model_info_lookup_key():
            # Inspect builds a throwaway instance to look up model info: start nothing.
            base_url = base_url or "http://127.0.0.1:9/v1"
        elif base_url is None:
            self._server_spec = _own_server_spec(model_name, model_args, server_timeout)
            self.server = acquire_server(*self._server_spec[:3], timeout=server_timeout, api_key=self._given_key)
            base_url = f"{self.server.url}/v1"
            api_key = self.server.api_key
        else:
            if model_args:
                raise ValueError(f"model args {sorted(model_args)} configure a server we start; with base_url they have no effect")
            _check_reachable(base_url)
        # captures come as binary frames, read by this client (lens_evals.inspect_kit.provider.frames)
        self._frame_client = frames.frame_http_client()
        super().__init__(
            model_name=model_name,
            base_url=base_url,
            api_key=api_key or os.environ.get(API_KEY_ENV) or "lens-evals-local",
            config=config,
            service=PROVIDER_NAME,
            service_base_url=base_url,
            **self._client_args(),
        )

    def _client_args(self) -> dict[str, Any]:
        """The SDK client's model args: our frame-reading HTTP client, where this Inspect can build it."""
        return {} if self._frame_client is None else {"http_client": self._frame_client}

    def completion_params(self, config: GenerateConfig, tools: bool) -> dict[str, Any]:
        params = super().completion_params(config, tools)
        extra_body = dict(params.get("extra_body") or {})
        extra_args = extra_body.pop("extra_args", None)
        if extra_args:
            xargs = dict(extra_body.get("vllm_xargs") or {})
            xargs.update(to_vllm_xargs(real_extra_args(extra_args)))
            if self.http_client is self._frame_client:  # (None: this Inspect cannot read frames)
                xargs.setdefault(ENCODING_KEY, wire.SAFETENSORS_FRAME)  # no base64 either side; a JSON encoding asked for stays
            extra_body["vllm_xargs"], payloads = split_xargs(xargs)  # arrays as digests in the log
            _WIRE_PAYLOADS.set(payloads)
            extra_body.setdefault("return_token_ids", True)  # which token each activation row belongs to
        if extra_body.get("prompt_logprobs") is not None:
            extra_body.setdefault("return_token_ids", True)  # which token each log-prob belongs to
        lora = extra_body.pop("lora_request", None)
        if lora:
            params["model"] = lora["lora_name"]
        if extra_body:
            params["extra_body"] = extra_body
        else:
            params.pop("extra_body", None)
        return params

    # The one override of a private method of Inspect's provider. Inspect logs the request before it
    # sends it and the response as it arrives, both inside OpenAICompatibleAPI.generate(); its public
    # hooks see the request that is logged (completion_params) or a response already copied into the
    # log (on_response, chat_choices_from_completion). _generate_completion is the only point between
    # the log and the wire: the arrays go out here (the logged request holds their digests), and the
    # activations, hook results and token ids come off the response before Inspect logs it.
    async def _generate_completion(self, request: dict[str, Any], config: GenerateConfig) -> Any:
        completion = await super()._generate_completion(wire_request(request, _WIRE_PAYLOADS.get() or {}), config)
        _take_lens_fields(completion)
        return completion

    async def generate(self, input: Any, tools: Any, tool_choice: Any, config: GenerateConfig) -> Any:
        self._ensure_server()
        if config.extra_body and isinstance(config.extra_body.get("extra_args"), dict):
            # ``config`` is the object Inspect's ModelEvent logs: its arrays become digests there
            # (each LoggedItem keeps the real object, so completion_params and retries still send it).
            config.extra_body = {**config.extra_body, "extra_args": logged_extra_args(config.extra_body["extra_args"])}
        _RAW_ACTIVATIONS.set(None)
        _WIRE_PAYLOADS.set(None)
        _TOKEN_IDS.set(None)
        _RAW_HOOK_RESULTS.set(None)
        _PROMPT_LOGPROBS.set(None)
        result = await super().generate(input, tools, tool_choice, config)
        raw, token_ids = _RAW_ACTIVATIONS.get(), _TOKEN_IDS.get()
        output = result[0] if isinstance(result, tuple) else result
        if raw is not None and isinstance(output, ModelOutput):
            output.metadata = {**(output.metadata or {}), ACTIVATIONS_KEY: decode_activations(raw)}
        if token_ids is not None and isinstance(output, ModelOutput):
            output.metadata = {**(output.metadata or {}), TOKEN_IDS_KEY: token_ids, PROMPT_TOKEN_IDS_KEY: token_ids["prompt"]}
        hook_results = _RAW_HOOK_RESULTS.get()
        if hook_results is not None and isinstance(output, ModelOutput):
            output.metadata = {**(output.metadata or {}), HOOK_RESULTS_KEY: decode_hook_results(hook_results)}
        prompt_logprobs = _PROMPT_LOGPROBS.get()
        if prompt_logprobs is not None and token_ids is not None and isinstance(output, ModelOutput):
            output.metadata = {**(output.metadata or {}), PROMPT_LOGPROBS_KEY: prompt_token_logprobs(prompt_logprobs, token_ids["prompt"])}
        return result

    async def tokenize(
        self, text: str | None = None, messages: list[dict[str, str]] | None = None, continue_final_message: bool = False
    ) -> list[int]:
        """Token ids as this server makes them: ``text`` without special tokens, or ``messages``
        through the chat template with the generation prompt (what a chat request sends) or, with
        ``continue_final_message``, ending inside the final (assistant) message."""
        self._ensure_server()
        body: dict[str, Any] = {"model": self.model_name}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=not continue_final_message, continue_final_message=continue_final_message)
        else:
            body.update(prompt=text, add_special_tokens=False)
        return [int(t) for t in (await self.server_json("post", "/tokenize", body))["tokens"]]

    async def served_models(self) -> list[str]:
        """Names this server answers to: the model and its LoRA adapters."""
        self._ensure_server()
        return [str(entry["id"]) for entry in (await self.server_json("get", "/v1/models"))["data"]]

    async def server_json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer of one of the server's own routes (``/tokenize``, ``/detokenize``, ``/v1/models``)."""
        root = str(self.base_url).rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}  # a server started with --api-key
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.request(method, f"{root}{path}", json=body, headers=headers)
        if response.status_code != 200:
            raise RuntimeError(f"{method.upper()} {path} failed with HTTP {response.status_code}: {response.text[:500]}")
        return response.json()

    def _ensure_server(self) -> None:
        """Servers stop when an Inspect run ends; a memoised model used again restarts its own,
        or follows ``VLLM_LENS_BASE_URL`` when it was built from that variable and it changed."""
        if self._env_base_url is not None and os.environ.get(BASE_URL_ENV) != self._env_base_url:
            self._follow_environment()
        if self._server_spec is None or (self.server is not None and self.server.process is not None):
            return
        model, name, args, timeout = self._server_spec
        self.server = acquire_server(model, name, args, timeout=timeout, api_key=self._given_key)
        if self.server.url != str(self.base_url).removesuffix("/v1").rstrip("/") or self.server.api_key != self.api_key:
            self.base_url = f"{self.server.url}/v1"
            self.api_key = self.server.api_key
            self.initialize()

    def _follow_environment(self) -> None:
        self._env_base_url = os.environ.get(BASE_URL_ENV) or None
        if self._env_base_url is not None:
            self.base_url = self._env_base_url
            self.initialize()
        else:  # the variable is gone: start (or share) our own server, as without it
            self._server_spec = _own_server_spec(self.model_name, *self._own_server_args)
            self.server = None

    def should_retry(self, ex: BaseException) -> bool | RetryDecision:
        """No retries once the server is gone (its process exited, or nothing answers at
        base_url): the sample fails at once, with the reason logged, instead of retrying."""
        if isinstance(ex, (httpx.ConnectError, ConnectionError)) or type(ex).__name__ == "APIConnectionError":
            process = self.server.process if self.server is not None else None
            if process is not None and process.poll() is not None:
                logger.error(
                    "lens_evals: the vLLM server for %s exited (code %s); not retrying.\n%s",
                    self.model_name,
                    process.returncode,
                    self.server.tail() if self.server else "",
                )
                return False
            root = str(self.base_url).rstrip("/").removesuffix("/v1")
            try:
                httpx.get(f"{root}/health", timeout=5)
            except httpx.HTTPError:
                logger.error("lens_evals: no vLLM server reachable at %s (stopped?); not retrying", root)
                return False
        return super().should_retry(ex)

    def close(self) -> None:
        if self.server is not None:
            release_server(self.server)
            self.server = None

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            self.close()


def _take_lens_fields(completion: Any) -> None:
    """Activations, hook results, prompt log-probs and token ids out of the response, into this request's context."""
    extra = getattr(completion, "model_extra", None)
    if extra and extra.get(PROMPT_LOGPROBS_KEY) is not None:
        _PROMPT_LOGPROBS.set(list(extra.pop(PROMPT_LOGPROBS_KEY)))
    if extra and ACTIVATIONS_KEY in extra:
        _RAW_ACTIVATIONS.set(frames.take(extra.pop(ACTIVATIONS_KEY)))
    if extra and HOOK_RESULTS_KEY in extra:
        _RAW_HOOK_RESULTS.set(frames.take(extra.pop(HOOK_RESULTS_KEY)))
    if extra and extra.get(PROMPT_TOKEN_IDS_KEY) is not None:  # asked for with return_token_ids
        choices = [getattr(choice, "model_extra", None) or {} for choice in completion.choices]
        _TOKEN_IDS.set(
            {
                "prompt": list(extra.pop(PROMPT_TOKEN_IDS_KEY)),
                "completion": list(choices[0].pop("token_ids", None) or []) if choices else [],
            }
        )


def _server_timeout(value: Any) -> float:
    """``-M server_timeout``: seconds a server we start has to come up (0, negative or NaN gave it none)."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not seconds > 0:
        raise ValueError(f"-M server_timeout={value!r}: expected a number of seconds above 0")
    return seconds


def _own_server_spec(model_name: str, model_args: dict[str, Any], timeout: float) -> tuple[str, str, dict[str, Any], float]:
    """(model path, served name, server args, start timeout) for a server this provider starts."""
    from lens_evals.models.lookup import unknown_model
    from lens_evals.models.registry import PREPARERS, resolve_model

    problem = unknown_model(model_name)
    if problem:  # else a server starts and asks the HF hub for it
        raise ValueError(f"{PROVIDER_NAME}/{model_name}: {problem}")
    model_args = dict(model_args)
    if model_name in PREPARERS:
        # Embedded models are stored in fp32; vLLM's "auto" would downcast them, and probes
        # trained offline on fp32 activations must see the same numbers.
        model_args.setdefault("dtype", "float32")
    server_args = lora_server_args(model_args, model_name)
    if server_args.get("enable_lora") and "dtype" in server_args:
        from lens_evals.engine.compat.lora import lora_engine_dtype

        server_args["dtype"] = lora_engine_dtype(server_args["dtype"])  # bf16 on a GPU (vLLM's LoRA kernels)
    return resolve_model(model_name), model_name, server_args, timeout


def _model_info_lookup_key() -> str | None:
    try:
        from inspect_ai.model._model_info import MODEL_INFO_LOOKUP_API_KEY
    except ImportError:  # older Inspect: no such lookup instance
        return None
    return str(MODEL_INFO_LOOKUP_API_KEY)


def _check_reachable(base_url: str) -> None:
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        response = httpx.get(f"{root}/health", timeout=5)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"no vLLM server reachable at {root}: {exc}") from None
    if response.status_code != 200:
        raise RuntimeError(f"vLLM server at {root} is not healthy (HTTP {response.status_code})")


@hooks(name="lens_evals_servers", description="Stop vllm-lens servers when an Inspect run ends")
class StopServersAtRunEnd(Hooks):
    async def on_run_end(self, data: RunEnd) -> None:
        stop_shared_servers()
