"""One active operator among replicas: leader election on a coordination.k8s.io Lease, as client-go's
leaderelection package does it (k8s.io/client-go/tools/leaderelection/leaderelection.go@v0.34.4).

Why not kopf peering: peering freezes an operator when it sees a peer of higher priority, but two equal
peers starting together both run until they notice each other, and a frozen operator's in-flight
handlers keep going; nothing there bounds the time two writers may overlap. A Lease gives that bound:

- a candidate takes the Lease only when the holder has not renewed it for `lease_seconds`, measured on
  the candidate's own monotonic clock from when it last saw the record change (no clock comparison
  between machines), and only through an update conditioned on the resourceVersion it read;
- the holder renews every `retry_seconds`; if it has not renewed for `renew_deadline_seconds`
  (< `lease_seconds`), it stops acting at once by ending its process. So a deposed holder stops at
  least `lease_seconds - renew_deadline_seconds` before anyone else may start.

The decision (`next_move`) is pure; `LeaderElector` does the I/O in a thread of its own, so a busy event
loop never delays a renewal.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from rljob.kubeclient.apiserver import ApiError, ApiServer

log = logging.getLogger(__name__)

EXIT_LEADERSHIP_LOST = 70  # the process ends; the Deployment restarts it as a standby


@dataclass(frozen=True)
class LeaseRecord:
    """What the Lease says, and the resourceVersion the conditional update must carry."""

    holder: str | None
    renew_time: datetime | None
    transitions: int
    resource_version: str


class Move(StrEnum):
    CREATE = "create"  # no Lease yet
    RENEW = "renew"  # ours: extend it
    TAKE = "take"  # free or expired: take it over
    WAIT = "wait"  # someone else holds a live Lease


@dataclass
class Sighting:
    """When this process last saw the record change (its own monotonic clock)."""

    record: tuple[str | None, datetime | None] | None = None
    seen_at: float = 0.0

    def observe(self, record: LeaseRecord | None, now: float) -> None:
        key = None if record is None else (record.holder, record.renew_time)
        if key != self.record:
            self.record, self.seen_at = key, now


def next_move(
    record: LeaseRecord | None, me: str, sighting: Sighting, now: float, lease_seconds: float
) -> Move:
    if record is None:
        return Move.CREATE
    if record.holder == me:
        return Move.RENEW
    if not record.holder or now - sighting.seen_at >= lease_seconds:
        return Move.TAKE
    return Move.WAIT


@dataclass(frozen=True)
class ElectionOptions:
    namespace: str
    name: str = "rljob-operator"
    identity: str = ""
    lease_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0


class LeaderElector:
    """`acquire()` blocks until this process leads; then a daemon thread renews, and ends the process
    (`on_lost`, default os._exit) the moment renewal has failed for longer than the renew deadline."""

    def __init__(
        self,
        options: ElectionOptions,
        server: ApiServer,
        on_lost: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not options.renew_deadline_seconds < options.lease_seconds:
            raise ValueError("the renew deadline must be shorter than the lease")
        self.options = options
        self.identity = options.identity or f"{os.uname().nodename}-{os.getpid()}"
        self.server = server
        self.on_lost = on_lost or _exit_lost
        self.clock = clock
        self.sighting = Sighting()
        self.renewed_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the Lease -------------------------------------------------------------------------------

    def _path(self, named: bool = True) -> str:
        o = self.options
        return f"/apis/coordination.k8s.io/v1/namespaces/{o.namespace}/leases" + (
            f"/{o.name}" if named else ""
        )

    def _read(self) -> LeaseRecord | None:
        try:
            lease = json.loads(self.server.call_sync("read_lease", "GET", self._path()))
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        spec = lease.get("spec") or {}
        renewed = spec.get("renewTime")
        return LeaseRecord(
            holder=spec.get("holderIdentity"),
            renew_time=datetime.fromisoformat(renewed) if renewed else None,
            transitions=spec.get("leaseTransitions") or 0,
            resource_version=lease["metadata"]["resourceVersion"],
        )

    def _write(self, body: dict[str, Any], create: bool = False) -> None:
        if create:
            self.server.call_sync("create_lease", "POST", self._path(named=False), body)
        else:
            self.server.call_sync("replace_lease", "PUT", self._path(), body)

    def _body(self, transitions: int, resource_version: str | None, acquired: bool) -> dict[str, Any]:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.options.lease_seconds),
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if acquired:
            spec["acquireTime"] = now
        meta: dict[str, Any] = {"name": self.options.name, "namespace": self.options.namespace}
        if resource_version:
            meta["resourceVersion"] = resource_version  # optimistic concurrency: 409 if anyone moved first
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta, "spec": spec}

    def try_once(self) -> bool:
        """One round of the election; True when this process holds the Lease afterwards."""
        now = self.clock()
        record = self._read()
        self.sighting.observe(record, now)
        move = next_move(record, self.identity, self.sighting, now, self.options.lease_seconds)
        try:
            if move is Move.CREATE:
                self._write(self._body(0, None, acquired=True), create=True)
            elif move is Move.RENEW:
                assert record is not None
                self._write(self._body(record.transitions, record.resource_version, acquired=False))
            elif move is Move.TAKE:
                assert record is not None
                self._write(self._body(record.transitions + 1, record.resource_version, acquired=True))
                log.info("took the lease from %s", record.holder or "nobody")
            else:
                return False
        except ApiError as err:
            if err.status in (409, 422):  # somebody else wrote first
                return False
            raise
        self.renewed_at = now
        return True

    # --- the loops -------------------------------------------------------------------------------

    def acquire(self) -> float:
        """Blocks until leading; returns the seconds spent waiting."""
        started = self.clock()
        while not self._stop.is_set():
            try:
                if self.try_once():
                    waited = self.clock() - started
                    log.info("leading as %s (waited %.1fs)", self.identity, waited)
                    self._thread = threading.Thread(
                        target=self._renew_loop, name="lease-renewer", daemon=True
                    )
                    self._thread.start()
                    return waited
            except Exception as err:  # API down: keep trying, we hold nothing
                log.warning("leader election: %s", err)
            self._stop.wait(self.options.retry_seconds)
        raise RuntimeError("stopped before leading")

    def leading(self) -> bool:
        return self.renewed_at is not None and (
            self.clock() - self.renewed_at < self.options.renew_deadline_seconds
        )

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.options.retry_seconds):
            try:
                ok = self.try_once()
            except Exception as err:
                log.warning("lease renewal failed: %s", err)
                ok = False
            if ok:
                continue
            holder = self.sighting.record[0] if self.sighting.record else None
            if holder and holder != self.identity:
                self.on_lost(f"the lease is held by {holder}")
                return
            if not self.leading():
                self.on_lost(f"lease not renewed for {self.options.renew_deadline_seconds:g}s")
                return

    def release(self) -> None:
        """On a clean shutdown: give the Lease up so a standby takes over at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.options.retry_seconds + 1)
        try:
            record = self._read()
            if record is not None and record.holder == self.identity:
                body = self._body(record.transitions, record.resource_version, acquired=False)
                body["spec"]["holderIdentity"] = None
                self._write(body)
                log.info("released the lease")
        except Exception as err:
            log.warning("could not release the lease: %s", err)


def _exit_lost(reason: str) -> None:
    log.critical("leadership lost (%s): stopping at once", reason)
    logging.shutdown()
    os._exit(EXIT_LEADERSHIP_LOST)
