"""vLLM internals of a request's admission on the frontend: the input processor's validation
hook, the engine-unique request id, the request's sampling parameters and cache salt, and the
errors vLLM's server answers with a status of ours."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lens_evals.engine.compat._base import Method, _patch

__all__ = [
    "patch_input_processor",
    "patch_request_id_assignment",
    "recompute_from_scratch",
    "request_sampling_params",
    "set_request_cache_salt",
]


def _http_error(message: str, status: int) -> Exception:
    """An error vLLM's server answers with ``status`` (vLLM 0.32's GracefulHTTPError); a client
    error (400) on a vLLM without it."""
    try:
        from vllm.exceptions import GracefulHTTPError
    except ImportError:
        return _client_error_class()(message)
    from http import HTTPStatus

    return GracefulHTTPError(message, HTTPStatus(status))


def _client_error_class() -> type[ValueError]:
    """A ValueError that vLLM's server maps to HTTP 400 (0.32 only passes VLLMClientError
    through AsyncLLM.generate; other exceptions become a bare 500)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # vLLM 0.26: ValueError already maps to 400
        return ValueError

    class LensValidationError(VLLMValidationError, ValueError):
        pass

    return LensValidationError


def patch_input_processor(on_request: Callable[[Any, str, Any], None]) -> None:
    """Call ``on_request(input_processor, external_request_id, engine_core_request)`` for
    every new request, after vLLM's own processing and before the request id is rewritten.
    ``on_request`` may raise ValueError: vLLM turns it into an HTTP 400 / offline error; a
    RuntimeError with an ``http_status`` attribute is answered with that status."""
    from vllm.v1.engine import input_processor as ip_module

    cls = ip_module.InputProcessor  # 0.26 and 0.32

    error_class = _client_error_class()

    def make(original: Method) -> Method:
        def process_inputs(self: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
            request = original(self, request_id, *args, **kwargs)
            try:
                on_request(self, request_id, request)
            except ValueError as exc:
                if isinstance(exc, error_class):
                    raise
                raise error_class(str(exc)) from None
            except RuntimeError as exc:  # ours that name an HTTP status (the lens budget: 429)
                if (status := getattr(exc, "http_status", None)) is None:
                    raise
                raise _http_error(str(exc), status) from None
            return request

        return process_inputs

    _patch(cls, "process_inputs", make)


def patch_request_id_assignment(on_assigned: Callable[[Any, Any], None]) -> None:
    """Call ``on_assigned(input_processor, engine_core_request)`` once vLLM has given a new
    request its engine-unique id (``request.request_id``; the client's stays in
    ``request.external_req_id``): clients may repeat their ids, the engine's are unique.
    ``on_assigned`` may raise ValueError: vLLM turns it into an HTTP 400 / offline error."""
    from vllm.v1.engine import input_processor as ip_module

    cls = ip_module.InputProcessor  # a staticmethod there, always called on the instance
    error_class = _client_error_class()

    def make(original: Method) -> Method:
        def assign_request_id(self: Any, request: Any) -> None:
            original(request)
            try:
                on_assigned(self, request)
            except ValueError as exc:
                if isinstance(exc, error_class):
                    raise
                raise error_class(str(exc)) from None

        return assign_request_id

    _patch(cls, "assign_request_id", make)


def request_sampling_params(request: Any) -> Any:
    return getattr(request, "sampling_params", None)


def set_request_cache_salt(request: Any, salt: str) -> None:
    """A unique salt: the request neither reads cached prefix KV nor leaves KV others reuse."""
    request.cache_salt = salt


def recompute_from_scratch(params: Any) -> None:
    """After preemption the request is recomputed from its first token, never from prefix KV
    it left in the cache (vLLM >= 0.11: ``skip_reading_prefix_cache``). Hooks then see each
    position again from 0, so the worker can start their ``saved`` over."""
    if hasattr(params, "skip_reading_prefix_cache"):
        params.skip_reading_prefix_cache = True
