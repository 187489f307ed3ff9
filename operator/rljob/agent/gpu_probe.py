"""How the agent sees GPU memory: NVML on a real node (every GPU visible to the pod), or a probe plugin
named by import path (`--gpu-probe module:factory`, the factory called with the agent's engine, whose
`get_json` reads through the engine's port).
Release verification compares samples taken before and after the release; the headroom gate
(agent/headroom.py) reads free memory and the processes that hold it; the rollout sampler reads each
GPU's busy fraction (docs/profiling.md)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from rljob.agent.engines.base import Engine
from rljob.agent.gpu_scope import LISTED_ENV, VISIBLE, GpuScopeUnknown, Selection, pod_gpu_lists, select_gpus
from rljob.agent.timing import add_external
from rljob.api.agent import GpuScope


@dataclass(frozen=True)
class GpuMemory:
    index: int
    used_bytes: int
    total_bytes: int
    uuid: str = ""
    name: str = ""  # the device's name (NVML's nvmlDeviceGetName), e.g. "NVIDIA H200"


@dataclass(frozen=True)
class GpuProcessUse:
    """One process on one of the pod's GPUs, as NVML lists it: `pid` in the driver's view (the host's PID
    namespace on a node), `used_bytes` None where NVML cannot tell (its usedGpuMemory is unavailable)."""

    gpu: int
    pid: int
    used_bytes: int | None


class GpuProbe(Protocol):
    # True when the pids `processes` reports are the host's (NVML in a container), not the agent's own
    # PID namespace's: a pid the agent sees is then the same process only if it maps a GPU device.
    host_pids: bool

    async def sample(self) -> list[GpuMemory]: ...

    async def processes(self) -> list[GpuProcessUse]:
        """Every process NVML lists on the pod's GPUs (compute and graphics), one entry per (GPU, pid)."""
        ...

    async def utilization(self) -> list[float] | None:
        """Per GPU, the fraction of time (0..1) a kernel ran since the previous call (the first call
        starts the interval), or None when the probe cannot tell."""
        ...


