"""Kueue: admission by quota for RLJobs that name a LocalQueue (label `kueue.x-k8s.io/queue-name`).

Kueue's supported way for a job kind it has no built-in integration for is an external controller that
does what Kueue's job framework does for its own kinds (site/content/en/docs/tasks/dev/
integrate_a_custom_job.md; pkg/controller/jobframework/reconciler.go@v0.17.0). The operator is that
controller for RLJobs. Kueue admits, preempts and requeues; this module speaks its Workload protocol:

- one Workload per RLJob, owned by it (controller ownerReference), with ONE pod set: `replicas` pods of
  the gang's pod spec (agent sidecar included), so Kueue reserves the quota of the whole gang at once or
  not at all (ConstructWorkload, reconciler.go:1375);
- the gang is created only while the Workload is Admitted (reconciler.go:621, step 7);
- Evicted (preemption, a stopped ClusterQueue, deactivation): the job stops its pods; once none is left
  the owner clears the quota reservation, with the Requeued condition set as the job framework sets it
  (reconciler.go:580-600: Requeued=True for Preempted/NodeFailures, QuotaReserved=False reason Pending,
  no status.admission, Admitted=False); Kueue then queues it again;
- spec.suspend is mirrored to spec.active (JobWithCustomWorkloadActivation, reconciler.go:450): a user
  suspend gives the quota back, a resume queues again;
- a finished job whose pods are gone sets Finished (workload.Finish, reconciler.go:487), which releases
  its quota.

Status writes are JSON merge patches carrying the resourceVersion read: a concurrent write by Kueue makes
ours fail with 409 and it is retried from a fresh read, never applied over Kueue's.
The functions below are pure; `Workloads` is the client (the only API calls to Kueue's objects).
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from rljob.api.crd import GROUP as RLJOB_GROUP
from rljob.api.crd import KIND as RLJOB_KIND
from rljob.api.spec import RLJobSpec
from rljob.api.status import Phase, RLJobStatus
from rljob.controller.children import LABEL_JOB, owner_reference
from rljob.kubeclient.apiserver import MERGE_PATCH, ApiError, ApiServer
from rljob.lifecycle.model import Admission

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # what Kueue's job framework labels its Workloads with
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
PLURAL = "workloads"
POD_SET = "main"  # kueue.DefaultPodSetName
# Kueue's own limit for generated names (they are used as label values): pkg/controller/jobframework/
# workload_names.go:33-41@v0.17.0.
MAX_NAME = 63
HASH_LENGTH = 5

QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
REQUEUED = "Requeued"
FINISHED = "Finished"
PODS_READY = "PodsReady"
# Eviction reasons after which Kueue's job framework marks the workload Requeued=True (reconciler.go:590).
REQUEUED_REASONS = ("Preempted", "NodeFailures")


@dataclass(frozen=True)
class AdmissionView:
    admission: Admission
    workload: str = ""
    message: str = ""  # for status.message and the Queued condition; names the workload and queue
    reason: str = ""  # Kueue's reason (e.g. Preempted, Pending, Inadmissible)


def queue_name(body: Mapping[str, Any]) -> str | None:
    labels = (body.get("metadata") or {}).get("labels") or {}
    value = labels.get(QUEUE_LABEL)
    return str(value) if value else None


@dataclass(frozen=True)
class JobFacts:
    """What a round did, as the job's Workload follows it (JobQueue.settle)."""

    queue: str  # the LocalQueue the job names
    phase: Phase
    message: str  # status.message: a finished Workload's Finished message
    suspend: bool  # spec.suspend: spec.active is its opposite
    pods_left: int  # pods seen by the round, before its deletions
    pods_ready: bool  # every pod of the gang is running and ready (PodsReady)


