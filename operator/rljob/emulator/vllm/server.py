"""Wiring and entry point: `python -m rljob.emulator.vllm --vllm-version V [vllm serve flags] MODEL`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from aiohttp import web

from rljob.emulator.memory import make_backend
from rljob.emulator.serve import serve
from rljob.emulator.tensor_refit import set_ipc_stand_in_dir
from rljob.emulator.vllm import routes_debug, routes_dev, routes_rl, routes_serving
from rljob.emulator.vllm.client import AsyncLLM
from rljob.emulator.vllm.config import LaunchConfig, parse_config
from rljob.emulator.vllm.middleware import LLM_KEY, STATE_KEY, ServerState, vllm_middleware

log = logging.getLogger("vllm.emulator")


def _exit_now() -> None:
    """The API server stops once the engine is dead (launcher.py:156-176@0.26.0)."""
    log.error("Engine core is dead; the API server shuts down.")
    for h in logging.getLogger().handlers:
        h.flush()
    os.kill(os.getpid(), signal.SIGTERM)


def build_app(cfg: LaunchConfig) -> web.Application:
    set_ipc_stand_in_dir(cfg.ipc_stand_in_dir)
    backend = make_backend(cfg)
    llm = AsyncLLM(cfg, backend)
    backend.drive_busy(llm.gpu_busy_seconds)

    def shutdown() -> None:
        """terminate_if_errored: a request that met the dead engine stops the server after its reply."""
        if llm.errored and not cfg.keep_alive_on_engine_death:
            asyncio.get_running_loop().call_later(0.05, _exit_now)

    app = web.Application(middlewares=[vllm_middleware], client_max_size=64 << 20)
    app[LLM_KEY] = llm
    app[STATE_KEY] = ServerState(shutdown=shutdown)
    routes_serving.add_routes(app)
    if cfg.dev_mode:
        log.warning(
            "SECURITY WARNING: Development endpoints are enabled! This should NOT be used in production!"
        )
        routes_rl.add_routes(app)
        routes_dev.add_routes(app)
    routes_debug.add_routes(app)
    app.on_startup.append(_start)
    app.on_cleanup.append(_stop)
    return app


async def _start(app: web.Application) -> None:
    llm = app[LLM_KEY]
    llm.start()
    app[STATE_KEY].watchdog = asyncio.ensure_future(_watchdog(llm))


async def _stop(app: web.Application) -> None:
    """An app stopped inside a process that goes on (several emulated pods in one): nothing keeps running."""
    watchdog = app[STATE_KEY].watchdog
    if watchdog is not None:
        watchdog.cancel()
    app[LLM_KEY].stop()


async def _watchdog(llm: AsyncLLM) -> None:
    """watchdog_loop: every VLLM_WATCHDOG_TIME_S, stop the server if the engine died."""
    while True:
        await asyncio.sleep(llm.cfg.watchdog_seconds)
        if llm.errored and not llm.cfg.keep_alive_on_engine_death:
            _exit_now()
            return


def main(argv: list[str] | None = None) -> None:
    app = serve(argv, parse_config, build_app, log=log, starting=_starting, ready=_ready)
    if app[LLM_KEY].errored:
        raise SystemExit(1)


def _starting(cfg: LaunchConfig) -> str:
    return (
        f"vLLM emulator {cfg.profile.version}, serving model {cfg.served_model_name} on "
        f"{cfg.host or '0.0.0.0'}:{cfg.port} (sleep mode {'on' if cfg.enable_sleep_mode else 'off'}, "
        f"weight transfer {cfg.weight_transfer_backend or 'off'}, TP {cfg.tp_size}, DP {cfg.dp_size})"
    )


def _ready(cfg: LaunchConfig) -> str:
    return f"Starting vLLM API server 0 on http://{cfg.host or '0.0.0.0'}:{cfg.port}"
