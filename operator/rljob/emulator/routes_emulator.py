"""`/_emulator/*` routes of every engine's emulator (none is an engine's route): the GPU probe's memory and
busy time per GPU, NVML's per-process list and other processes' allocations (emulator/gpu_processes.py),
the call log and the runtime faults. Each engine adds its own weights, stats and death routes."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from rljob.emulator.call_log import CALL_LOG_KEY, CallLog
from rljob.emulator.faults import Faults
from rljob.emulator.gpu_processes import ProcessTable, nvml_list, parse_entry
from rljob.emulator.memory import RegionBackend


class _Launch(Protocol):
    @property
    def gpu_name(self) -> str: ...

    @property
    def faults(self) -> Faults: ...


class GpuView(Protocol):
    """What these routes read of an engine: an SGLang `Engine` or the vLLM emulator's `AsyncLLM`."""

    @property
    def backend(self) -> RegionBackend: ...

    @property
    def cfg(self) -> _Launch: ...

    def gpu_busy_seconds(self, gpu: int) -> float: ...


View = Callable[[web.Request], GpuView]  # how a request finds its engine
Handler = Callable[[web.Request], Awaitable[web.Response]]
VIEW_KEY: web.AppKey[View] = web.AppKey("gpu_view")


def _view(request: web.Request) -> GpuView:
    return request.app[VIEW_KEY](request)


def memory_report(eng: GpuView) -> dict[str, Any]:
    b = eng.backend
    return {
        "gpus": [
            {
                "index": g,
                "name": eng.cfg.gpu_name,
                "used_bytes": b.used_bytes(g),
                "total_bytes": b.total_bytes(g),
                "regions": b.region_bytes(g),
            }
            for g in range(b.gpus)
        ]
    }


def utilization_report(eng: GpuView) -> dict[str, Any]:
    """Cumulative busy seconds per GPU and the clock they are read on (the probe turns two reads into a
    busy fraction, as NVML's utilization samples are turned into one)."""
    return {
        "monotonic": time.monotonic(),
        "gpus": [{"index": g, "busy_seconds": eng.gpu_busy_seconds(g)} for g in range(eng.backend.gpus)],
    }


async def memory(request: web.Request) -> web.Response:
    return web.json_response(memory_report(_view(request)))


async def utilization(request: web.Request) -> web.Response:
    return web.json_response(utilization_report(_view(request)))


async def calls(request: web.Request) -> web.Response:
    """The lifecycle calls received, per route and per (route, arguments), and the repeated
    non-idempotent ones (emulator/call_log.py); `pid` and `bootId` identify this server process."""
    return web.json_response(request.app[CALL_LOG_KEY].report())


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(_view(request).cfg.faults.as_dict())


async def set_faults(request: web.Request) -> web.Response:
    return await update_faults(request, _view(request).cfg.faults)


async def update_faults(request: web.Request, faults: Faults) -> web.Response:
    """Applies the request's JSON object to `faults`; 400 (nothing changed) for an unknown fault."""
    try:
        faults.update(json.loads(await request.read() or b"{}"))
    except (ValueError, TypeError) as e:
        return web.json_response({"error": str(e)}, status=400)
    return web.json_response(faults.as_dict())


async def get_processes(request: web.Request) -> web.Response:
    return web.json_response({"gpus": nvml_list(_view(request))})


async def set_process(request: web.Request) -> web.Response:
    """A process allocates (or frees) GPU memory. More than is free is its own CUDA OOM: 409, nothing held."""
    b = _view(request).backend
    others: ProcessTable | None = getattr(b, "others", None)
    if others is None:
        return web.json_response({"error": "a GPU backend: other processes' memory is real"}, status=409)
    try:
        entry = parse_entry(json.loads(await request.read() or b"{}"), b.gpus)
    except (ValueError, TypeError, KeyError) as e:
        return web.json_response({"error": str(e)}, status=400)
    old = others.held.get(entry.pid)
    for g in range(b.gpus):
        grows = entry.per_gpu[g] - (old.per_gpu[g] if old is not None else 0)
        if grows > b.total_bytes(g) - b.used_bytes(g):
            free = b.total_bytes(g) - b.used_bytes(g)
            error = f"CUDA out of memory: tried to allocate {grows} bytes on GPU {g}, {free} free"
            return web.json_response({"error": error}, status=409)
    others.set(entry)
    return web.json_response({"gpus": nvml_list(_view(request))})


def add_routes(app: web.Application, view: View, *, weights: Handler, stats: Handler) -> None:
    """`view`: how a request finds its engine; `weights`, `stats`: the engine's handlers of those routes."""
    app[CALL_LOG_KEY] = CallLog()
    app[VIEW_KEY] = view
    app.add_routes(
        [
            web.get("/_emulator/calls", calls),
            web.get("/_emulator/memory", memory),
            web.get("/_emulator/utilization", utilization),
            web.get("/_emulator/weights", weights),
            web.get("/_emulator/stats", stats),
            web.get("/_emulator/faults", get_faults),
            web.post("/_emulator/faults", set_faults),
            web.get("/_emulator/processes", get_processes),
            web.post("/_emulator/processes", set_process),
        ]
    )