def job_facts(
    body: Mapping[str, Any], spec: RLJobSpec | None, status: RLJobStatus, pods_left: int
) -> JobFacts | None:
    """The facts of a job that names a queue (None otherwise): `spec` as last parsed (None while it is
    invalid), `status` the decision's."""
    queue = queue_name(body)
    if queue is None:
        return None
    ready = status.replicas > 0 and status.ready_replicas == status.replicas
    suspend = spec is not None and spec.suspend
    return JobFacts(queue, status.phase, status.message or "", suspend, pods_left, ready)


def workload_name(job: str, uid: str, kind: str = RLJOB_KIND, group: str = RLJOB_GROUP) -> str:
    """Kueue's naming scheme for a job's Workload (GetWorkloadNameForOwnerWithGVK, workload_names.go:64-100):
    `rljob-<name>-<hash>`, the hash (sha1) over kind, group, name and uid, the prefix truncated so the name
    fits 63 characters."""
    digest = hashlib.sha1(f"{kind}\n{group}\n{job}\n{uid}".encode()).hexdigest()
    prefix = f"{kind.lower()}-{job}"[: MAX_NAME - 1 - HASH_LENGTH]
    return f"{prefix}-{digest[:HASH_LENGTH]}"


def workload_manifest(
    job: str, uid: str, namespace: str, queue: str, replicas: int, pod: Mapping[str, Any], active: bool
) -> dict[str, Any]:
    """The Workload of an RLJob: one pod set of `replicas` copies of `pod` (a gang pod's manifest, the
    agent sidecar included), so Kueue reserves every pod's requests at once."""
    template = {
        "metadata": {"labels": dict((pod.get("metadata") or {}).get("labels") or {})},
        "spec": copy.deepcopy(pod["spec"]),
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(job, uid),
            "namespace": namespace,
            "labels": {LABEL_JOB: job, JOB_UID_LABEL: uid},
            "ownerReferences": [owner_reference(job, uid)],
        },
        "spec": {
            "queueName": queue,
            "active": active,
            "podSets": [{"name": POD_SET, "count": replicas, "template": template}],
        },
    }


