"""Serving, info, load and health routes, by version (contract §1, §2.5, §4)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from rljob.emulator import metrics_text
from rljob.emulator.bodies import GenerateBody
from rljob.emulator.engine import Engine
from rljob.emulator.generation import GenerateError, generate
from rljob.emulator.http_common import bad_request, engine_of, parse_body
from rljob.emulator.versions import VersionProfile

LOAD_INCLUDES = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


async def generate_route(request: web.Request) -> web.Response:
    body = await parse_body(request, GenerateBody)
    if body.stream:
        return bad_request("stream=true is not emulated")
    try:
        return web.json_response(await generate(engine_of(request), body))
    except GenerateError as e:
        return bad_request(str(e))


async def health(request: web.Request) -> web.Response:
    status = await engine_of(request).health_generate()
    return web.Response(status=status)


async def ping(request: web.Request) -> web.Response:
    return web.Response(status=200 if engine_of(request).status == "Up" else 503)


async def ready(request: web.Request) -> web.Response:
    eng = engine_of(request)
    ok = eng.status == "Up" and not eng.scheduler.is_pause
    return web.Response(status=200 if ok else 503)


def _model_info(eng: Engine) -> dict[str, Any]:
    return {
        "model_path": eng.model_path,
        "served_model_name": eng.served_model_name,
        "tokenizer_path": eng.cfg.server_args["tokenizer_path"],
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": eng.weight_version,
        "load_format": eng.cfg.server_args["load_format"],
        "model_type": "emulated",
        "architectures": ["EmulatedForCausalLM"],
    }


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_model_info(engine_of(request)))


async def server_info(request: web.Request) -> web.Response:
    eng = engine_of(request)
    info = dict(eng.cfg.server_args)
    info.update(
        version=eng.profile.version,
        launch_command=eng.cfg.launch_command,
        max_total_num_tokens=eng.cfg.max_total_tokens,
        startup_time=eng.startup_time,
        internal_states=[{"last_gen_throughput": eng.scheduler.gen_throughput()}],
    )
    return web.json_response(info)


def _load(eng: Engine) -> dict[str, Any]:
    s, cfg = eng.scheduler, eng.cfg
    used = s.num_used_tokens()
    return {
        "dp_rank": 0,
        "num_running_reqs": s.num_running(),
        "num_waiting_reqs": s.num_waiting(),
        "num_waiting_uncached_tokens": 0,
        "num_used_tokens": used,
        "num_total_tokens": cfg.max_total_tokens,
        "num_active_tokens": used,
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_running_requests": cfg.max_running_requests,
        "token_usage": used / cfg.max_total_tokens,
        "gen_throughput": s.gen_throughput(),
        "cache_hit_rate": s.cache_hit_rate(),
        "utilization": s.utilization(),
        "timestamp": time.time(),
    }


async def v1_loads(request: web.Request) -> web.Response:
    eng = engine_of(request)
    include = [x for x in request.query.get("include", "core").split(",") if x]
    bad = [x for x in include if x not in LOAD_INCLUDES]
    if bad:
        return bad_request(f"invalid include: {', '.join(bad)}")
    load = _load(eng)
    if request.query.get("format") == "prometheus":
        text = "".join(
            f'sglang_{k}{{dp_rank="0"}} {float(v)}\n'
            for k, v in load.items()
            if k not in ("dp_rank", "timestamp")
        )
        return web.Response(text=text, content_type="text/plain")
    return web.json_response(
        {
            "timestamp": time.time(),
            "version": eng.profile.version,
            "accelerator": "emulated",
            "num_accelerators": eng.cfg.gpus,
            "loads": [load],
        }
    )


async def get_load(request: web.Request) -> web.Response:
    eng = engine_of(request)
    s = eng.scheduler
    item: dict[str, Any] = {
        "dp_rank": 0,
        "num_reqs": s.num_running() + s.num_waiting(),
        "num_waiting_reqs": s.num_waiting(),
        "num_tokens": s.num_used_tokens(),
    }
    if eng.profile.get_load == "shim":
        item.update(num_pending_tokens=0, ts_tic=time.time())
    return web.json_response([item])


async def get_weight_version(request: web.Request) -> web.Response:
    eng = engine_of(request)
    if eng.profile.get_weight_version == "deprecated":
        return web.json_response(
            {"detail": "/get_weight_version is deprecated and removed; use /model_info (weight_version)."},
            status=404,
        )
    return web.json_response({"weight_version": eng.weight_version})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=metrics_text.render(engine_of(request)), content_type="text/plain")


def add_routes(app: web.Application, profile: VersionProfile, *, enable_metrics: bool) -> None:
    r = app.router
    r.add_post("/generate", generate_route)
    for path in ("/health", "/health_generate"):
        r.add_get(path, health)
    r.add_get("/ping", ping)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    if profile.has_ready:
        r.add_get("/ready", ready)
    if profile.has_v1_loads:
        r.add_get("/v1/loads", v1_loads)
    if profile.get_load != "removed":
        r.add_get("/get_load", get_load)
    if profile.get_weight_version != "removed":
        for path in ("/get_weight_version", "/weight_version"):
            r.add_get(path, get_weight_version)
    if enable_metrics:
        r.add_get("/metrics", metrics)
