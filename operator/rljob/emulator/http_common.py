"""Cross-cutting HTTP behaviour of SGLang (C-ROUTE-VALIDATION, C-ROUTE-AUTH in docs/sglang-conformance.md):
400 validation errors in SGLang's shape, auth levels by version, FastAPI-style 404s, per-route call
counters and route faults, and the hang of a call whose scheduler died (C-DEATH-HARD)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from rljob.emulator.call_log import CALL_LOG_KEY
from rljob.emulator.engine import Engine
from rljob.emulator.fatal import SchedulerDied

ENGINE_KEY = web.AppKey("engine", Engine)
B = TypeVar("B", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Every lifecycle endpoint is ADMIN_OPTIONAL (…/entrypoints/http_server.py:863,1128,1232,1264,1286,1374,
# 1386,1577,1590@0.5.15.post1; begin/end: http_server.py:1400-1416@0.5.21).
ADMIN_OPTIONAL = frozenset(
    {
        "/pause_generation",
        "/continue_generation",
        "/abort_request",
        "/flush_cache",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/update_weights_from_disk",
        "/update_weights_from_tensor",
        "/update_weights_from_distributed",
        "/update_weights_from_ipc",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weight_version",
        "/weights_checker",
    }
)
LIFECYCLE_ROUTES = ADMIN_OPTIONAL


def engine_of(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


def bad_request(message: str) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}, status=400
    )


class BodyError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.response = bad_request(message)


async def parse_body(request: web.Request, model: type[B], *, optional: bool = False) -> B:
    """The JSON body validated by `model`. Every body route declares a required body (`obj: Model`,
    `Annotated[Model, Body()]`: …/entrypoints/http_server.py:1103,940@0.5.6, http_server.py:1833@0.5.23),
    so a missing, empty or null body is a validation error: 400 (http_server.py:354-388@0.5.6). `optional`:
    the few that default it (/weights_checker from 0.5.15.post1, http_server.py:1398-1405@0.5.15.post1)."""
    raw = await request.read()
    if optional and (not raw.strip() or raw.strip() == b"null"):
        return model()  # `Annotated[Optional[Model], Body()] = None`
    if not raw.strip():
        raise BodyError("1 validation error: {'type': 'missing', 'loc': ('body',), 'msg': 'Field required'}")
    try:
        data: Any = json.loads(raw)
    except ValueError as e:
        raise BodyError(f"JSON decode error: {e}") from e
    if data is None:
        raise BodyError("1 validation error: {'type': 'missing', 'loc': ('body',), 'msg': 'Field required'}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BodyError("; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from e


def _bearer(request: web.Request) -> str | None:
    auth = request.headers.get("Authorization", "")
    return auth[7:] if auth.startswith("Bearer ") else None


def _authorized(engine: Engine, request: web.Request) -> bool:
    path, cfg = request.path, engine.cfg
    if request.method == "OPTIONS" or path.startswith(("/health", "/metrics", "/_emulator")):
        return True
    if not engine.profile.has_admin_api_key:  # 0.5.6: one key for everything but health/metrics
        return cfg.api_key is None or _bearer(request) == cfg.api_key  # utils/common.py:1189-1200@0.5.6
    if path.startswith("/ready") and engine.profile.ready_is_open:
        return True
    if path in ADMIN_OPTIONAL:
        if cfg.admin_api_key is not None:
            return _bearer(request) == cfg.admin_api_key
        return cfg.api_key is None or _bearer(request) == cfg.api_key
    return cfg.api_key is None or _bearer(request) == cfg.api_key


@web.middleware
async def sglang_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    engine = engine_of(request)
    if not request.path.startswith("/_emulator"):
        engine.calls[request.path] += 1
        call_log = request.app.get(CALL_LOG_KEY)
        if call_log is not None and request.path in LIFECYCLE_ROUTES:
            call_log.record(request.path, await request.read())  # aiohttp keeps the body for the handler
        await engine.faults.before_route(request.path)
    if not _authorized(engine, request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    try:
        return await handler(request)
    except BodyError as e:
        return e.response
    except SchedulerDied:
        await asyncio.Event().wait()  # 0.5.6: nothing will ever answer this call
        raise
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def reply(status_body: tuple[int, dict[str, Any]]) -> web.Response:
    status, body = status_body
    return web.json_response(body, status=status)
