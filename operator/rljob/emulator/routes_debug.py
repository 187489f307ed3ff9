"""`/_emulator/*`: not SGLang. Memory accounting per GPU (the agent's emulator GPU probe reads it),
runtime fault injection, call counters and the loaded-weights evidence."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rljob.emulator.engine import Engine
from rljob.emulator.http_common import LIFECYCLE_ROUTES, engine_of


def memory_report(eng: Engine) -> dict[str, Any]:
    b = eng.backend
    return {
        "gpus": [
            {
                "index": g,
                "used_bytes": b.used_bytes(g),
                "total_bytes": b.total_bytes(g),
                "regions": b.region_bytes(g),
            }
            for g in range(b.gpus)
        ]
    }


def weights_report(eng: Engine) -> dict[str, Any]:
    w = eng.weights
    return {
        "source": w.source,
        "path": w.path,
        "checksum": w.checksum,
        "valid": w.valid,
        "tensors": w.tensors,
        "weight_version": eng.weight_version,
    }


async def memory(request: web.Request) -> web.Response:
    return web.json_response(memory_report(engine_of(request)))


async def weights(request: web.Request) -> web.Response:
    return web.json_response(weights_report(engine_of(request)))


async def stats(request: web.Request) -> web.Response:
    eng = engine_of(request)
    s = eng.scheduler
    calls = dict(eng.calls)
    return web.json_response(
        {
            "version": eng.profile.version,
            "calls": calls,
            "lifecycle_calls": sum(n for route, n in calls.items() if route in LIFECYCLE_ROUTES),
            "offload_tags": sorted(eng.offload_tags),
            "paused": s.is_pause,
            "pause_mode": s.pause_mode,
            "scheduler_paused": s.scheduler_paused,
            "running": s.num_running(),
            "waiting": s.num_waiting(),
            "in_flight": s.in_flight,
            "idle": s.is_idle(),
            "status": eng.status,
            "weights": weights_report(eng),
            "memory": memory_report(eng),
        }
    )


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(engine_of(request).faults.as_dict())


async def set_faults(request: web.Request) -> web.Response:
    eng = engine_of(request)
    try:
        eng.faults.update(json.loads(await request.read() or b"{}"))
    except (ValueError, TypeError) as e:
        return web.json_response({"error": str(e)}, status=400)
    return web.json_response(eng.faults.as_dict())


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/_emulator/memory", memory)
    r.add_get("/_emulator/weights", weights)
    r.add_get("/_emulator/stats", stats)
    r.add_get("/_emulator/faults", get_faults)
    r.add_post("/_emulator/faults", set_faults)
