"""GPU memory per region and GPU. `RegionBackend` is the seam: `AccountingBackend` (the default) only keeps
numbers; `gpu_memory.CudaRegionBackend` (`--memory-backend cuda`) backs the regions with real CUDA memory
through torch_memory_saver, as SGLang does."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rljob.emulator.gpu_processes import ProcessTable

if TYPE_CHECKING:
    from rljob.emulator.launch import DeviceConfig

REGIONS = ("kv_cache", "weights", "cuda_graph")
BACKENDS = ("accounting", "cuda")


def make_backend(cfg: DeviceConfig) -> RegionBackend:
    """The backend `cfg` asks for. torch is imported only for the cuda backend."""
    if cfg.memory_backend == "accounting":
        return AccountingBackend(
            gpus=cfg.gpus, total=cfg.gpu_total_bytes, baseline=cfg.baseline_bytes, sizes=cfg.region_sizes
        )
    return _cuda_backend(cfg.region_sizes, gpus=cfg.gpus, **cuda_options(cfg))


def cuda_options(cfg: DeviceConfig) -> dict[str, Any]:
    """What the cuda backend takes from the launch config besides sizes and GPU count."""
    memory_saver, graph_in_saver = cfg.memory_saver()
    return {
        "memory_saver": memory_saver,
        "graph_in_saver": graph_in_saver,
        "hook_mode": cfg.memory_saver_hook_mode,
    }


def _cuda_backend(
    sizes: dict[str, int], *, gpus: int, total: int = 0, baseline: int = 0, **options: Any
) -> RegionBackend:
    """`total` and `baseline` are ignored: a real GPU has its own size and context."""
    from rljob.emulator.gpu_memory import CudaRegionBackend  # lazy: imports torch

    return CudaRegionBackend(gpus=gpus, sizes=sizes, **options)


class RegionBackend(Protocol):
    gpus: int

    def pause(self, region: str, *, unmap_delay_s: float = 0.0) -> None:
        """Unmap the region on every GPU (torch_memory_saver pause)."""

    def resume(self, region: str) -> None:
        """Map the region again on every GPU; contents are not restored."""

    def is_paused(self, region: str) -> bool: ...

    def resume_fits(self, regions: list[str]) -> bool:
        """Whether mapping `regions` again fits every GPU beside what is used there now; the cuda backend
        says True and lets the driver answer for real (C-MEM-RESUME-OOM)."""
        ...

    def used_bytes(self, gpu: int) -> int: ...

    def total_bytes(self, gpu: int) -> int: ...

    def region_bytes(self, gpu: int) -> dict[str, int]: ...

    def drive_busy(self, busy_seconds: Callable[[int], float]) -> None:
        """Make each GPU as busy as `busy_seconds(gpu)` (cumulative emulated GPU time) says, where a real
        GPU would show it (NVML); the accounting backend has none to drive."""


@dataclass
class _Region:
    size: int
    paused: bool = False
    unmapped_at: float = 0.0  # monotonic time the physical memory is actually gone (delayed-unmap fault)

    def mapped_bytes(self, now: float) -> int:
        return 0 if self.paused and now >= self.unmapped_at else self.size


@dataclass
class AccountingBackend:
    """Same sizes on every GPU: `baseline` (CUDA context, NCCL, allocator cache: never released) plus the
    regions, plus other processes' memory (`others`, emulator/gpu_processes.py). A delayed unmap keeps the
    bytes counted for a while after pause returned, as slime#579."""

    gpus: int
    total: int
    baseline: int
    sizes: dict[str, int]
    _regions: dict[str, _Region] = field(default_factory=dict)
    others: ProcessTable = field(init=False)

    def __post_init__(self) -> None:
        self._regions = {name: _Region(self.sizes.get(name, 0)) for name in REGIONS}
        self.others = ProcessTable(self.gpus)
        if self.baseline + sum(self.sizes.values()) > self.total:
            raise ValueError("regions plus baseline exceed --gpu-total-bytes")

    def pause(self, region: str, *, unmap_delay_s: float = 0.0) -> None:
        r = self._regions[region]
        r.paused, r.unmapped_at = True, time.monotonic() + unmap_delay_s

    def resume(self, region: str) -> None:
        self._regions[region].paused = False

    def is_paused(self, region: str) -> bool:
        return self._regions[region].paused

    def resume_fits(self, regions: list[str]) -> bool:
        now = time.monotonic()
        mapping = sum(
            r.size for name, r in self._regions.items() if name in regions and not r.mapped_bytes(now)
        )
        return all(self.used_bytes(g) + mapping <= self.total for g in range(self.gpus))

    def used_bytes(self, gpu: int) -> int:
        return self.baseline + sum(self.region_bytes(gpu).values()) + self.others.bytes_on(gpu)

    def total_bytes(self, gpu: int) -> int:
        return self.total

    def region_bytes(self, gpu: int) -> dict[str, int]:
        now = time.monotonic()
        return {name: r.mapped_bytes(now) for name, r in self._regions.items()}

    def drive_busy(self, busy_seconds: Callable[[int], float]) -> None:
        return None  # numbers only: /_emulator/utilization serves the busy time
