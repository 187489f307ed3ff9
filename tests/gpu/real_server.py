"""A real engine's HTTP server launched by a test on loopback: how long it took to answer, its calls."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from agent_procs import Proc, Reply, http

START_TIMEOUT_S = 420


class RealServer(Proc):
    """Ready once READY_PATH answers 200; ENGINE names it in what a test reports."""

    ENGINE = ""
    READY_PATH = ""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.started = time.monotonic()
        super().__init__(name, argv, log, env)
        self.start_seconds: float | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds from launch until READY_PATH answers 200."""
        while self.start_seconds is None:
            if not self.alive():
                raise AssertionError(f"{self.ENGINE} exited {self.returncode()}:\n{self.log_text()[-6000:]}")
            if time.monotonic() - self.started > timeout:
                raise AssertionError(f"{self.ENGINE} not ready within {timeout}s:\n{self.log_text()[-6000:]}")
            try:
                if http("GET", self.url + self.READY_PATH, timeout=2).status == 200:
                    self.start_seconds = time.monotonic() - self.started
            except OSError:
                time.sleep(0.5)
        return self.start_seconds

    def call(self, method: str, path: str, body: Any = None, *, timeout: float = 60) -> Reply:
        return http(method, self.url + path, body, timeout=timeout)
