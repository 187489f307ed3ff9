"""Real SGLang for the GPU tier: `python -m sglang.launch_server` on a model rljob.testing.tiny_model builds,
with the flags docs/real-sglang.md explains; whether it can run here; a process handle shaped like the
emulator's (url, call, alive, log_text) so the agent and the differential runner drive either."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import time
from pathlib import Path
from typing import Any

from agent_procs import PY, Proc, Reply, free_port, http

VERSION = "0.5.15.post1"
# docs/real-sglang.md says why each: memory saver on (release/resume), no FlashAttention-3, flashinfer
# sampling or grammar backend, no prefill CUDA graph (most of the start), small decode graphs.
LAUNCH_FLAGS = (
    "--enable-memory-saver",
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--grammar-backend", "none",
    "--mem-fraction-static", "0.5",
    "--cuda-graph-max-bs-decode", "8",
    "--cuda-graph-backend-prefill", "disabled",
    "--dtype", "bfloat16",
    "--enable-metrics",
    "--weight-version", "0",
)  # fmt: skip
START_TIMEOUT_S = 420


@functools.cache
def sglang_missing() -> str | None:
    """Why real SGLang cannot run here, or None (checked without importing it: its import takes ~18 s)."""
    if importlib.util.find_spec("sglang") is None:
        return "sglang is not installed (docs/real-sglang.md says how)"
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "sglang has no package metadata (unpack it with its .dist-info)"
    if version != VERSION:
        return f"sglang {version} is installed; this tier is written against {VERSION}"
    return None


class RealSGLang(Proc):
    def __init__(self, tmp: Path, model_dir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        while self.port > 50000:  # SGLang derives its gRPC port as this + 10000: it must be < 65536
            self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = VERSION
        argv = [PY, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), *(flags or LAUNCH_FLAGS)]  # fmt: skip
        self.started = time.monotonic()
        super().__init__("sglang", argv, tmp / f"sglang-{self.port}.log", env)
        self.start_seconds: float | None = None

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> float:
        """Seconds from launch until /model_info answers 200 (the warmup generate has run by then)."""
        while self.start_seconds is None:
            if not self.alive():
                raise AssertionError(f"SGLang exited {self.returncode()}:\n{self.log_text()[-6000:]}")
            if time.monotonic() - self.started > timeout:
                raise AssertionError(f"SGLang not ready within {timeout}s:\n{self.log_text()[-6000:]}")
            try:
                if http("GET", self.url + "/model_info", timeout=2).status == 200:
                    self.start_seconds = time.monotonic() - self.started
            except OSError:
                time.sleep(0.5)
        return self.start_seconds

    def call(self, method: str, path: str, body: Any = None, *, timeout: float = 60) -> Reply:
        return http(method, self.url + path, body, timeout=timeout)
