"""Routes every vLLM server has: `/health` and `/ping` (V-HEALTH), `/version` (V-ROUTE-VERSION), `/metrics`
(V-METRIC-PROM), `/load` (V-METRIC-LOAD-ROUTE), `/v1/models` and the two generation routes."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from rljob.emulator.vllm import generation, metrics_text
from rljob.emulator.vllm.client import AsyncLLM
from rljob.emulator.vllm.middleware import STATE_KEY, llm_of


async def health(request: web.Request) -> web.Response:
    """check_health: 503 only once the engine is dead; it asks nothing of the engine core, so it answers
    while paused, asleep or blocked in a utility call (health.py:22-33@0.26.0)."""
    return web.Response(status=503 if llm_of(request).errored else 200)


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": llm_of(request).profile.version})


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    text = metrics_text.render(llm_of(request), [state.sleep_metrics, state.weight_metrics])
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": llm_of(request).server_load})


async def models(request: web.Request) -> web.Response:
    cfg = llm_of(request).cfg
    return web.json_response(
        {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "vllm",
                    "root": cfg.model,
                    "parent": None,
                    "max_model_len": cfg.max_model_len,
                }
                for name in cfg.served_model_names
            ],
        }
    )


Generate = Callable[[AsyncLLM, bytes, str | None], Awaitable[web.Response]]


def _generation_route(run: Generate) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def route(request: web.Request) -> web.Response:
        llm = llm_of(request)
        tracked = llm.cfg.server_load_tracking
        llm.server_load += int(tracked)
        try:
            return await run(llm, await request.read(), request.headers.get("X-Request-Id"))
        finally:
            llm.server_load -= int(tracked)

    return route


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/health", health)
    r.add_get("/ping", health)
    r.add_post("/ping", health)
    r.add_get("/version", version)
    r.add_get("/metrics", metrics)
    r.add_get("/load", load)
    r.add_get("/v1/models", models)
    r.add_post("/v1/completions", _generation_route(generation.completions))
    r.add_post("/v1/chat/completions", _generation_route(generation.chat_completions))
