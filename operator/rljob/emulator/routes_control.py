"""Lifecycle routes: pause/continue/abort, flush, release/resume, refit, sessions, groups, versions. Row IDs
are those of docs/sglang-conformance.md. Every route that needs a scheduler reply goes through
`Engine.control` (the route's communicator, then every DP rank's inbox)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

from aiohttp import web

from rljob.emulator.bodies import (
    AbortBody,
    BeginBody,
    CheckerBody,
    CheckerBody056,
    ContinueBody,
    DiskBody,
    DistributedBody,
    EmptyBody,
    GroupBody,
    InitGroupBody,
    MemoryBody,
    PauseBody,
    TensorBody,
    WeightVersionBody,
)
from rljob.emulator.engine import Engine
from rljob.emulator.http_common import bad_request, engine_of, parse_body, reply
from rljob.emulator.versions import VersionProfile
from rljob.emulator.weight_updater import WeightUpdater

UPDATER_KEY = web.AppKey("updater", WeightUpdater)


def _updater(request: web.Request) -> WeightUpdater:
    return request.app[UPDATER_KEY]


def _dp_refused(eng: Engine) -> web.Response | None:
    """C-REFIT-DP: the tokenizer asserts before sending; the AssertionError escapes the handler (500)."""
    cfg = eng.cfg
    if cfg.dp_size == 1:
        return None
    if cfg.enable_dp_attention and eng.profile.dp_refit_allowed_with_dp_attention:
        return None
    return web.Response(status=500, text="Internal Server Error")


async def pause_generation(request: web.Request) -> web.Response:
    body = await parse_body(request, PauseBody)
    await engine_of(request).pause(body.mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await parse_body(request, ContinueBody)
    await engine_of(request).continue_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    body = await parse_body(request, AbortBody)
    engine_of(request).abort(rid=body.rid, abort_all=body.abort_all)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    eng = engine_of(request)
    timeout = 0.0
    if eng.profile.flush_cache_takes_timeout:  # 0.5.6 declares no parameter: FastAPI ignores it
        try:
            timeout = float(request.query.get("timeout", "0"))
        except ValueError:
            return bad_request("timeout: Input should be a valid number")
        if timeout < 0:
            return bad_request("timeout: Input should be greater than or equal to 0")
    status, text = await eng.flush_cache(timeout)
    return web.Response(status=status, text=text, content_type="text/plain")


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await parse_body(request, MemoryBody)
    await engine_of(request).release(body.tags)
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await parse_body(request, MemoryBody)
    await engine_of(request).resume(body.tags)
    if not body.tags or "weights" in body.tags:
        _updater(request).start_new_refit()
    return web.json_response(None)


def _is_base64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _merge_dp(eng: Engine, status_body: tuple[int, dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    """A disk refit with dp_size > 1: one reply per rank, messages joined with " | ", a list of
    num_paused_requests (…/managers/tokenizer_manager.py:1332-1344@0.5.6)."""
    status, body = status_body
    n = eng.cfg.dp_size
    if n > 1:
        body = {**body, "message": " | ".join([body["message"]] * n)}
        if "num_paused_requests" in body:
            body["num_paused_requests"] = [body["num_paused_requests"]] * n
    return status, body


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await parse_body(request, DiskBody)
    eng = engine_of(request)
    async with eng.control("update_weights_from_disk"):
        status, content = await _updater(request).from_disk(body.model_dump())
    # 200 and 400 alike carry num_paused_requests (…/entrypoints/http_server.py:756-777@0.5.6,
    # http_server.py:1309-1326@0.5.23)
    content.setdefault("num_paused_requests", 0)
    return reply(_merge_dp(eng, (status, content)))


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    body = await parse_body(request, TensorBody)
    eng = engine_of(request)
    if not eng.profile.tensor_bad_base64_is_fatal and not all(
        _is_base64(s) for s in body.serialized_named_tensors
    ):
        # C-REFIT-TENSOR-B64: `Base64Bytes` decodes the field while the body is validated
        return bad_request("serialized_named_tensors: Value error, Expected base64-encoded bytes")
    refused = _dp_refused(eng)
    if refused is not None:
        return refused
    async with eng.control("update_weights_from_tensor"):
        result = await _updater(request).from_tensor(body.model_dump())
    return reply(result)


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await parse_body(request, DistributedBody)
    eng = engine_of(request)
    refused = _dp_refused(eng)
    if refused is not None:
        return refused
    async with eng.control("update_weights_from_distributed"):
        result = await _updater(request).from_distributed(body.model_dump())
    return reply(result)


async def init_weights_update_group(request: web.Request) -> web.Response:
    """C-REFIT-GROUP-BLOCK: answers once the group formed; the schedulers are stuck meanwhile."""
    body = await parse_body(request, InitGroupBody)
    eng = engine_of(request)
    refused = _dp_refused(eng)
    if refused is not None:
        return refused
    async with eng.control("init_weights_update_group", block=True):
        result = await _updater(request).init_group(body.model_dump())
    return reply(result)


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await parse_body(request, GroupBody)
    eng = engine_of(request)
    refused = _dp_refused(eng)
    if refused is not None:
        return refused
    async with eng.control("destroy_weights_update_group"):
        result = _updater(request).destroy_group(body.model_dump())
    return reply(result)


async def begin_weight_update(request: web.Request) -> web.Response:
    await parse_body(request, BeginBody)
    async with engine_of(request).control("begin_weight_update"):
        result = _updater(request).begin()
    return reply(result)


async def end_weight_update(request: web.Request) -> web.Response:
    await parse_body(request, EmptyBody)
    async with engine_of(request).control("end_weight_update"):
        result = _updater(request).end()
    return reply(result)


async def update_weight_version(request: web.Request) -> web.Response:
    """C-ROUTE-WV-SET: sets the served version; from 0.5.20 the scheduler records it first."""
    body = await parse_body(request, WeightVersionBody)
    eng = engine_of(request)
    if eng.profile.update_weight_version_reaches_scheduler:
        async with eng.control("update_weight_version"):
            result = _updater(request).update_weight_version(body.model_dump())
    else:
        result = _updater(request).update_weight_version(body.model_dump())
    return reply(result)


async def weights_checker(request: web.Request) -> web.Response:
    eng = engine_of(request)
    if eng.profile.checker_get_and_default_action:
        body: CheckerBody | CheckerBody056 = await parse_body(request, CheckerBody, optional=True)
    else:
        body = await parse_body(request, CheckerBody056)
    async with eng.control("weights_checker"):
        result = _updater(request).weights_checker(body.model_dump())
    return reply(result)


def add_routes(app: web.Application, profile: VersionProfile) -> None:
    r = app.router
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", flush_cache)
        r.add_route(method, "/release_memory_occupation", release_memory_occupation)
        r.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
    # C-ROUTE-CHECKER: POST only on 0.5.6 (http_server.py:961@0.5.6), GET|POST later
    r.add_post("/weights_checker", weights_checker)
    if profile.checker_get_and_default_action:
        r.add_get("/weights_checker", weights_checker)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/update_weight_version", update_weight_version)
    if profile.needs_weight_update_session:
        r.add_post("/begin_weight_update", begin_weight_update)
        r.add_post("/end_weight_update", end_weight_update)
