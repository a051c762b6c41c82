"""The lens middleware goes innermost on the OpenAI-compatible server's app even when the app's
middleware stack was built before serving: vLLM 0.26's ``build_app`` ends with the SageMaker
standards' bootstrap (``model_hosting_container_standards``, installed with vLLM), which builds the
stack at once. Before the fix every server on vLLM 0.26 failed to start ("the app has started";
seen on an H100, 2026-12-07); vLLM 0.32 adds middleware through another hook, so CPU servers never
met it."""

from __future__ import annotations

from typing import Any

import model_hosting_container_standards.sagemaker as sagemaker_standards
from fastapi import FastAPI
from fastapi.testclient import TestClient

from lens_evals.engine.compat.frontend import add_innermost_middleware


def recording(name: str, seen: list[str]) -> type:
    class Recording:
        def __init__(self, app: Any) -> None:
            self.app = app

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] == "http":
                seen.append(name)
            await self.app(scope, receive, send)

    return Recording


def test_lens_middleware_runs_innermost_after_the_sagemaker_bootstrap() -> None:
    seen: list[str] = []
    app = FastAPI()

    @app.get("/probe-order")
    def order() -> dict[str, list[str]]:
        return {"seen": list(seen)}

    app.add_middleware(recording("operator", seen))  # the operator's --middleware, added by build_app
    app = sagemaker_standards.bootstrap(app)  # how vLLM 0.26's build_app ends
    assert app.middleware_stack is not None, "the bootstrap no longer builds the stack: this test reproduces nothing"
    add_innermost_middleware(app, recording("lens", seen))
    response = TestClient(app).get("/probe-order")
    assert response.status_code == 200
    assert response.json() == {"seen": ["operator", "lens"]}
