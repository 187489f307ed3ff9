"""The emulated GPUs' other processes, and NVML's per-process list (served by emulator/routes_emulator.py):
what the agent's headroom gate reads through the emulator probe where a node's agent reads NVML.

NVML lists, per GPU, every process with a context on it (nvmlDeviceGetComputeRunningProcesses, and the
graphics list): its pid and `usedGpuMemory`, the bytes it holds, which NVML may not be able to tell
(NVML_VALUE_NOT_AVAILABLE, which pynvml turns into None: pynvml.py:4193-4226@nvidia-ml-py 13.615.71).
The pids are the driver's, i.e. the host's: the driver knows no PID namespaces (NVIDIA/nvidia-docker#1483).
Here every process is one of this machine's, so its pid is the one the agent sees, except a "foreign"
entry, which stands for another pod's process: a pid no process here has.

The list holds the emulator's own process (SGLang's: the baseline and the mapped regions) and every entry
a process registered with `POST /_emulator/processes` (the simulated trainer's allocations, a test's
"another pod"). A registered process's memory counts in the GPU's used bytes, and a resume that does not
fit beside it kills the scheduler as torch_memory_saver does (C-MEM-RESUME-OOM). An entry ends when its
process does (a CUDA context dies with its process), unless it is foreign."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HeldMemory:
    pid: int
    per_gpu: list[int]  # bytes held on each GPU
    unknown: bool = False  # NVML cannot tell its usage: usedGpuMemory is None
    foreign: bool = False  # another pod's process: no process here has this pid


@dataclass
class ProcessTable:
    """Other processes' memory on the emulated GPUs (the accounting backend's `others`)."""

    gpus: int
    held: dict[int, HeldMemory] = field(default_factory=dict)

    def current(self) -> list[HeldMemory]:
        """The entries whose process still runs (a local pid that is gone held nothing since it exited)."""
        for pid in [p for p, h in self.held.items() if not h.foreign and not _running(p)]:
            del self.held[pid]
        return sorted(self.held.values(), key=lambda h: h.pid)

    def bytes_on(self, gpu: int) -> int:
        return sum(h.per_gpu[gpu] for h in self.current())

    def set(self, entry: HeldMemory) -> None:
        if any(entry.per_gpu):
            self.held[entry.pid] = entry
        else:
            self.held.pop(entry.pid, None)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def nvml_list(engine: Any) -> list[dict[str, Any]]:
    """Per GPU, NVML's process list: {"gpu", "processes": [{"pid", "usedGpuMemory"}]}."""
    b = engine.backend
    others: ProcessTable | None = getattr(b, "others", None)
    held = others.current() if others is not None else []
    out = []
    for g in range(b.gpus):
        own = getattr(b, "baseline", 0) + sum(b.region_bytes(g).values())
        procs = [{"pid": os.getpid(), "usedGpuMemory": own}]
        procs += [
            {"pid": h.pid, "usedGpuMemory": None if h.unknown else h.per_gpu[g]} for h in held if h.per_gpu[g]
        ]
        out.append({"gpu": g, "processes": procs})
    return out


def parse_entry(body: dict[str, Any], gpus: int) -> HeldMemory:
    """`{"pid": P, "bytes": B | [per GPU], "unknownBytes": false, "foreign": false}`; bytes 0 ends it."""
    pid = body["pid"]
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ValueError("pid must be a positive integer")
    raw = body.get("bytes", 0)
    per_gpu = [raw] * gpus if isinstance(raw, int) and not isinstance(raw, bool) else raw
    if not isinstance(per_gpu, list) or len(per_gpu) != gpus:
        raise ValueError(f"bytes must be an integer or a list of {gpus} integers (one per GPU)")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in per_gpu):
        raise ValueError("bytes must not be negative")
    unknown_keys = set(body) - {"pid", "bytes", "unknownBytes", "foreign"}
    if unknown_keys:
        raise ValueError(f"unknown keys {sorted(unknown_keys)}")
    return HeldMemory(pid, per_gpu, bool(body.get("unknownBytes", False)), bool(body.get("foreign", False)))