def condition(workload: Mapping[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for cond in ((workload or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == type_:
            return dict(cond)
    return None


def is_true(workload: Mapping[str, Any] | None, type_: str) -> bool:
    cond = condition(workload, type_)
    return cond is not None and cond.get("status") == "True"


def admission_of(queue: str | None, workload: Mapping[str, Any] | None) -> AdmissionView:
    """The lifecycle's view of the job's Workload. A finished Workload admits nothing more: a job that
    continues after it (iterations raised) waits for a new one."""
    if queue is None:
        return AdmissionView(Admission.NOT_QUEUED)
    if workload is None:
        return AdmissionView(Admission.PENDING, "", f"queued in LocalQueue {queue}: creating its Workload")
    name = workload["metadata"]["name"]
    where = f"Workload {name} in LocalQueue {queue}"
    evicted = condition(workload, EVICTED)
    if evicted is not None and evicted.get("status") == "True" and is_true(workload, QUOTA_RESERVED):
        reason = str(evicted.get("reason") or EVICTED)
        message = f"{where} evicted ({reason}): {evicted.get('message', '')}"
        return AdmissionView(Admission.EVICTED, name, message, reason)
    if is_true(workload, ADMITTED) and not is_true(workload, FINISHED):
        cq = ((workload.get("status") or {}).get("admission") or {}).get("clusterQueue", "")
        return AdmissionView(Admission.ADMITTED, name, f"{where} admitted by ClusterQueue {cq}", ADMITTED)
    if is_true(workload, FINISHED):
        return AdmissionView(Admission.PENDING, name, f"{where} is finished: queueing a new one", FINISHED)
    reserved = condition(workload, QUOTA_RESERVED) or {}
    why = str(reserved.get("message") or "waiting for quota")
    if not (workload.get("spec") or {}).get("active", True):
        why = "deactivated (the job is suspended)"
    return AdmissionView(Admission.PENDING, name, f"{where}: {why}", str(reserved.get("reason") or "Pending"))


def _stamp(now: datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%SZ")


def _set_condition(
    conditions: list[dict[str, Any]], type_: str, status: bool, reason: str, message: str, now: str, gen: int
) -> None:
    """apimeta.SetStatusCondition: lastTransitionTime moves only when the status changes."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.get("type") == type_), None)
    new = {
        "type": type_,
        "status": value,
        "reason": reason,
        "message": message[:32768],
        "observedGeneration": gen,
        "lastTransitionTime": old["lastTransitionTime"] if old and old.get("status") == value else now,
    }
    if old is None:
        conditions.append(new)
    else:
        conditions[conditions.index(old)] = new


def _status_patch(workload: Mapping[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": workload["metadata"]["resourceVersion"]}, "status": status}


def release_patch(workload: Mapping[str, Any], now: datetime) -> dict[str, Any] | None:
    """The job stopped after an eviction (no pod left): give the quota back as Kueue's job framework does
    (reconciler.go:587-600; workload.UnsetQuotaReservationWithCondition, SyncAdmittedCondition). None
    when there is nothing to release."""
    evicted = condition(workload, EVICTED)
    if evicted is None or evicted.get("status") != "True" or not is_true(workload, QUOTA_RESERVED):
        return None
    stamp, gen = _stamp(now), int(workload["metadata"].get("generation") or 1)
    reason, message = str(evicted.get("reason") or EVICTED), str(evicted.get("message") or "")
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    _set_condition(conditions, REQUEUED, reason in REQUEUED_REASONS, reason, message, stamp, gen)
    _set_condition(conditions, QUOTA_RESERVED, False, "Pending", message, stamp, gen)
    status: dict[str, Any] = {"admission": None, "conditions": conditions}
    admitted = condition(workload, ADMITTED)
    if admitted is not None and admitted.get("status") == "True":
        # The admitted time is accumulated as Kueue does when Admitted turns False (admissionchecks.go:73).
        since = datetime.fromisoformat(str(admitted["lastTransitionTime"]).replace("Z", "+00:00"))
        past = int((workload.get("status") or {}).get("accumulatedPastExecutionTimeSeconds") or 0)
        status["accumulatedPastExecutionTimeSeconds"] = past + max(0, int((now - since).total_seconds()))
        _set_condition(
            conditions, ADMITTED, False, "NoReservation", "The workload has no reservation", stamp, gen
        )
    return _status_patch(workload, status)


def finish_patch(
    workload: Mapping[str, Any], succeeded: bool, message: str, now: str
) -> dict[str, Any] | None:
    """The job finished and none of its pods is left: Finished releases the quota (workload.Finish)."""
    if is_true(workload, FINISHED):
        return None
    gen = int(workload["metadata"].get("generation") or 1)
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    reason = "Succeeded" if succeeded else "Failed"
    _set_condition(conditions, FINISHED, True, reason, message or reason, now, gen)
    return _status_patch(workload, {"conditions": conditions})


def pods_ready_patch(workload: Mapping[str, Any], ready: bool, now: datetime) -> dict[str, Any] | None:
    """Kueue's PodsReady condition, as its job framework writes it (generatePodsReadyCondition,
    reconciler.go:1611-1669): Kueue's waitForPodsReady (all-or-nothing with ready pods: block other
    admissions until the gang is up, evict it after a timeout) waits for it. `ready`: every pod of the
    gang is running and ready. None when the condition already says so (or says nothing yet and the
    gang is not ready: no write for every pending job)."""
    old = condition(workload, PODS_READY)
    if ready and is_true(workload, ADMITTED):
        recovered = old is not None and old.get("reason") in ("WaitForRecovery", "Recovered")
        want = (
            True,
            "Recovered" if recovered else "Started",
            "All pods reached readiness and the workload is running",
        )
    elif (
        old is not None
        and is_true(workload, ADMITTED)
        and (old.get("status") == "True" or old.get("reason") == "WaitForRecovery")
    ):
        want = (False, "WaitForRecovery", "At least one pod has failed, waiting for recovery")
    else:
        want = (False, "WaitForStart", "Not all pods are ready or succeeded")
    if old is None and not want[0]:
        return None
    if (
        old is not None
        and old.get("status") == ("True" if want[0] else "False")
        and old.get("reason") == want[1]
    ):
        return None
    conditions = [dict(c) for c in (workload.get("status") or {}).get("conditions") or []]
    gen = int(workload["metadata"].get("generation") or 1)
    _set_condition(conditions, PODS_READY, want[0], want[1], want[2], _stamp(now), gen)
    return _status_patch(workload, {"conditions": conditions})


def spec_patch(workload: Mapping[str, Any], queue: str, active: bool) -> dict[str, Any] | None:
    """spec.active follows the RLJob's suspend; the queue name follows its label while no quota is
    reserved (Kueue refuses the change after that: the Workload CRD's CEL)."""
    spec = workload.get("spec") or {}
    patch: dict[str, Any] = {}
    if bool(spec.get("active", True)) != active:
        patch["active"] = active
    if spec.get("queueName") != queue and not is_true(workload, QUOTA_RESERVED):
        patch["queueName"] = queue
    return {"spec": patch} if patch else None


class Workloads:
    """The Kueue client: Workloads of RLJobs (get, create, delete, merge patches of spec and status)."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server

    @staticmethod
    def _path(namespace: str, name: str = "") -> str:
        return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}" + (f"/{name}" if name else "")

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            answer = await self.server.call("get_workload", "GET", self._path(namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise
        got: dict[str, Any] = json.loads(answer)
        return got

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """The created Workload; None when one of that name exists already (read it back)."""
        path = self._path(manifest["metadata"]["namespace"])
        try:
            answer = await self.server.call("create_workload", "POST", path, manifest)
        except ApiError as err:
            if err.status == 409:
                return None
            raise
        created: dict[str, Any] = json.loads(answer)
        return created

    async def delete(self, namespace: str, name: str) -> None:
        try:
            await self.server.call("delete_workload", "DELETE", self._path(namespace, name))
        except ApiError as err:
            if err.status != 404:
                raise

    async def patch(
        self, namespace: str, name: str, patch: dict[str, Any], status: bool
    ) -> dict[str, Any] | None:
        """A JSON merge patch (of the status subresource with `status`). None on 409/404: the Workload
        changed or went since it was read; the caller reads it again."""
        path = self._path(namespace, name) + ("/status" if status else "")
        verb = "patch_workload_status" if status else "patch_workload"
        try:
            answer = await self.server.call(verb, "PATCH", path, patch, content_type=MERGE_PATCH)
        except ApiError as err:
            if err.status in (404, 409):
                return None
            raise
        patched: dict[str, Any] = json.loads(answer)
        return patched


def _resource_version(workload: Mapping[str, Any] | None) -> int:
    try:
        return int((workload or {}).get("metadata", {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


class JobQueue:
    """One RLJob's Workload as its conductor follows it: created when the job is queued, kept current
    from the watch (`seen`) with a re-read now and then, and told what the job did (`settle`)."""

    REREAD_SECONDS = 10.0  # a missed watch event costs at most this much delay

    def __init__(
        self,
        workloads: Workloads,
        namespace: str,
        job: str,
        uid: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workloads = workloads
        self.namespace = namespace
        self.job = job
        self.uid = uid
        self.name = workload_name(job, uid)
        self.clock = clock
        self.workload: dict[str, Any] | None = None
        self._read_at: float | None = None  # None: never read (or a write lost a race): read first

    def seen(self, workload: Mapping[str, Any] | None, deleted: bool = False) -> None:
        """A watch event for this job's Workload."""
        if workload is None or (workload.get("metadata") or {}).get("name") != self.name:
            return
        if deleted:
            if self.workload is not None and self.workload["metadata"].get("uid") == workload["metadata"].get(
                "uid"
            ):
                self.workload = None
            return
        if _resource_version(workload) >= _resource_version(self.workload):
            self.workload = dict(workload)
            self._read_at = self.clock()

    def _store(self, workload: dict[str, Any] | None) -> None:
        if workload is None:  # a conflict or a 404: what we hold is stale
            self._read_at = None
        else:
            self.workload = workload
            self._read_at = self.clock()

    async def admission(
        self, queue: str | None, manifest: Callable[[], dict[str, Any]] | None, finished: bool
    ) -> AdmissionView:
        """The admission the lifecycle sees this round. Creates the Workload of a queued job that has
        none (`manifest`: its Workload; None while the spec is invalid), except for a finished job."""
        if queue is None:
            return AdmissionView(Admission.NOT_QUEUED)
        now = self.clock()
        if self._read_at is None or now - self._read_at > self.REREAD_SECONDS:
            self.workload, self._read_at = await self.workloads.get(self.namespace, self.name), now
        if self.workload is None and manifest is not None and not finished:
            try:
                created = await self.workloads.create(manifest())
                self._store(created or await self.workloads.get(self.namespace, self.name))
            except ApiError as err:  # Kueue not installed (404), no RBAC (403), refused (422)
                why = f"cannot create Workload {self.name}: HTTP {err.status} {err.reason}"
                return AdmissionView(Admission.PENDING, self.name, f"queued in LocalQueue {queue}: {why}")
        return admission_of(queue, self.workload)

    async def admit(
        self,
        body: Mapping[str, Any],
        spec: RLJobSpec | None,
        status: RLJobStatus,
        pod: Callable[[RLJobSpec, int, int], dict[str, Any]],
    ) -> AdmissionView:
        """Kueue's word on the job whose RLJob is `body` (`spec`: None while it is invalid), its Workload
        made from `pod(spec, index, gang)` when it has none."""
        queue = queue_name(body)
        if queue is None:
            return AdmissionView(Admission.NOT_QUEUED)

        def manifest() -> dict[str, Any]:
            assert spec is not None and queue is not None
            one = pod(spec, 0, status.restarts)
            return workload_manifest(
                self.job, self.uid, self.namespace, queue, spec.replicas, one, active=not spec.suspend
            )

        return await self.admission(queue, manifest if spec else None, status.phase.terminal)

    async def settle(self, job: JobFacts | None) -> bool:
        """After the round's effects (`job`: None for a job that names no queue): spec.active follows
        suspend; with no pod left, a Suspended job gives back quota Kueue evicted and a finished job
        finishes its Workload; else PodsReady follows the gang. A job that continues after its Workload
        finished (iterations raised) gets a new one next round. True when it wrote: the next round may
        have more to settle."""
        wl = self.workload
        if job is None or wl is None:
            return False
        phase = job.phase
        patch = spec_patch(wl, job.queue, active=not job.suspend)
        if patch is not None:
            self._store(await self.workloads.patch(self.namespace, self.name, patch, status=False))
            return True  # settle the status from the patched object next round
        status: dict[str, Any] | None = None
        if job.pods_left == 0 and phase == Phase.SUSPENDED:
            status = release_patch(wl, datetime.now(UTC))
        elif job.pods_left == 0 and phase.terminal:
            status = finish_patch(wl, phase == Phase.SUCCEEDED, job.message, _stamp(datetime.now(UTC)))
        elif not phase.terminal:
            status = pods_ready_patch(wl, job.pods_ready, datetime.now(UTC))
        if status is not None:
            self._store(await self.workloads.patch(self.namespace, self.name, status, status=True))
            return True
        if is_true(wl, FINISHED) and not phase.terminal:
            await self.workloads.delete(self.namespace, self.name)
            self.workload, self._read_at = None, self.clock()
            return True
        return False
