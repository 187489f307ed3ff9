"""Turn API objects into the lifecycle machine's observations."""

from __future__ import annotations

from typing import Any

from rljob.controller.children import LABEL_GANG, LABEL_INDEX
from rljob.lifecycle.model import PodObservation


def _int_label(labels: dict[str, str], key: str) -> int:
    try:
        return int(labels.get(key, "-1"))
    except ValueError:
        return -1


def broken_reason(pod: dict[str, Any]) -> str | None:
    """A container that failed or restarted lost its process state (the engine's memory, the trainer's step).

    Only `containerStatuses` count. The agent as a native sidecar reports in `initContainerStatuses`: the
    kubelet restarts it without ending the pod and it recovers its state from its pod-local record, so
    its restart is not a lost member; when it cannot recover, it says so itself (stage Failed, fatal
    StateUnknown), which the lifecycle treats as one. Injected as a regular container (servers before
    1.33), its exit ends the member here as any container's does. A container that exited 0 is not
    broken here: it finished (`completed_containers`), and the lifecycle decides what that means."""
    for cs in pod.get("status", {}).get("containerStatuses") or []:
        state = cs.get("state") or {}
        if "terminated" in state and state["terminated"].get("exitCode") != 0:
            term = state["terminated"]
            return (
                f"container {cs['name']} terminated (exit {term.get('exitCode')}, {term.get('reason', '')})"
            )
        if cs.get("restartCount", 0) > 0:
            return f"container {cs['name']} restarted {cs['restartCount']} time(s)"
    return None


def completed_containers(pod: dict[str, Any]) -> tuple[str, ...]:
    """The containers that exited 0 and never restarted, by name."""
    return tuple(
        cs["name"]
        for cs in pod.get("status", {}).get("containerStatuses") or []
        if (cs.get("state") or {}).get("terminated", {}).get("exitCode") == 0 and not cs.get("restartCount")
    )


def pod_observation(pod: dict[str, Any]) -> PodObservation:
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    scheduled: dict[str, Any] = next(
        (c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"), {}
    )
    return PodObservation(
        index=_int_label(labels, LABEL_INDEX),
        name=meta["name"],
        gang=_int_label(labels, LABEL_GANG),
        phase=status.get("phase", "Pending"),
        ready=conditions.get("Ready") == "True",
        deleting=meta.get("deletionTimestamp") is not None,
        broken=broken_reason(pod),
        completed=completed_containers(pod),
        unschedulable=(
            str(scheduled.get("message") or "no node fits the pod")[:512]
            if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable"
            else None
        ),
    )


def pod_ip(pod: dict[str, Any]) -> str | None:
    status = pod.get("status") or {}
    ip: str | None = status.get("podIP")
    return ip
