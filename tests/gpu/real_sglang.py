"""Real SGLang for the GPU tier: `python -m sglang.launch_server` on a model rljob.testing builds (the tiny
model, or the Llama-3-8B-shaped one of llama_checkpoint), with the flags docs/real-sglang.md explains,
its static memory sized from the card; whether it can run here; a process handle shaped like the
emulator's (url, call, alive, log_text) so the agent and the differential runner drive either."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
from pathlib import Path

from agent_procs import PY, free_port
from gpu_helpers import GiB, nvml_used, wait_used_below
from real_server import RealServer

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
# What stays beside SGLang's static pool (weights + KV cache) while it serves at 8B: its CUDA graphs,
# activations and context (3-4 GiB), a trainer's two 2 GiB bucket buffers and context. The trainer's 15 GiB
# of weights are there only while the kv_cache is released (it gives them back before the resume).
BESIDE_STATIC = 12 * GiB
MAX_MEM_FRACTION = 0.8


def mem_fraction(total: int) -> float:
    """--mem-fraction-static for a card of `total` bytes: 0.8 where BESIDE_STATIC fits beside it (an
    80 GB H100: 63.7 GiB static; a 141 GB H200: 112 GiB), less on a smaller card."""
    return round(min(MAX_MEM_FRACTION, (total - BESIDE_STATIC) / total), 2)


def launch_flags(fraction: float) -> tuple[str, ...]:
    """LAUNCH_FLAGS with another --mem-fraction-static."""
    flags = list(LAUNCH_FLAGS)
    flags[flags.index("--mem-fraction-static") + 1] = f"{fraction:g}"
    return tuple(flags)


# SGLang's own account of its start (model_runner.py, memory_pool.py, http_server.py @0.5.15.post1).
START_LINES = re.compile(r"(Load weight end\.|Capture .* end\.|KV Cache is allocated\.|ready to roll).*")


def start_phases(log_text: str) -> list[str]:
    """The lines of SGLang's log that say where its start went (weights, KV cache, graph capture)."""
    return [m.group(0).strip()[:240] for m in START_LINES.finditer(log_text)]


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


class RealSGLang(RealServer):
    """`python -m sglang.launch_server` on loopback; `flags` replace LAUNCH_FLAGS."""

    ENGINE = "SGLang"
    READY_PATH = "/model_info"  # the warmup generate has run by then

    def __init__(self, tmp: Path, model_dir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        while self.port > 50000:  # SGLang derives its gRPC port as this + 10000: it must be < 65536
            self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.version = VERSION
        argv = [PY, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), *(flags or LAUNCH_FLAGS)]  # fmt: skip
        self.flags = tuple(flags or LAUNCH_FLAGS)
        self.used_before = nvml_used()
        super().__init__("sglang", argv, tmp / f"sglang-{self.port}.log", env)

    def stop(self) -> None:
        """Stops it, then waits until the GPU memory it held is the driver's again (its scheduler is a
        child process that exits after it): the next test sizes itself from what is free."""
        super().stop()
        wait_used_below(self.used_before + GiB, timeout=60)
