"""Cross-cutting HTTP behaviour of SGLang (contract §2.1, §5): 400 validation errors in SGLang's shape,
auth levels by version, FastAPI-style 404s, per-route call counters and route faults."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from rljob.emulator.engine import Engine

ENGINE_KEY = web.AppKey("engine", Engine)
B = TypeVar("B", bound=BaseModel)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Every lifecycle endpoint is ADMIN_OPTIONAL (contract §5).
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


async def parse_body(request: web.Request, model: type[B]) -> B:
    """JSON body (or {} when empty: inferred, the agent always sends a body) validated by `model`."""
    raw = await request.read()
    try:
        data: Any = json.loads(raw) if raw.strip() else {}
    except ValueError as e:
        raise BodyError(f"JSON decode error: {e}") from e
    if data is None:
        data = {}
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
        return cfg.api_key is None or _bearer(request) == cfg.api_key
    if path.startswith("/ready"):
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
        await engine.faults.before_route(request.path)
    if not _authorized(engine, request):
        return web.json_response({"error": "Unauthorized"}, status=401)
    try:
        return await handler(request)
    except BodyError as e:
        return e.response
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def reply(status_body: tuple[int, dict[str, Any]]) -> web.Response:
    status, body = status_body
    return web.json_response(body, status=status)
