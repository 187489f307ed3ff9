"""The other development routes: sleep/api_router.py (V-ROUTE-SLEEP, -WAKE, -IS-SLEEPING, -RELEASE-KV),
cache/api_router.py (V-ROUTE-FLUSH), rpc/api_router.py (V-ROUTE-RPC), server_info/api_router.py
(V-ROUTE-SERVER-INFO), all under …/entrypoints/serve/dev/. Registered only with VLLM_SERVER_DEV_MODE=1."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from aiohttp import web

from rljob.emulator.vllm.config import server_info as config_json
from rljob.emulator.vllm.errors import HTTPError, query_bool, query_int, query_literal
from rljob.emulator.vllm.middleware import LLM_KEY, STATE_KEY, llm_of, raw_json

PAUSE_MODES = ("abort", "wait", "keep")


async def sleep(request: web.Request) -> web.Response:
    """0.26: `int(level)` (any integer; not one: ValueError, 400) and `mode` unchecked (an invalid one
    fails in the engine: 500), empty 200. 0.34: level 0..2 and mode validated, JSON answer."""
    llm = llm_of(request)
    q = request.query
    if not llm.profile.sleep_level_range_checked:
        level = int(q.get("level", "1"))
        await llm.sleep(level, q.get("mode", "abort"))
        return web.Response(status=200)
    level = query_int(q, "level", 1, 0, 2)
    mode = query_literal(q, "mode", PAUSE_MODES, "abort")
    query_bool(q, "reset_connector", True)
    started = time.perf_counter()
    try:
        await llm.sleep(level, mode)
    finally:
        request.app[STATE_KEY].sleep_metrics.observe("sleep", time.perf_counter() - started)
    return web.json_response({"status": "sleeping", "level": level})


async def wake_up(request: web.Request) -> web.Response:
    llm = llm_of(request)
    tags: list[str] | None = request.query.getall("tags", []) or None
    started = time.perf_counter()
    try:
        fully_awake = await llm.wake_up(tags)
    finally:
        if llm.profile.sleep_and_wake_answer_json:
            request.app[STATE_KEY].sleep_metrics.observe("wake", time.perf_counter() - started)
    if not llm.profile.sleep_and_wake_answer_json:
        return web.Response(status=200)
    return web.json_response({"status": "awake" if fully_awake else "sleeping", "tags": tags})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": await llm_of(request).is_sleeping()})


async def release_kv_cache_memory(request: web.Request) -> web.Response:
    query_bool(request.query, "reset_connector", True)
    started = time.perf_counter()
    try:
        await llm_of(request).release_kv_cache_memory()
    finally:
        request.app[STATE_KEY].sleep_metrics.observe("release_kv_cache_memory", time.perf_counter() - started)
    return web.json_response({"status": "kv_cache_released"})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """Query parameters only: a JSON body is not read (V-ROUTE-FLUSH)."""
    reset_running = query_bool(request.query, "reset_running_requests", False)
    query_bool(request.query, "reset_external", False)
    return web.json_response({"success": await llm_of(request).reset_prefix_cache(reset_running)})


async def reset_other_cache(request: web.Request) -> web.Response:
    """/reset_mm_cache, /reset_encoder_cache: the emulated model has neither cache; 200 empty."""
    llm = llm_of(request)
    await llm.call("reset_mm_cache", lambda core: None)
    return web.Response(status=200)


async def collective_rpc(request: web.Request) -> web.Response:
    llm = llm_of(request)
    body = await raw_json(request, detail=None)
    if not isinstance(body, dict):
        if llm.profile.body_must_be_object:
            raise HTTPError(400, "Request body must be a JSON object")
        raise AttributeError(f"'{type(body).__name__}' object has no attribute 'get'")
    method = body.get("method")
    if method is None:
        raise HTTPError(400, "Missing 'method' in request body")
    args, kwargs, timeout = body.get("args", []), body.get("kwargs", {}), body.get("timeout")
    results = await llm.collective_rpc(str(method), timeout, tuple(args), dict(kwargs))
    return web.json_response(
        {"results": [r if r is None or isinstance(r, dict | list) else str(r) for r in results]}
    )


async def server_info(request: web.Request) -> web.Response:
    llm = llm_of(request)
    fmt = query_literal(request.query, "config_format", ("text", "json"), "text")
    config: Any = config_json(llm.cfg)
    if fmt == "text":
        config = ", ".join(f"{k}={v}" for k, v in config.items())
    return web.json_response(
        {
            "vllm_config": config,
            "vllm_env": {
                k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_") and "KEY" not in k
            },
            "system_env": {"os": platform.platform(), "python_version": platform.python_version()},
        }
    )


def add_routes(app: web.Application) -> None:
    profile = app[LLM_KEY].profile
    r = app.router
    r.add_post("/sleep", sleep)
    r.add_post("/wake_up", wake_up)
    r.add_get("/is_sleeping", is_sleeping)
    if profile.has_release_kv_route:
        r.add_post("/release_kv_cache_memory", release_kv_cache_memory)
    r.add_post("/reset_prefix_cache", reset_prefix_cache)
    r.add_post("/reset_mm_cache", reset_other_cache)
    r.add_post("/reset_encoder_cache", reset_other_cache)
    r.add_post("/collective_rpc", collective_rpc)
    r.add_get("/server_info", server_info)
