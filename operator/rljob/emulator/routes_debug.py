"""`/_emulator/*`: not SGLang. Memory accounting and busy time per GPU (the agent's emulator GPU probe reads
them), runtime fault injection, call counters and the loaded-weights evidence."""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from aiohttp import web

from rljob.emulator.call_log import CALL_LOG_KEY, CallLog
from rljob.emulator.engine import Engine
from rljob.emulator.http_common import LIFECYCLE_ROUTES, engine_of
from rljob.emulator.memory import RegionBackend


class _Named(Protocol):
    @property
    def gpu_name(self) -> str: ...


class GpuView(Protocol):
    """What the GPU probe's routes read: an SGLang `Engine` or the vLLM emulator's `AsyncLLM`."""

    @property
    def backend(self) -> RegionBackend: ...

    @property
    def cfg(self) -> _Named: ...

    def gpu_busy_seconds(self, gpu: int) -> float: ...


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


async def utilization(request: web.Request) -> web.Response:
    return web.json_response(utilization_report(engine_of(request)))


async def weights(request: web.Request) -> web.Response:
    return web.json_response(weights_report(engine_of(request)))


async def stats(request: web.Request) -> web.Response:
    """Totals over the DP ranks, and each rank in `ranks`."""
    eng = engine_of(request)
    tok, ranks = eng.tokenizer, eng.ranks
    calls = dict(eng.calls)
    return web.json_response(
        {
            "version": eng.profile.version,
            "calls": calls,
            "lifecycle_calls": sum(n for route, n in calls.items() if route in LIFECYCLE_ROUTES),
            "offload_tags": sorted(eng.offload_tags),
            "paused": tok.is_pause,
            "pause_mode": tok.pause_mode,
            "scheduler_paused": all(r.scheduler_paused for r in ranks),
            "running": sum(r.num_running() for r in ranks),
            "waiting": sum(r.num_waiting() for r in ranks),
            "in_flight": tok.in_flight,
            "idle": all(r.is_idle() for r in ranks),
            "fully_idle": all(r.is_fully_idle() for r in ranks),
            "scheduler_dead": eng.scheduler_dead,
            "ranks": [
                {
                    "dp_rank": r.dp_rank,
                    "running": r.num_running(),
                    "waiting": r.num_waiting(),
                    "scheduler_paused": r.scheduler_paused,
                    "blocked": r.blocked,
                    "idle": r.is_idle(),
                }
                for r in ranks
            ],
            "status": eng.status,
            "weights": weights_report(eng),
            "memory": memory_report(eng),
        }
    )


async def kill_scheduler(request: web.Request) -> web.Response:
    """The scheduler process dies without a Python exception (SIGKILL, OOM-kill): C-DEATH-HARD. With a
    watchdog (≥0.5.10) the server exits and this call gets no answer; on 0.5.6 it answers 200 and the
    server stays up with a dead scheduler."""
    engine_of(request).kill_scheduler("killed through /_emulator/kill_scheduler")
    return web.json_response({"scheduler_dead": True})


async def calls(request: web.Request) -> web.Response:
    """The lifecycle calls received, per route and per (route, arguments), and the repeated
    non-idempotent ones (emulator/call_log.py); `pid` and `bootId` identify this server process."""
    return web.json_response(request.app[CALL_LOG_KEY].report())


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
    app[CALL_LOG_KEY] = CallLog()
    r = app.router
    r.add_get("/_emulator/calls", calls)
    r.add_get("/_emulator/memory", memory)
    r.add_get("/_emulator/utilization", utilization)
    r.add_get("/_emulator/weights", weights)
    r.add_get("/_emulator/stats", stats)
    r.add_get("/_emulator/faults", get_faults)
    r.add_post("/_emulator/faults", set_faults)
    r.add_post("/_emulator/kill_scheduler", kill_scheduler)
