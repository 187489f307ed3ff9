"""The one place RLJob status is written. A JSON merge patch of what changed (null removes a field),
so kopf's own annotations and concurrent spec edits are never overwritten.

Ready counts alone are written at most every READY_ONLY_SECONDS: pods whose readiness flaps (a probe
that times out on a loaded node) would otherwise cost a status write per flip, each carrying nothing
else; at 512 pods of an overloaded test host that was 68 of 72 writes an iteration, and 13.4 with a write
at most every 5 s (docs/benchmarks.md). Any other change is written at once, with the counts of that
moment: every phase change, so `kubectl get rljob`'s READY is at most a phase or 30 s behind."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rljob.api.status import RLJobStatus
from rljob.controller.kube import Kube
from rljob.controller.metrics import STATUS_FIELDS, STATUS_WRITES

READY_ONLY = frozenset({"ready", "readyReplicas"})  # wire names (api/status.py)
READY_ONLY_SECONDS = 30.0  # as often as the conductor's quiet decision (controller/conductor.py)


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
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        stored: dict[str, Any] | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`stored`: the status as the API server has it (not parsed: defaults must be written too)."""
        self._kube = kube
        self._namespace = namespace
        self._name = name
        self._written: dict[str, Any] = dict(stored or {})
        self._clock = clock
        self._written_at = float("-inf")
        self._held_back = False  # the last status offered had ready counts it did not write yet

    async def write(self, status: RLJobStatus) -> bool:
        """Patches what changed; False when nothing did, or only the ready counts did within
        READY_ONLY_SECONDS of the last write (the caller offers the status again: held_back_for)."""
        new = status.wire()
        patch = merge_patch(self._written, new)
        self._held_back = False
        if not patch:
            return False
        now = self._clock()
        if patch.keys() <= READY_ONLY and now - self._written_at < READY_ONLY_SECONDS:
            self._held_back = True
            return False
        await self._kube.patch_status(self._namespace, self._name, patch)
        self._written = new
        self._written_at = now
        STATUS_WRITES.inc()
        for key in patch:  # keys of the status model's wire form: a bounded set of labels
            STATUS_FIELDS.labels(field=key).inc()
        return True

    def held_back_for(self) -> float | None:
        """Seconds until the status last offered, and held back, would be written; None when the last
        one offered was written, or needed no write."""
        if not self._held_back:
            return None
        return max(0.0, self._written_at + READY_ONLY_SECONDS - self._clock())
