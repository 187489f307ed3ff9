"""The one place RLJob status is written. A JSON merge patch of what changed (null removes a field),
so kopf's own annotations and concurrent spec edits are never overwritten.

Progress alone (the ready counts, the message) is written at most every PROGRESS_ONLY_SECONDS: pods
whose readiness flaps (a probe that times out on a loaded node) and a long Rollout naming the trainers it
waits for, report by report, would otherwise cost a status write each, growing with the gang. Any other
change is written at once, with the progress of that moment: every phase change, so `kubectl get
rljob`'s READY and MESSAGE are at most a phase or 30 s behind.

A write the API server leaves unanswered (a 5xx, a broken connection, a timeout: kube.Unanswered) may or
may not have been applied. The writer reads the status back (one GET) and goes on from what is stored:
written, or, when it is not, the change is sent again at the next write, diffed against what was read.
Until it is stored the write raises StatusNotStored, and the next is tried no sooner than its
`retry_in`: RETRY_SECONDS, doubling with each failure in a row up to MAX_RETRY_SECONDS. Before, a 504
raised out of the conductor and kopf started it again 60 s later."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rljob.api.status import RLJobStatus
from rljob.controller.kube import Kube, Unanswered
from rljob.controller.metrics import STATUS_FIELDS, STATUS_WRITES

log = logging.getLogger(__name__)
PROGRESS_ONLY = frozenset({"ready", "readyReplicas", "message"})  # wire names (api/status.py)
PROGRESS_ONLY_SECONDS = 30.0  # as often as the conductor's quiet decision (controller/conductor.py)
RETRY_SECONDS = 2.0  # the conductor's tick (controller/conductor.py)
MAX_RETRY_SECONDS = 30.0  # the conductor's quiet decision


class StatusNotStored(Exception):
    """The status offered is not the one the API server has, or that is not known: the write went
    unanswered and reading it back did not show it. `retry_in`: seconds until a write is tried again."""

    def __init__(self, retry_in: float) -> None:
        super().__init__(f"status not stored; tried again in {retry_in:.1f} s")
        self.retry_in = retry_in


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
        retry_seconds: float = RETRY_SECONDS,
        max_retry_seconds: float = MAX_RETRY_SECONDS,
    ) -> None:
        """`stored`: the status as the API server has it (not parsed: defaults must be written too)."""
        self._kube = kube
        self._namespace = namespace
        self._name = name
        # The status as the API server has it, what each patch is diffed against; None when not known.
        self._stored: dict[str, Any] | None = dict(stored or {})
        self._clock = clock
        self._written_at = float("-inf")
        self._held_back = False  # the last status offered had progress it did not write yet
        self._retry_seconds = retry_seconds
        self._max_retry_seconds = max_retry_seconds
        self._failures = 0  # writes in a row whose status was not stored
        self._retry_at = float("-inf")  # no write is tried before this clock time

    async def write(self, status: RLJobStatus) -> bool:
        """Patches what changed; False when nothing did, or only progress did within
        PROGRESS_ONLY_SECONDS of the last write (the caller offers the status again: held_back_for).
        Raises StatusNotStored when the status is not stored (see the module's docstring); ApiError for
        an answer that refuses the patch (kube.patch_status)."""
        new = status.wire()
        self._held_back = False
        now = self._clock()
        if self._stored is None:
            if now < self._retry_at:
                raise StatusNotStored(self._retry_at - now)
            self._stored = await self._read_back()
            if self._stored is None:
                raise self._not_stored()
        patch = merge_patch(self._stored, new)
        if not patch:
            self._failures, self._retry_at = 0, float("-inf")
            return False
        if patch.keys() <= PROGRESS_ONLY and now - self._written_at < PROGRESS_ONLY_SECONDS:
            self._held_back = True
            return False
        if now < self._retry_at:
            raise StatusNotStored(self._retry_at - now)
        try:
            await self._kube.patch_status(self._namespace, self._name, patch)
        except Unanswered as unanswered:
            log.warning("%s/%s: status write %s: reading it back", self._namespace, self._name, unanswered)
            self._stored = await self._read_back()
            if self._stored is None or merge_patch(self._stored, new):
                raise self._not_stored() from None
            log.info("%s/%s: the status write went unanswered and is stored", self._namespace, self._name)
        self._stored = new
        self._written_at = now
        self._failures, self._retry_at = 0, float("-inf")
        STATUS_WRITES.inc()
        for key in patch:  # keys of the status model's wire form: a bounded set of labels
            STATUS_FIELDS.labels(field=key).inc()
        return True

    async def _read_back(self) -> dict[str, Any] | None:
        """The status as the API server has it now; None when that is not known (the read went
        unanswered too, or the RLJob is gone: kopf stops its conductor)."""
        try:
            return await self._kube.read_status(self._namespace, self._name)
        except Unanswered as unanswered:
            log.warning("%s/%s: status read back %s", self._namespace, self._name, unanswered)
            return None

    def _not_stored(self) -> StatusNotStored:
        """One more failure in a row: the next write waits twice as long as the last, up to the most."""
        self._failures += 1
        wait = min(self._max_retry_seconds, self._retry_seconds * 2 ** (self._failures - 1))
        self._retry_at = self._clock() + wait
        log.warning("%s/%s: status not stored: written again in %.3g s", self._namespace, self._name, wait)
        return StatusNotStored(wait)

    def held_back_for(self) -> float | None:
        """Seconds until the status last offered, and held back, would be written; None when the last
        one offered was written, or needed no write."""
        if not self._held_back:
            return None
        return max(0.0, self._written_at + PROGRESS_ONLY_SECONDS - self._clock())
