"""What vLLM's API server does around every route: the API key on `/v1`, `/v2`, `/inference` only
(V-ROUTE-AUTH), the exception handlers (V-ROUTE-ERRORS), the shutdown a request to a dead engine
triggers (`terminate_if_errored`, V-DEATH-EXC); plus the emulator's call counters, call log and route
faults. Also the body readers the routes share."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rljob.emulator.call_log import CALL_LOG_KEY
from rljob.emulator.vllm.client import AsyncLLM
from rljob.emulator.vllm.errors import (
    EngineDeadError,
    HTTPError,
    ValidationFailed,
    exception_response,
    http_error_response,
    json_invalid,
    missing_body_field,
    validation_response,
)
from rljob.emulator.vllm.metrics_text import OperationHistogram

log = logging.getLogger("vllm.emulator")


@dataclass
class ServerState:
    """The API server's own state beside the engine."""

    shutdown: Callable[[], None]  # terminate_if_errored
    watchdog: asyncio.Future[None] | None = None  # the dead-engine watchdog task
    calls: Counter[str] = field(default_factory=Counter)  # requests per route (emulator)
    sleep_metrics: OperationHistogram = field(
        default_factory=lambda: OperationHistogram("vllm:sleep_mode_operation_duration_seconds")
    )
    weight_metrics: OperationHistogram = field(
        default_factory=lambda: OperationHistogram("vllm:rl_weight_update_operation_duration_seconds")
    )


LLM_KEY = web.AppKey("llm", AsyncLLM)
STATE_KEY = web.AppKey("server_state", ServerState)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

GUARDED_PREFIX = ("/v1", "/v2", "/inference")  # …/entrypoints/serve/utils/server_utils.py:42@0.26.0
# The routes the call log records (the RL lifecycle on vLLM).
LIFECYCLE_ROUTES = frozenset(
    {
        "/pause", "/resume", "/abort_requests", "/sleep", "/wake_up", "/release_kv_cache_memory",
        "/reset_prefix_cache", "/collective_rpc", "/init_weight_transfer_engine", "/start_weight_update",
        "/update_weights", "/finish_weight_update", "/shutdown_weight_transfer_engine",
        "/update_weight_version", "/weight_checker",
    }
)  # fmt: skip


def llm_of(request: web.Request) -> AsyncLLM:
    return request.app[LLM_KEY]


def _authorized(tokens: list[str], request: web.Request) -> bool:
    """AuthenticationMiddleware (server_utils.py:45-92@0.26.0): sha256-compared bearer tokens."""
    if not tokens or request.method == "OPTIONS" or not request.path.startswith(GUARDED_PREFIX):
        return True
    scheme, _, param = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(param.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(t.encode()).digest()) for t in tokens)


def _log_args(request: web.Request, raw: bytes) -> bytes:
    """What the call log keys a call on: the JSON body, else the query parameters as a JSON object."""
    if raw.strip():
        return raw
    return json.dumps({k: request.query.getall(k) for k in request.query}).encode()


@web.middleware
async def vllm_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    llm = llm_of(request)
    if not request.path.startswith("/_emulator"):
        request.app[STATE_KEY].calls[request.path] += 1
        call_log = request.app.get(CALL_LOG_KEY)
        if call_log is not None and request.path in LIFECYCLE_ROUTES:
            call_log.record(request.path, _log_args(request, await request.read()))
        await llm.cfg.faults.before_route(request.path)
    if not _authorized(llm.cfg.api_keys, request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    try:
        return await handler(request)
    except HTTPError as e:
        return http_error_response(e)
    except ValidationFailed as e:
        return validation_response(e)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)
    except web.HTTPException:
        raise
    except EngineDeadError as e:
        request.app[STATE_KEY].shutdown()  # engine_error_handler: terminate_if_errored
        return exception_response(e)
    except Exception as e:
        log.error("Exception caught on %s: %s: %s", request.path, type(e).__name__, e)
        return exception_response(e)


# --- bodies ----------------------------------------------------------------------------------------


async def raw_json(request: web.Request, detail: str | None = "Invalid JSON format") -> Any:
    """`await raw_request.json()`; a decode error is an HTTPException(400, detail) (`None`: the decode
    error's text after "JSON decode error: ")."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except ValueError as e:
        raise HTTPError(400, detail if detail is not None else f"JSON decode error: {e}") from e


async def embedded(request: web.Request, fields: dict[str, bool]) -> dict[str, Any]:
    """FastAPI `Body(embed=True)` parameters: the JSON object's fields, a required one missing is a
    validation error (400). `fields`: name -> required."""
    raw = await request.read()
    data: Any = {}
    if raw.strip():
        try:
            data = json.loads(raw)
        except ValueError as e:
            raise json_invalid(str(e)) from e
    if not isinstance(data, dict):
        data = {}
    for name, required in fields.items():
        if required and name not in data:
            raise missing_body_field(name)
    return {name: data.get(name) for name in fields}
