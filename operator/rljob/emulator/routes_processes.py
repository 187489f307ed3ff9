"""`/_emulator/processes` (not an SGLang route): NVML's per-process list of the emulated GPUs, and the
allocations of other processes (emulator/gpu_processes.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from rljob.emulator.gpu_processes import ProcessTable, nvml_list, parse_entry
from rljob.emulator.http_common import engine_of

View = Callable[[web.Request], Any]  # the request's engine: anything with a `backend`
VIEW_KEY: web.AppKey[View] = web.AppKey("gpu_view")


def _view(request: web.Request) -> Any:
    return request.app[VIEW_KEY](request)


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


def add_routes(app: web.Application, view: View = engine_of) -> None:
    """`view`: how a request finds its engine (the SGLang emulator's by default)."""
    app[VIEW_KEY] = view
    app.router.add_get("/_emulator/processes", get_processes)
    app.router.add_post("/_emulator/processes", set_process)
