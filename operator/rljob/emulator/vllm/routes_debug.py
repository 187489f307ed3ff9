"""`/_emulator/*`: not vLLM. The GPU probe's memory, per-process and busy-time routes (the SGLang
emulator's own, so `rljob.emulator.probe:EmulatorProbe` reads either), state for tests, runtime faults, the
call log, and a hard death of the engine core (V-DEATH-HARD)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from rljob.emulator import routes_processes
from rljob.emulator.call_log import CALL_LOG_KEY, CallLog
from rljob.emulator.routes_debug import memory_report, utilization_report
from rljob.emulator.vllm.client import AsyncLLM
from rljob.emulator.vllm.middleware import LIFECYCLE_ROUTES, STATE_KEY, llm_of


def weights_report(llm: AsyncLLM) -> dict[str, Any]:
    """DP engine 0's weights, and whether what it would serve now is garbage."""
    core = llm.cores[0]
    w = core.worker.weights
    return {
        "source": w.source,
        "path": w.path,
        "checksum": w.checksum,
        "valid": w.valid,
        "tensors": w.tensors,
        "serves_garbage": core.worker.serves_garbage,
        "weight_version": core.weight_version,
    }


async def memory(request: web.Request) -> web.Response:
    return web.json_response(memory_report(llm_of(request)))


async def utilization(request: web.Request) -> web.Response:
    return web.json_response(utilization_report(llm_of(request)))


async def weights(request: web.Request) -> web.Response:
    return web.json_response(weights_report(llm_of(request)))


async def stats(request: web.Request) -> web.Response:
    llm = llm_of(request)
    calls = dict(request.app[STATE_KEY].calls)
    cores = [c.snapshot() for c in llm.cores]
    return web.json_response(
        {
            "version": llm.profile.version,
            "calls": calls,
            "lifecycle_calls": sum(n for route, n in calls.items() if route in LIFECYCLE_ROUTES),
            "errored": llm.errored,
            "running": sum(c["running"] for c in cores),
            "waiting": sum(c["waiting"] for c in cores),
            "in_flight": len(llm.tracked),
            "engines": cores,
            "weights": weights_report(llm),
            "memory": memory_report(llm),
        }
    )


async def kill_engine_core(request: web.Request) -> web.Response:
    """The engine core process dies without a Python exception (OOM-kill, a CUDA abort): the process
    monitor marks the engine dead and V-DEATH-EXC follows."""
    llm_of(request).cores[0].die("engine core process died (killed through /_emulator/kill_engine_core)")
    return web.json_response({"dead": True})


async def calls(request: web.Request) -> web.Response:
    return web.json_response(request.app[CALL_LOG_KEY].report())


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(llm_of(request).cfg.faults.as_dict())


async def set_faults(request: web.Request) -> web.Response:
    faults = llm_of(request).cfg.faults
    try:
        faults.update(json.loads(await request.read() or b"{}"))
    except (ValueError, TypeError) as e:
        return web.json_response({"error": str(e)}, status=400)
    return web.json_response(faults.as_dict())


def add_routes(app: web.Application) -> None:
    app[CALL_LOG_KEY] = CallLog()
    r = app.router
    r.add_get("/_emulator/calls", calls)
    r.add_get("/_emulator/memory", memory)
    r.add_get("/_emulator/utilization", utilization)
    r.add_get("/_emulator/weights", weights)
    r.add_get("/_emulator/stats", stats)
    r.add_get("/_emulator/faults", get_faults)
    r.add_post("/_emulator/faults", set_faults)
    r.add_post("/_emulator/kill_engine_core", kill_engine_core)
    routes_processes.add_routes(app, llm_of)  # NVML's per-process view, other processes' memory
