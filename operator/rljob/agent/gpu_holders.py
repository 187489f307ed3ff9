"""Whose process holds GPU memory: NVML's per-process list on the pod's GPUs, attributed to the pod's
containers where the agent can tell, and said to be not attributable, with why, where it cannot.

NVML lists each process with its pid and the bytes it holds (`usedGpuMemory`, unavailable on some drivers
and modes). The driver knows no PID namespaces: inside a container it reports the host's pids
(NVIDIA/nvidia-docker#1483), which the agent's own /proc does not show. So a process is attributed only
when the agent sees a process of that pid in its PID namespace (the pod shares one:
`shareProcessNamespace: true`, which tensor refits set) and, with NVML's host pids, that process maps a GPU
device (else the pid is another process's number in the host's namespace); its container is the
`RLJOB_CONTAINER` the operator puts in every container's environment, read from /proc/<pid>/environ (as
the engine's user or with CAP_SYS_PTRACE). Everything else is "not attributable", with the reason."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from rljob.agent.gpu_probe import GpuProcessUse
from rljob.agent.gpu_scope import parse_environ
from rljob.api.agent import CONTAINER_ENV, TRAINER_CONTAINER_ENV, GpuProcess

DEFAULT_TRAINER_CONTAINER = "trainer"  # spec.trainer.container's default
GPU_DEVICE = "/dev/nvidia"  # every CUDA process maps /dev/nvidiactl and its /dev/nvidia<N>
HOST_PIDS = (
    "NVML reports host pids, and this pod's PID namespace has no process of this pid that uses a GPU "
    "(another pod's process, or the pod does not share its process namespace)"
)
NOT_IN_POD = "no process of this pid in the agent's PID namespace (another pod's, or a host process)"
GiB = float(1 << 30)


def attribute(
    processes: Iterable[GpuProcessUse], host_pids: bool, proc_root: Path = Path("/proc")
) -> list[GpuProcess]:
    """Each process with its container, or why it cannot be attributed; largest first per GPU."""
    out = [_one(p, host_pids, proc_root) for p in processes]
    return sorted(out, key=lambda g: (g.gpu, -(g.used_bytes or 0), g.pid))


def _one(p: GpuProcessUse, host_pids: bool, proc_root: Path) -> GpuProcess:
    entry = proc_root / str(p.pid)
    container, why = None, None
    if not entry.is_dir():
        why = HOST_PIDS if host_pids else NOT_IN_POD
    elif host_pids and not _maps_gpu(entry):
        why = HOST_PIDS
    else:
        container, why = _container(entry)
    return GpuProcess(
        gpu=p.gpu, pid=p.pid, used_bytes=p.used_bytes, container=container, not_attributable=why
    )


def _maps_gpu(entry: Path) -> bool:
    """The process maps an NVIDIA device: it is a GPU process, not an unrelated one with the same number.
    Unreadable maps (another user's process without CAP_SYS_PTRACE) prove nothing."""
    try:
        with (entry / "maps").open("rb") as f:
            return any(GPU_DEVICE.encode() in line for line in f)
    except OSError:
        return False


def _container(entry: Path) -> tuple[str | None, str | None]:
    try:
        env = parse_environ((entry / "environ").read_bytes())
    except OSError as e:
        return None, f"its environment is not readable ({e.strerror or e.__class__.__name__})"
    name = env.get(CONTAINER_ENV)
    if not name:
        return None, f"a process of this pod whose environment names no container ({CONTAINER_ENV})"
    return name, None


def trainer_container() -> str:
    return os.environ.get(TRAINER_CONTAINER_ENV) or DEFAULT_TRAINER_CONTAINER


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def describe(p: GpuProcess) -> str:
    """`pid 4121 (trainer) holds 17.2 GiB`; `pid 4121 (not attributable: ...) holds ...`."""
    whose = p.container if p.container is not None else f"not attributable: {p.not_attributable}"
    held = gib(p.used_bytes) if p.used_bytes is not None else "an amount NVML cannot tell"
    return f"pid {p.pid} ({whose}) holds {held}"
