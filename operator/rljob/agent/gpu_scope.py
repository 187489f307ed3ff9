"""Which GPUs are this pod's: release is verified on exactly the GPUs the pod's engine uses, never on another
pod's GPUs of the same node (NVML shows every GPU visible to the agent's container).

In order (`select_gpus`):

1. `RLJOB_GPU_UUIDS` (comma-separated UUIDs): given by hand. Scope `Listed`.
2. The agent's own container sees only the pod's GPUs: the agent shares the rollout container's DRA
   ResourceClaim (controller/children.py gives the agent the rollout container's `resources.claims`), and
   the DRA driver injects exactly the claim's devices into each container that names the claim. The agent's
   `NVIDIA_VISIBLE_DEVICES` is then unset (or a device list): every GPU NVML shows is the pod's. Scope
   `Container`. This is the primary, documented way.
3. `NVIDIA_VISIBLE_DEVICES=all` (the operator sets it only when asked to, for nodes with the classic device
   plugin whose NVIDIA runtime still accepts it from an unprivileged container): every GPU of the node. The
   GPUs that are the pod's are the ones the device plugin gave the engine's container, which it names in that
   container's environment (`NVIDIA_VISIBLE_DEVICES=GPU-<uuid>,...` with its default envvar strategy, or
   `/var/run/nvidia-container-devices` with the volume-mounts strategy, one file per UUID). With
   `shareProcessNamespace: true` the agent sees the pod's processes, and reads `/proc/<pid>/environ` (and
   `/proc/<pid>/root/...`) where it may: as the same user as the engine or with CAP_SYS_PTRACE. One list
   found: scope `Process`. None found, or two different lists: scope `Unknown`, and release verification fails
   with the reason instead of verifying GPUs that may be another pod's.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rljob.agent.state import StateStore
from rljob.api.agent import GpuScope, GpuScopeReport

VISIBLE = "NVIDIA_VISIBLE_DEVICES"
LISTED_ENV = "RLJOB_GPU_UUIDS"
DEVICE_LIST_DIR = "/var/run/nvidia-container-devices"  # the device plugin's volume-mounts strategy
NO_DEVICES = ("", "none", "void")


@dataclass(frozen=True)
class Selection:
    scope: GpuScope
    devices: tuple[str, ...] = ()  # UUIDs or indices to open; () with Container: every visible GPU
    reason: str = ""

    def report(self, gpus: int | None = None) -> GpuScopeReport:
        return GpuScopeReport(
            scope=self.scope, devices=list(self.devices), gpus=gpus, reason=self.reason or None
        )


class GpuScopeUnknown(RuntimeError):
    """The agent cannot tell which GPUs are the pod's: nothing is verified."""


def parse_environ(raw: bytes) -> dict[str, str]:
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def pod_gpu_lists(proc_root: Path = Path("/proc"), own_pid: int | None = None) -> Iterator[tuple[int, str]]:
    """(pid, device list) of every process of the pod (the agent's PID namespace) that names its GPUs."""
    own = os.getpid() if own_pid is None else own_pid
    for entry in proc_root.iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        value = _device_list(entry)
        if value is not None:
            yield int(entry.name), value


def _device_list(entry: Path) -> str | None:
    """The GPUs one process names (a list, or a DRA device directory's entries); None when it names none
    or cannot be read (another user's process without CAP_SYS_PTRACE, or gone)."""
    try:
        value = parse_environ((entry / "environ").read_bytes()).get(VISIBLE)
    except OSError:
        return None
    if value is None or value.strip().lower() in (*NO_DEVICES, "all"):
        return None
    if not value.startswith(DEVICE_LIST_DIR):
        return value
    try:
        return ",".join(sorted(p.name for p in (entry / "root" / value.lstrip("/")).iterdir()))
    except OSError:
        return None


def select_gpus(visible: str | None, listed: str | None, pod_lists: Iterable[tuple[int, str]]) -> Selection:
    if listed and listed.strip():
        return Selection(GpuScope.LISTED, tuple(d.strip() for d in listed.split(",") if d.strip()))
    if visible is None or visible.strip().lower() != "all":
        return Selection(GpuScope.CONTAINER)
    found: dict[str, list[int]] = {}
    for pid, value in pod_lists:
        devices = ",".join(d.strip() for d in value.split(",") if d.strip())
        found.setdefault(devices, []).append(pid)
    return _by_process(found)


def _by_process(found: dict[str, list[int]]) -> Selection:
    """The GPUs the pod's processes name (device list -> pids): one list is the pod's; none or several
    leave the scope unknown."""
    if len(found) == 1:
        devices = next(iter(found))
        return Selection(GpuScope.PROCESS, tuple(devices.split(",")))
    if not found:
        return Selection(
            GpuScope.UNKNOWN,
            reason=f"{VISIBLE}=all shows every GPU of the node, and no process of this pod that the agent "
            "can read names its own (give the agent the rollout container's DRA claim, or "
            f"shareProcessNamespace with the agent as the engine's user, or {LISTED_ENV})",
        )
    lists = "; ".join(f"{d} (pids {', '.join(map(str, pids))})" for d, pids in sorted(found.items()))
    return Selection(GpuScope.UNKNOWN, reason=f"processes of this pod name different GPUs: {lists}")


def report_gpu_scope(store: StateStore, probe: object, gpus: int | None = None) -> None:
    """Put the probe's scope in the agent's state (and so in the RLJob's status.pods) when it changed. A
    probe plugin (no `scope`) sees only its pod's GPUs; an NVML probe that never started says nothing."""
    scope = getattr(probe, "scope", "plugin")
    if scope is None:
        return
    plugin = GpuScopeReport(scope=GpuScope.PROBE, gpus=gpus)
    report = scope.report(gpus) if isinstance(scope, Selection) else plugin
    if store.state.gpus != report:
        with store.change() as s:
            s.gpus = report
