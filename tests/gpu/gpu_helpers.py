"""Measuring helpers for the GPU tier: NVML reads (what the agent's nvml probe sees), a background NVML
sampler, the emulator's `tms {json}` log lines, file checksums and the results table."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GiB = 1 << 30


def cuda_missing() -> str | None:
    """Why no test here can use a GPU (torch with CUDA, NVML), or None. Creates no CUDA context."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # NVMLError or ImportError
        return f"NVML unavailable: {e}"
    return None


def _handle(index: int) -> Any:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def nvml_used(index: int = 0) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(_handle(index)).used)


def nvml_total(index: int = 0) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(_handle(index)).total)


def card(index: int = 0) -> str:
    """The card as NVML names it, with its memory and the driver: what a figure was measured on."""
    import pynvml

    h = _handle(index)
    name = pynvml.nvmlDeviceGetName(h)
    name = name.decode() if isinstance(name, bytes) else str(name)
    driver = pynvml.nvmlSystemGetDriverVersion()
    driver = driver.decode() if isinstance(driver, bytes) else str(driver)
    return f"{name} ({nvml_total(index) >> 20} MiB, driver {driver})"


def wait_used_below(limit: int, timeout: float, index: int = 0) -> int:
    """NVML used bytes once at most `limit` (a process that exited may take a moment to give memory back)."""
    deadline = time.monotonic() + timeout
    while True:
        used = nvml_used(index)
        if used <= limit or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


class NvmlSampler:
    """(unix time, used bytes) every `interval` seconds on GPU `index`, in a thread."""

    def __init__(self, index: int = 0, interval: float = 0.01) -> None:
        self.index, self.interval = index, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import pynvml

        h = _handle(self.index)
        while not self._stop.is_set():
            self.samples.append((time.time(), int(pynvml.nvmlDeviceGetMemoryInfo(h).used)))
            time.sleep(self.interval)

    def __enter__(self) -> NvmlSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def tms_events(log_text: str) -> list[dict[str, Any]]:
    """The emulator's `tms {json}` lines (gpu_memory.CudaRegionBackend._event), in order."""
    out = []
    for line in log_text.splitlines():
        _, sep, rest = line.partition(" tms {")
        if sep:
            out.append(json.loads("{" + rest))
    return out


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            h.update(chunk)
    return h.hexdigest()


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def markdown_table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def while_alive(proc: Any, predicate: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], bool]:
    """`predicate` for Agent.wait_state, failing the wait at once when `proc` (a process the test started)
    has exited with an error: a dead trainer never asks for the GPU."""

    def check(state: dict[str, Any]) -> bool:
        rc = proc.returncode()
        if rc not in (None, 0):
            raise AssertionError(f"{proc.name} exited {rc}:\n{proc.log_text()[-4000:]}")
        return predicate(state)

    return check
