"""`/_emulator/*` of the SGLang emulator beside the shared ones (routes_emulator.py): the loaded-weights
evidence, the engine's state for tests, and a hard death of the scheduler."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from aiohttp import web

from rljob.emulator import routes_emulator
from rljob.emulator.engine import Engine
from rljob.emulator.http_common import LIFECYCLE_ROUTES, engine_of
from rljob.emulator.routes_emulator import memory_report


def weights_report(eng: Engine) -> dict[str, Any]:
    return {**asdict(eng.weights), "weight_version": eng.weight_version}


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


def add_routes(app: web.Application) -> None:
    routes_emulator.add_routes(app, engine_of, weights=weights, stats=stats)
    app.router.add_post("/_emulator/kill_scheduler", kill_scheduler)
