"""How the agent sees GPU memory: NVML on a real node (every GPU visible to the pod), or the emulator's
accounting route. Release verification compares samples taken before and after the release."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rljob.agent.sglang_client import SGLangClient
from rljob.agent.timing import add_external


@dataclass(frozen=True)
class GpuMemory:
    index: int
    used_bytes: int
    total_bytes: int


class GpuProbe(Protocol):
    async def sample(self) -> list[GpuMemory]: ...


class NvmlProbe:
    """pynvml (nvidia-ml-py), imported lazily so the agent starts on machines without the driver."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []

    def _init(self) -> None:
        import pynvml  # type: ignore[import-untyped]  # lazy: only nodes with the NVIDIA driver have it

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]

    def _sample_blocking(self) -> list[GpuMemory]:
        if self._nvml is None:
            self._init()
        out = []
        for i, handle in enumerate(self._handles):
            info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuMemory(i, int(info.used), int(info.total)))
        return out

    async def sample(self) -> list[GpuMemory]:
        started = time.monotonic()
        try:
            return await asyncio.to_thread(self._sample_blocking)
        finally:
            add_external(time.monotonic() - started)


class EmulatorProbe:
    """Reads `/_emulator/memory` on the SGLang URL (the emulator's per-GPU accounting)."""

    def __init__(self, client: SGLangClient) -> None:
        self._client = client

    async def sample(self) -> list[GpuMemory]:
        gpus = await self._client.emulator_memory()
        return [GpuMemory(g["index"], g["used_bytes"], g["total_bytes"]) for g in gpus]


def make_probe(kind: str, client: SGLangClient) -> GpuProbe:
    if kind == "nvml":
        return NvmlProbe()
    if kind == "emulator":
        return EmulatorProbe(client)
    raise ValueError(f"unknown GPU probe {kind!r}")
