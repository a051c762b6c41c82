"""The page's web app (starlette, served by uvicorn: both come with vLLM): the static page from
package data and a small JSON API over the lens server. Bad input: a 400 with the reason, which
the page shows."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterator
from importlib import resources
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from lens_evals.chat.backend import ChatBackend, OracleQuestion, Turn
from lens_evals.chat.export import Export, export_html
from lens_evals.chat.oracle_box import OracleUnavailable
from lens_evals.chat.upstream import UpstreamError

STATIC = {"chat.js": "text/javascript", "chat.css": "text/css"}


def _static(name: str) -> str:
    return resources.files("lens_evals.chat").joinpath(f"static/{name}").read_text(encoding="utf-8")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def _invalid(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors(include_url=False))


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        return model.model_validate(json.loads(await request.body()))
    except ValueError as exc:  # JSONDecodeError and ValidationError
        raise _BadInput(_invalid(exc) if isinstance(exc, ValidationError) else f"not JSON: {exc}") from None


class _BadInput(Exception):
    pass


def _handler(work: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    async def handle(request: Request) -> Response:
        try:
            return await work(request)
        except _BadInput as exc:
            return _error(400, str(exc))
        except OracleUnavailable as exc:
            return _error(409, str(exc))
        except (UpstreamError, ValueError, FileNotFoundError) as exc:
            return _error(502 if isinstance(exc, UpstreamError) else 400, str(exc))

    return handle


def build_app(backend: ChatBackend) -> Starlette:
    from starlette.concurrency import run_in_threadpool

    async def page(request: Request) -> Response:
        return HTMLResponse(_static("index.html"))

    async def static(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in STATIC:
            return _error(404, f"no such file: {name}")
        return Response(_static(name), media_type=STATIC[name])

    async def info(request: Request) -> Response:
        return JSONResponse(backend.info())

    async def chat(request: Request) -> Response:
        turn = await _parse(request, Turn)

        def events() -> Iterator[str]:
            for event in backend.turn(turn):
                yield f"data: {json.dumps(event)}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def oracle(request: Request) -> Response:
        question = await _parse(request, OracleQuestion)
        return JSONResponse(await run_in_threadpool(backend.ask_oracle, question))

    async def export(request: Request) -> Response:
        conversation = await _parse(request, Export)
        return HTMLResponse(export_html(conversation), headers={"Content-Disposition": 'attachment; filename="conversation.html"'})

    routes = [
        Route("/", page),
        Route("/static/{name}", static),
        Route("/api/info", _handler(info)),
        Route("/api/chat", _handler(chat), methods=["POST"]),
        Route("/api/oracle", _handler(oracle), methods=["POST"]),
        Route("/api/export", _handler(export), methods=["POST"]),
    ]
    return Starlette(routes=routes)
