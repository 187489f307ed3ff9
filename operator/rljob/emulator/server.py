"""Wiring and entry point: `python -m rljob.emulator [launch_server flags] [emulator flags]`."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from rljob.emulator import (
    fatal,
    nodes,
    openai_routes,
    routes_control,
    routes_debug,
    routes_serving,
)
from rljob.emulator.config import EmulatorConfig, parse_config, startup_error
from rljob.emulator.engine import Engine
from rljob.emulator.http_common import ENGINE_KEY, sglang_middleware
from rljob.emulator.memory import make_backend
from rljob.emulator.serve import serve
from rljob.emulator.weight_updater import WeightUpdater

log = logging.getLogger("sglang.emulator")


def build_app(cfg: EmulatorConfig) -> web.Application:
    """Raises fatal.StartupError where SGLang's scheduler fails to start."""
    error = startup_error(cfg)
    if error is not None:
        raise fatal.StartupError(f"Scheduler hit an exception while starting: {error}")
    backend = make_backend(cfg)
    engine = Engine(cfg, backend)
    backend.drive_busy(engine.gpu_busy_seconds)  # NVML sees the emulated decode on a real GPU
    app = web.Application(middlewares=[sglang_middleware], client_max_size=64 << 20)
    app[ENGINE_KEY] = engine
    if cfg.nnodes > 1:  # node 0 of a multi-node instance: the port opens once every node joined
        engine.nodes = nodes.NodeLink(cfg)
        app.on_startup.append(engine.nodes.start)
        app.on_cleanup.append(engine.nodes.stop)
    app[routes_control.UPDATER_KEY] = WeightUpdater(engine)
    routes_control.add_routes(app, cfg.profile)
    routes_serving.add_routes(app, cfg.profile, enable_metrics=cfg.enable_metrics)
    openai_routes.add_routes(app)
    routes_debug.add_routes(app)
    if cfg.scheduler_kill_after_s > 0:
        app.on_startup.append(_kill_scheduler_later)
    return app


async def _kill_scheduler_later(app: web.Application) -> None:
    engine = app[ENGINE_KEY]
    asyncio.get_running_loop().call_later(
        engine.cfg.scheduler_kill_after_s, engine.kill_scheduler, "killed by --fault-scheduler-kill-after"
    )


def main(argv: list[str] | None = None) -> None:
    ready = "The server is fired up and ready to roll!"
    serve(argv, parse_config, _build_node_app, log=log, starting=_starting, ready=lambda _: ready)


def _starting(cfg: EmulatorConfig) -> str:
    saver = "on" if cfg.enable_memory_saver else "off"
    return (
        f"SGLang emulator {cfg.profile.version} on {cfg.host}:{cfg.port} (memory saver {saver}, "
        f"weight cache {cfg.weight_cache_mode}, {cfg.gpus} GPU(s))"
    )


def _build_node_app(cfg: EmulatorConfig) -> web.Application:
    """Node 0 serves; a follower node of a multi-node instance runs only the dummy health server (C-NODE)."""
    follower = cfg.nnodes > 1 and cfg.node_rank > 0
    return nodes.build_follower_app(cfg) if follower else build_app(cfg)
