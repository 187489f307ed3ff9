"""vLLM's error replies (V-ROUTE-ERRORS in docs/vllm-conformance.md) and the exceptions that carry them.

- An `HTTPException` a route raises: `{"error": {"message", "type": <HTTP phrase>, "param": null, "code"}}`
  (http_exception_handler, …/entrypoints/serve/utils/server_utils.py:395-409@0.26.0).
- A request validation error: 400, never 422, type "Bad Request", `param` the dotted location
  (validation_exception_handler, server_utils.py:488-531@0.26.0).
- Any other exception: `create_error_response` (…/entrypoints/serve/utils/error_response.py:16-80@0.26.0):
  ValueError / TypeError / OverflowError 400 BadRequestError, NotImplementedError 501, else 500
  InternalServerError. Every message goes through `sanitize_message` (…/entrypoints/serve/utils/
  api_utils.py:312-320@0.26.0).
- An exception inside the engine core during a utility call reaches the server as
  `Exception("Call to {method} method failed: {message}")` (core:1534-1550@0.26.0, cc:757-776@0.26.0).
- Routing 404 / 405 are Starlette's `{"detail": ...}`: vLLM registers its handler for FastAPI's
  HTTPException only (…/entrypoints/openai/api_server.py:287@0.26.0)."""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from aiohttp import web

ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."  # core:2012@0.34.0


class HTTPError(Exception):
    """FastAPI's HTTPException raised by a route."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class ValidationFailed(Exception):
    """FastAPI's RequestValidationError: pydantic error dicts."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors


class UtilityError(Exception):
    """A utility call that raised in the engine core (a 500 through the generic handler)."""

    def __init__(self, method: str, message: str) -> None:
        super().__init__(f"Call to {method} method failed: {message}")


class WorkerError(Exception):
    """An exception on a worker, as the executor's collective_rpc re-raises it (V-TP-REPLY)."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"Worker failed with error '{message}', please check the stack trace above for the root cause"
        )


class EngineDeadError(Exception):
    def __init__(self) -> None:
        super().__init__(ENGINE_DEAD_MESSAGE)


class NotFoundError(Exception):
    """VLLMNotFoundError: 404 NotFoundError (…/entrypoints/serve/engine/serving.py:197@0.26.0)."""


class RetryableRequestError(Exception):
    """V-REQ-PAUSED: a request rejected while a user pause holds (0.34): 503 ServiceUnavailableError."""


def sanitize_message(message: str) -> str:
    message = re.sub(r" at 0x[0-9a-f]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": sanitize_message(message), "type": err_type, "param": param, "code": code}}


def http_error_response(e: HTTPError) -> web.Response:
    return web.json_response(error_body(e.detail, HTTPStatus(e.status).phrase, e.status), status=e.status)


def validation_response(e: ValidationFailed) -> web.Response:
    n = len(e.errors)
    message = f"{n} validation {'error' if n == 1 else 'errors'}:\n" + "".join(
        f"  {err}\n" for err in e.errors
    )
    loc = e.errors[0]["loc"] if e.errors else ()
    param = ".".join(str(p) for p in loc) or None
    return web.json_response(error_body(message.rstrip(), "Bad Request", 400, param), status=400)


def exception_response(exc: BaseException) -> web.Response:
    """create_error_response(exc)."""
    if isinstance(exc, RetryableRequestError):
        kind, status = "ServiceUnavailableError", 503
    elif isinstance(exc, NotFoundError):
        kind, status = "NotFoundError", 404
    elif isinstance(exc, ValueError | TypeError | OverflowError):
        kind, status = "BadRequestError", 400
    elif isinstance(exc, NotImplementedError):
        kind, status = "NotImplementedError", 501
    else:
        kind, status = "InternalServerError", 500
    return web.json_response(error_body(str(exc), kind, status), status=status)


# --- pydantic's error dicts for the parameters the RL routes declare ----------------------------------


def _error(
    kind: str, loc: tuple[str | int, ...], msg: str, value: Any, ctx: dict[str, Any] | None = None
) -> Any:
    err: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx is not None:
        err["ctx"] = ctx
    return err


TRUE = {"1", "on", "t", "true", "y", "yes"}
FALSE = {"0", "off", "f", "false", "n", "no"}


def query_bool(query: Any, name: str, default: bool) -> bool:
    """A `bool` query parameter as pydantic parses it."""
    raw = query.get(name)
    if raw is None:
        return default
    if raw.lower() in TRUE:
        return True
    if raw.lower() in FALSE:
        return False
    msg = "Input should be a valid boolean, unable to interpret input"
    raise ValidationFailed([_error("bool_parsing", ("query", name), msg, raw)])


def query_literal(query: Any, name: str, choices: tuple[str, ...], default: str) -> str:
    raw = query.get(name)
    if raw is None:
        return default
    if raw in choices:
        return str(raw)
    expected = ", ".join(f"'{c}'" for c in choices[:-1]) + f" or '{choices[-1]}'"
    raise ValidationFailed(
        [_error("literal_error", ("query", name), f"Input should be {expected}", raw, {"expected": expected})]
    )


def query_int(query: Any, name: str, default: int, low: int, high: int) -> int:
    """`Annotated[int, Query(ge=low, le=high)]`."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        msg = "Input should be a valid integer, unable to parse string as an integer"
        raise ValidationFailed([_error("int_parsing", ("query", name), msg, raw)]) from None
    if value < low:
        msg = f"Input should be greater than or equal to {low}"
        raise ValidationFailed([_error("greater_than_equal", ("query", name), msg, raw, {"ge": low})])
    if value > high:
        msg = f"Input should be less than or equal to {high}"
        raise ValidationFailed([_error("less_than_equal", ("query", name), msg, raw, {"le": high})])
    return value


def missing_body_field(name: str) -> ValidationFailed:
    return ValidationFailed([_error("missing", ("body", name), "Field required", None)])


def wrong_body_type(name: str, kind: str, msg: str, value: Any) -> ValidationFailed:
    return ValidationFailed([_error(kind, ("body", name), msg, value)])


def json_invalid(error: str) -> ValidationFailed:
    return ValidationFailed([_error("json_invalid", ("body", 0), "JSON decode error", {}, {"error": error})])
