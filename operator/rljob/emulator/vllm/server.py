"""Wiring and entry point: `python -m rljob.emulator.vllm --vllm-version V [vllm serve flags] MODEL`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from aiohttp import web

from rljob.emulator import fatal
from rljob.emulator.memory import AccountingBackend, RegionBackend
from rljob.emulator.tensor_refit import set_ipc_stand_in_dir
from rljob.emulator.vllm import routes_debug, routes_dev, routes_rl, routes_serving
from rljob.emulator.vllm.client import AsyncLLM
from rljob.emulator.vllm.config import LaunchConfig, parse_config
from rljob.emulator.vllm.middleware import LLM_KEY, STATE_KEY, ServerState, vllm_middleware

log = logging.getLogger("vllm.emulator")


def make_backend(cfg: LaunchConfig) -> RegionBackend:
    """The cumem pool's regions: numbers only, or real CUDA memory through torch_memory_saver (only
    with --enable-sleep-mode are they in the pool that sleeps)."""
    if cfg.memory_backend == "accounting":
        return AccountingBackend(
            gpus=cfg.gpus, total=cfg.gpu_total_bytes, baseline=cfg.baseline_bytes, sizes=cfg.region_sizes
        )
    from rljob.emulator.gpu_memory import CudaRegionBackend  # imports torch

    return CudaRegionBackend(
        gpus=cfg.gpus,
        sizes=cfg.region_sizes,
        memory_saver=cfg.enable_sleep_mode,
        graph_in_saver=cfg.offload_cudagraph,
        hook_mode=cfg.memory_saver_hook_mode,
    )


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
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        cfg = parse_config(sys.argv[1:] if argv is None else argv)
    except fatal.StartupError as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    log.info(
        "vLLM emulator %s, serving model %s on %s:%d (sleep mode %s, weight transfer %s, TP %d, DP %d)",
        cfg.profile.version,
        cfg.served_model_name,
        cfg.host or "0.0.0.0",
        cfg.port,
        "on" if cfg.enable_sleep_mode else "off",
        cfg.weight_transfer_backend or "off",
        cfg.tp_size,
        cfg.dp_size,
    )
    if cfg.startup_seconds > 0:
        asyncio.run(asyncio.sleep(cfg.startup_seconds))  # model loading: the port is not open yet
    app = build_app(cfg)
    log.info("Starting vLLM API server 0 on http://%s:%d", cfg.host or "0.0.0.0", cfg.port)
    web.run_app(app, host=cfg.host, port=cfg.port, print=None, access_log=None, shutdown_timeout=0.5)
    if app[LLM_KEY].errored:
        raise SystemExit(1)
