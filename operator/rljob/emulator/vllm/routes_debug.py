"""`/_emulator/*`: not vLLM. Beside the routes every engine's emulator serves (routes_emulator.py: the GPU
probe's memory, per-process and busy-time views, so `rljob.emulator.probe:EmulatorProbe` reads either
emulator, the call log, runtime faults), the loaded weights, state for tests, and a hard death of the
engine core (V-DEATH-HARD)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from aiohttp import web

from rljob.emulator import routes_emulator
from rljob.emulator.routes_emulator import memory_report
from rljob.emulator.vllm.client import AsyncLLM
from rljob.emulator.vllm.middleware import LIFECYCLE_ROUTES, STATE_KEY, llm_of


def weights_report(llm: AsyncLLM) -> dict[str, Any]:
    """DP engine 0's weights, and whether what it would serve now is garbage."""
    core = llm.cores[0]
    worker = core.worker
    return {
        **asdict(worker.weights),
        "serves_garbage": worker.serves_garbage,
        "weight_version": core.weight_version,
    }


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


def add_routes(app: web.Application) -> None:
    routes_emulator.add_routes(app, llm_of, weights=weights, stats=stats)
    app.router.add_post("/_emulator/kill_engine_core", kill_engine_core)
