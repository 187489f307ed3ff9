"""The one place RLJob status is written. A JSON merge patch of what changed (null removes a field),
so kopf's own annotations and concurrent spec edits are never overwritten."""

from __future__ import annotations

from typing import Any

from rljob.api.status import RLJobStatus
from rljob.controller.kube import Kube
from rljob.controller.metrics import STATUS_WRITES


def merge_patch(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif value != before:
            patch[key] = value
    return patch


class StatusWriter:
    def __init__(self, kube: Kube, namespace: str, name: str, stored: dict[str, Any] | None) -> None:
        """`stored`: the status as the API server has it (not parsed: defaults must be written too)."""
        self._kube = kube
        self._namespace = namespace
        self._name = name
        self._written: dict[str, Any] = dict(stored or {})

    async def write(self, status: RLJobStatus) -> bool:
        new = status.wire()
        patch = merge_patch(self._written, new)
        if not patch:
            return False
        await self._kube.patch_status(self._namespace, self._name, patch)
        self._written = new
        STATUS_WRITES.inc()
        return True
