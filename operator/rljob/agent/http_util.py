"""HTTP plumbing shared by both agent listeners: model replies, body and query parsing that names the
offending field, and the middleware that turns refusals into Refusal bodies (and counts them)."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware
from pydantic import BaseModel, TypeAdapter, ValidationError

from rljob.agent.errors import Refused
from rljob.agent.metrics import AgentMetrics
from rljob.api.agent import Refusal
from rljob.api.base import describe_errors

log = logging.getLogger("rljob.agent")
T = TypeVar("T")
E = TypeVar("E", bound=StrEnum)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_WAIT_S = 30.0


def reply(model: BaseModel, status: int = 200) -> web.Response:
    return web.json_response(model.model_dump(mode="json", by_alias=True, exclude_none=True), status=status)


async def read_body(request: web.Request, adapter: TypeAdapter[T]) -> T:
    return parse_body(await request.read(), adapter)


def query_number(request: web.Request, name: str, default: float, *, lo: float, hi: float) -> float:
    """A numeric query parameter; out-of-range values are clamped to [lo, hi] (wait caps at ~30 s)."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as e:
        raise Refused(400, "InvalidQuery", f"{name}: not a number: {raw[:64]!r}") from e
    if value != value:  # NaN
        raise Refused(400, "InvalidQuery", f"{name}: not a number")
    return min(hi, max(lo, value))


def query_enum(request: web.Request, name: str, enum: type[E]) -> E | None:
    """An enum query parameter, None when absent; a value outside `enum` is refused, naming the known ones."""
    raw = request.query.get(name)
    if not raw:
        return None
    try:
        return enum(raw)
    except ValueError:
        known = ", ".join(e.value for e in enum)
        raise Refused(400, "InvalidQuery", f"{name}: one of {known}, not {raw[:64]!r}") from None


def make_error_middleware(metrics: AgentMetrics) -> Middleware:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as e:
            return reply(refusal(e, metrics, f"{request.method} {request.path}"), e.status)

    return errors


def refusal(e: Refused, metrics: AgentMetrics, what: str) -> Refusal:
    """The body of a refusal, counted and logged: an HTTP answer's or a channel reply's."""
    metrics.refusals.labels(e.error).inc()
    log.info("refused %s: %s: %s", what, e.error, e.reason)
    return Refusal(error=e.error[:64], reason=e.reason[:1024], permanent=e.permanent)


def parse_body(raw: str | bytes, adapter: TypeAdapter[T]) -> T:
    """A JSON body (a request's or a channel frame's) as `adapter`'s type; Refused names the field."""
    try:
        data: Any = json.loads(raw) if raw.strip() else None
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, "InvalidJSON", f"body is not JSON: {e}") from e
    if data is None:
        raise Refused(400, "MissingBody", "a JSON object body is required")
    try:
        return adapter.validate_python(data)
    except ValidationError as e:
        raise Refused(422, "InvalidBody", "; ".join(describe_errors(e, "body"))) from e
