"""The emulator's process, whichever engine it answers as: parse the launch (a refused one exits 1), wait
the startup delay with the port closed, build the engine's app, open the port and stop quickly on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from typing import Protocol, TypeVar

from aiohttp import web

from rljob.emulator.fatal import StartupError


class Served(Protocol):
    @property
    def host(self) -> str | None: ...  # None: every interface

    @property
    def port(self) -> int: ...

    @property
    def startup_seconds(self) -> float: ...


C = TypeVar("C", bound=Served)


def serve(
    argv: list[str] | None,
    parse: Callable[[list[str]], C],
    build: Callable[[C], web.Application],
    *,
    log: logging.Logger,
    starting: Callable[[C], str],
    ready: Callable[[C], str],
) -> web.Application:
    """Runs until the server stops and returns its app; `starting` and `ready` are the engine's log lines
    before the startup delay and once the app is built. A StartupError exits 1 with its message."""
    logging.basicConfig(
        level=logging.INFO, format="[%(asctime)s] %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
        log.info("%s", starting(cfg))
        if cfg.startup_seconds > 0:
            asyncio.run(asyncio.sleep(cfg.startup_seconds))  # model loading: the port is not open yet
        app = build(cfg)
        log.info("%s", ready(cfg))
        # SIGTERM: hung handlers (faults) must not hold the exit for aiohttp's default 60 s.
        web.run_app(app, host=cfg.host, port=cfg.port, print=None, access_log=None, shutdown_timeout=0.5)
    except StartupError as e:  # also raised inside run_app: the nodes of a multi-node instance did not meet
        log.error("%s", e)
        raise SystemExit(1) from None
    return app