class NvmlProbe:
    """pynvml (nvidia-ml-py), imported lazily so the agent starts on machines without the driver."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._since: list[int] = []  # per GPU: NVML timestamp (µs) of the last utilization sample read
        self._init_lock = threading.Lock()  # the rollout sampler and a command may both call first

    scope: Selection | None = None  # which GPUs are the pod's (agent/gpu_scope.py), once NVML started
    proc_root = Path("/proc")
    host_pids = True  # the driver does not translate pids into a container's namespace (nvidia-docker#1483)

    def _own_handles(self, nvml: Any) -> list[Any]:
        """The pod's GPUs only: all visible ones when the container sees only those, else the ones a pod
        process names; none (GpuScopeUnknown at each sample) when the agent cannot tell."""
        self.scope = select_gpus(
            os.environ.get(VISIBLE), os.environ.get(LISTED_ENV), pod_gpu_lists(self.proc_root)
        )
        if self.scope.scope == GpuScope.UNKNOWN:
            return []
        if not self.scope.devices:
            return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        return [
            nvml.nvmlDeviceGetHandleByIndex(int(d)) if d.isdigit() else nvml.nvmlDeviceGetHandleByUUID(d)
            for d in self.scope.devices
        ]

    def _init(self) -> None:
        with self._init_lock:
            if self._nvml is None:
                self._init_locked()

    def _init_locked(self) -> None:
        import pynvml  # type: ignore[import-untyped]  # lazy: only nodes with the NVIDIA driver have it

        pynvml.nvmlInit()
        self._handles = self._own_handles(pynvml)
        self._names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
        self._since = [0] * len(self._handles)
        self._nvml = pynvml  # last: other threads test it unlocked

    def _sample_blocking(self) -> list[GpuMemory]:
        if self._nvml is None:
            self._init()
        if self.scope is not None and self.scope.scope == GpuScope.UNKNOWN:
            raise GpuScopeUnknown(f"cannot tell which GPUs are this pod's: {self.scope.reason}")
        out = []
        for i, handle in enumerate(self._handles):
            info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuMemory(i, int(info.used), int(info.total), name=self._names[i]))
        return out

    def _processes_blocking(self) -> list[GpuProcessUse]:
        if self._nvml is None:
            self._init()
        if self.scope is not None and self.scope.scope == GpuScope.UNKNOWN:
            raise GpuScopeUnknown(f"cannot tell which GPUs are this pod's: {self.scope.reason}")
        nvml, out = self._nvml, []
        for i, handle in enumerate(self._handles):
            listed = [*nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            with contextlib.suppress(nvml.NVMLError):  # NOT_SUPPORTED on compute-only boards
                listed += nvml.nvmlDeviceGetGraphicsRunningProcesses(handle)
            out += processes_of(i, listed)
        return out

    async def processes(self) -> list[GpuProcessUse]:
        started = time.monotonic()
        try:
            return await asyncio.to_thread(self._processes_blocking)
        finally:
            add_external(time.monotonic() - started)

    def _busy(self, i: int) -> float:
        """Mean of the driver's utilization samples (percent of each sample period in which a kernel ran)
        newer than the last one read: the whole interval since the previous call, not only NVML's last
        period. Falls back to nvmlDeviceGetUtilizationRates(handle).gpu, the last period's figure."""
        nvml, handle = self._nvml, self._handles[i]
        try:
            _, samples = nvml.nvmlDeviceGetSamples(handle, nvml.NVML_GPU_UTILIZATION_SAMPLES, self._since[i])
        except nvml.NVMLError:
            samples = []  # NOT_FOUND: no sample since the timestamp (or the call is unsupported)
        if samples:
            self._since[i] = max(int(x.timeStamp) for x in samples)
            return sum(float(x.sampleValue.uiVal) for x in samples) / len(samples) / 100.0
        return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu) / 100.0

    def _utilization_blocking(self) -> list[float]:
        if self._nvml is None:
            self._init()
        return [min(1.0, max(0.0, self._busy(i))) for i in range(len(self._handles))]

    async def utilization(self) -> list[float] | None:
        started = time.monotonic()
        try:
            return await asyncio.to_thread(self._utilization_blocking)
        finally:
            add_external(time.monotonic() - started)

    async def sample(self) -> list[GpuMemory]:
        started = time.monotonic()
        try:
            return await asyncio.to_thread(self._sample_blocking)
        finally:
            add_external(time.monotonic() - started)


def processes_of(gpu: int, listed: Iterable[Any]) -> list[GpuProcessUse]:
    """pynvml's process structs of one GPU (`pid`, `usedGpuMemory`: None where NVML reports
    NVML_VALUE_NOT_AVAILABLE, pynvml.py:4193-4226@nvidia-ml-py 13.615.71), one entry per pid: a process in
    both the compute and the graphics list counts once, with the larger figure."""
    by_pid: dict[int, int | None] = {}
    for proc in listed:
        pid, used = int(proc.pid), proc.usedGpuMemory
        used = None if used is None else int(used)
        if pid in by_pid and (used is None or (by_pid[pid] or 0) >= used):
            continue
        by_pid[pid] = used
    return [GpuProcessUse(gpu, pid, used) for pid, used in sorted(by_pid.items())]


def _text(name: str | bytes) -> str:
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


ProbeFactory = Callable[[Engine], GpuProbe]


def check_probe_name(name: str) -> str:
    """`nvml`, or `package.module:factory`; argparse type for `--gpu-probe`."""
    if name != "nvml" and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", name):
        raise ValueError(f"--gpu-probe takes 'nvml' or 'package.module:factory', not {name!r}")
    return name


def make_probe(name: str, engine: Engine) -> GpuProbe:
    if check_probe_name(name) == "nvml":
        return NvmlProbe()
    module, _, attr = name.partition(":")
    factory: ProbeFactory = getattr(importlib.import_module(module), attr)
    return factory(engine)
