"""Lifecycle routes: pause/continue/abort, flush, release/resume, refit, sessions, groups, versions."""

from __future__ import annotations

from aiohttp import web

from rljob.emulator.bodies import (
    AbortBody,
    BeginBody,
    CheckerBody,
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
from rljob.emulator.http_common import bad_request, engine_of, parse_body, reply
from rljob.emulator.memory import REGIONS
from rljob.emulator.versions import VersionProfile
from rljob.emulator.weight_updater import WeightUpdater

UPDATER_KEY = web.AppKey("updater", WeightUpdater)


def _updater(request: web.Request) -> WeightUpdater:
    return request.app[UPDATER_KEY]


async def pause_generation(request: web.Request) -> web.Response:
    body = await parse_body(request, PauseBody)
    await engine_of(request).scheduler.pause(body.mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})


async def continue_generation(request: web.Request) -> web.Response:
    await parse_body(request, ContinueBody)
    await engine_of(request).scheduler.continue_generation()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


async def abort_request(request: web.Request) -> web.Response:
    body = await parse_body(request, AbortBody)
    engine_of(request).scheduler.abort(rid=body.rid, abort_all=body.abort_all)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    try:
        timeout = float(request.query.get("timeout", "0"))
    except ValueError:
        return bad_request("timeout must be a number")
    if timeout < 0:
        return bad_request("timeout must be >= 0")
    status, text = await engine_of(request).flush_cache(timeout)
    return web.Response(status=status, text=text, content_type="text/plain")


def _tags(body: MemoryBody) -> list[str]:
    """null or [] means every region; unknown names are silently ignored (contract §2.3)."""
    if not body.tags:
        return list(REGIONS)
    return [t for t in dict.fromkeys(body.tags) if t in REGIONS]


async def release_memory_occupation(request: web.Request) -> web.Response:
    body = await parse_body(request, MemoryBody)
    engine_of(request).release(_tags(body))
    return web.json_response(None)


async def resume_memory_occupation(request: web.Request) -> web.Response:
    body = await parse_body(request, MemoryBody)
    tags = _tags(body)
    await engine_of(request).resume(tags)
    if "weights" in tags:
        _updater(request).start_new_refit()
    return web.json_response(None)


async def update_weights_from_disk(request: web.Request) -> web.Response:
    body = await parse_body(request, DiskBody)
    return reply(await _updater(request).from_disk(body.model_dump()))


async def update_weights_from_tensor(request: web.Request) -> web.Response:
    body = await parse_body(request, TensorBody)
    if engine_of(request).cfg.dp_size > 1:
        return web.Response(status=500, text="Internal Server Error")  # tokenizer-side assert dp_size == 1
    return reply(await _updater(request).from_tensor(body.model_dump()))


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    body = await parse_body(request, DistributedBody)
    if engine_of(request).cfg.dp_size > 1:
        return web.Response(status=500, text="Internal Server Error")
    return reply(await _updater(request).from_distributed(body.model_dump()))


async def init_weights_update_group(request: web.Request) -> web.Response:
    body = await parse_body(request, InitGroupBody)
    return reply(_updater(request).init_group(body.model_dump()))


async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await parse_body(request, GroupBody)
    return reply(_updater(request).destroy_group(body.model_dump()))


async def begin_weight_update(request: web.Request) -> web.Response:
    await parse_body(request, BeginBody)
    return reply(_updater(request).begin())


async def end_weight_update(request: web.Request) -> web.Response:
    await parse_body(request, EmptyBody)
    return reply(_updater(request).end())


async def update_weight_version(request: web.Request) -> web.Response:
    body = await parse_body(request, WeightVersionBody)
    return reply(_updater(request).update_weight_version(body.model_dump()))


async def weights_checker(request: web.Request) -> web.Response:
    body = await parse_body(request, CheckerBody)
    return reply(_updater(request).weights_checker(body.model_dump()))


def add_routes(app: web.Application, profile: VersionProfile) -> None:
    r = app.router
    r.add_post("/pause_generation", pause_generation)
    r.add_post("/continue_generation", continue_generation)
    r.add_post("/abort_request", abort_request)
    for method in ("GET", "POST"):
        r.add_route(method, "/flush_cache", flush_cache)
        r.add_route(method, "/release_memory_occupation", release_memory_occupation)
        r.add_route(method, "/resume_memory_occupation", resume_memory_occupation)
        r.add_route(method, "/weights_checker", weights_checker)
    r.add_post("/update_weights_from_disk", update_weights_from_disk)
    r.add_post("/update_weights_from_tensor", update_weights_from_tensor)
    r.add_post("/update_weights_from_distributed", update_weights_from_distributed)
    r.add_post("/init_weights_update_group", init_weights_update_group)
    r.add_post("/destroy_weights_update_group", destroy_weights_update_group)
    r.add_post("/update_weight_version", update_weight_version)
    if profile.needs_weight_update_session:
        r.add_post("/begin_weight_update", begin_weight_update)
        r.add_post("/end_weight_update", end_weight_update)
