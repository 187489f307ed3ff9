"""The Kueue Workload protocol of controller/queueing.py: the manifest, the admission the lifecycle sees,
and the status writes that give quota back (after an eviction) or finish the workload."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime
from typing import Any

import pytest

from rljob.api.spec import RLJobSpec
from rljob.api.status import Phase, RLJobStatus
from rljob.controller import queueing as q

NOW = datetime(2026, 12, 1, 10, 0, 30, tzinfo=UTC)
UID = "0a1b2c3d-0000-4000-8000-000000000001"


def cond(
    type_: str, status: str, reason: str, message: str = "", at: str = "2026-12-01T10:00:00Z"
) -> dict[str, Any]:
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": at,
        "observedGeneration": 1,
    }


def workload(*conditions: dict[str, Any], admission: bool = False, active: bool = True) -> dict[str, Any]:
    status: dict[str, Any] = {"conditions": list(conditions)}
    if admission:
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [{"name": "main", "count": 2}]}
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "Workload",
        "metadata": {"name": "rljob-a-12345", "namespace": "ns", "resourceVersion": "42", "generation": 1},
        "spec": {"queueName": "lq", "active": active, "podSets": []},
        "status": status,
    }


ADMITTED = (
    cond("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
    cond("Admitted", "True", "Admitted", "The workload is admitted"),
)
PREEMPTED = cond(
    "Evicted", "True", "Preempted", "Preempted to accommodate a workload", "2026-12-01T10:00:20Z"
)


def test_workload_name_follows_kueues_scheme() -> None:
    name = q.workload_name("a", UID)
    assert name.startswith("rljob-a-") and len(name) == len("rljob-a-") + 5
    assert name == q.workload_name("a", UID)
    assert name != q.workload_name("a", UID.replace("1", "2"))  # the uid is in the hash
    long = q.workload_name("x" * 63, UID)
    assert len(long) == 63 and long.startswith("rljob-xxx")


def test_manifest_is_one_pod_set_of_the_whole_gang_owned_by_the_job() -> None:
    pod = {
        "metadata": {"name": "a-0", "labels": {"rljob.io/job": "a"}},
        "spec": {"containers": [{"name": "sglang", "resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
    }
    wl = q.workload_manifest("a", UID, "ns", "lq", 4, pod, active=True)
    assert wl["metadata"]["name"] == q.workload_name("a", UID)
    assert (
        wl["metadata"]["ownerReferences"][0] | {"kind": "RLJob", "name": "a", "uid": UID, "controller": True}
        == (wl["metadata"]["ownerReferences"][0])
    )
    assert wl["metadata"]["labels"] == {"rljob.io/job": "a", q.JOB_UID_LABEL: UID}
    (pod_set,) = wl["spec"]["podSets"]
    assert pod_set["name"] == "main" and pod_set["count"] == 4
    assert pod_set["template"]["spec"] == pod["spec"] and pod_set["template"]["spec"] is not pod["spec"]
    assert wl["spec"]["queueName"] == "lq" and wl["spec"]["active"] is True


@pytest.mark.parametrize(
    ("wl", "expected", "in_message"),
    [
        (None, q.Admission.PENDING, "creating its Workload"),
        (
            workload(
                cond("QuotaReserved", "False", "Pending", "insufficient unused quota for nvidia.com/gpu")
            ),
            q.Admission.PENDING,
            "insufficient unused quota",
        ),
        (workload(*ADMITTED, admission=True), q.Admission.ADMITTED, "admitted by ClusterQueue cq"),
        (workload(*ADMITTED, PREEMPTED, admission=True), q.Admission.EVICTED, "evicted (Preempted)"),
        # Released after the eviction: Evicted stays True until Kueue admits it again.
        (
            workload(
                cond("QuotaReserved", "False", "Pending"),
                cond("Admitted", "False", "NoReservation"),
                PREEMPTED,
            ),
            q.Admission.PENDING,
            "rljob-a-12345 in LocalQueue lq",
        ),
        (workload(*ADMITTED, cond("Finished", "True", "Succeeded")), q.Admission.PENDING, "finished"),
        (workload(active=False), q.Admission.PENDING, "deactivated"),
    ],
)
def test_admission_seen_by_the_lifecycle(
    wl: dict[str, Any] | None, expected: q.Admission, in_message: str
) -> None:
    view = q.admission_of("lq", wl)
    assert view.admission == expected
    assert in_message in view.message


def test_no_queue_label_means_kueue_is_not_involved() -> None:
    assert q.admission_of(None, workload(*ADMITTED)).admission == q.Admission.NOT_QUEUED
    assert q.queue_name({"metadata": {"labels": {q.QUEUE_LABEL: "lq"}}}) == "lq"
    assert q.queue_name({"metadata": {"labels": {}}}) is None


def test_release_after_preemption_is_what_kueues_job_framework_writes() -> None:
    evicted = workload(*ADMITTED, PREEMPTED, admission=True)
    before = copy.deepcopy(evicted)
    patch = q.release_patch(evicted, NOW)
    assert evicted == before  # pure
    assert patch is not None
    assert patch["metadata"] == {"resourceVersion": "42"}  # optimistic concurrency against Kueue's writes
    status = patch["status"]
    assert status["admission"] is None
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False" and by_type["QuotaReserved"]["reason"] == "Pending"
    assert by_type["QuotaReserved"]["lastTransitionTime"] == "2026-12-01T10:00:30Z"
    assert by_type["Admitted"]["status"] == "False" and by_type["Admitted"]["reason"] == "NoReservation"
    assert by_type["Requeued"]["status"] == "True" and by_type["Requeued"]["reason"] == "Preempted"
    assert by_type["Evicted"] == PREEMPTED  # Kueue resets it when it admits again
    assert status["accumulatedPastExecutionTimeSeconds"] == 30


def test_release_after_deactivation_does_not_requeue() -> None:
    deactivated = cond("Evicted", "True", "Deactivated", "The workload is deactivated")
    patch = q.release_patch(workload(*ADMITTED, deactivated, admission=True), NOW)
    assert patch is not None
    requeued = next(c for c in patch["status"]["conditions"] if c["type"] == "Requeued")
    assert requeued["status"] == "False" and requeued["reason"] == "Deactivated"


def test_nothing_to_release_without_an_eviction_or_a_reservation() -> None:
    assert q.release_patch(workload(*ADMITTED, admission=True), NOW) is None
    released = workload(cond("QuotaReserved", "False", "Pending"), PREEMPTED)
    assert q.release_patch(released, NOW) is None


def test_finish_once() -> None:
    patch = q.finish_patch(
        workload(*ADMITTED, admission=True), True, "3 iterations done", "2026-12-01T10:01:00Z"
    )
    assert patch is not None
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert finished["status"] == "True" and finished["reason"] == "Succeeded"
    assert finished["message"] == "3 iterations done"
    failed = q.finish_patch(workload(*ADMITTED), False, "", "2026-12-01T10:01:00Z")
    assert failed is not None and {c["type"]: c for c in failed["status"]["conditions"]}["Finished"][
        "reason"
    ] == ("Failed")
    assert q.finish_patch(workload(cond("Finished", "True", "Succeeded")), True, "", "t") is None


def test_spec_follows_suspend_and_the_queue_label() -> None:
    assert q.spec_patch(workload(), "lq", active=True) is None
    assert q.spec_patch(workload(), "lq", active=False) == {"spec": {"active": False}}
    assert q.spec_patch(workload(), "other", active=True) == {"spec": {"queueName": "other"}}
    # Kueue's CEL refuses a queue change while quota is reserved: only `active` is patched then.
    assert q.spec_patch(workload(*ADMITTED), "other", active=False) == {"spec": {"active": False}}


def test_pods_ready_follows_the_gang_as_kueues_job_framework_writes_it() -> None:
    admitted = workload(*ADMITTED, admission=True)
    assert q.pods_ready_patch(admitted, False, NOW) is None  # nothing said yet: no write per pending job
    started = q.pods_ready_patch(admitted, True, NOW)
    assert started is not None
    ready = next(c for c in started["status"]["conditions"] if c["type"] == "PodsReady")
    assert (ready["status"], ready["reason"]) == ("True", "Started")
    running = workload(*ADMITTED, ready, admission=True)
    assert q.pods_ready_patch(running, True, NOW) is None  # unchanged: no write
    lost = q.pods_ready_patch(running, False, NOW)  # a member lost: the gang restarts
    assert lost is not None
    waiting = next(c for c in lost["status"]["conditions"] if c["type"] == "PodsReady")
    assert (waiting["status"], waiting["reason"]) == ("False", "WaitForRecovery")
    back = q.pods_ready_patch(workload(*ADMITTED, waiting, admission=True), True, NOW)
    assert back is not None
    assert {c["type"]: c["reason"] for c in back["status"]["conditions"]}["PodsReady"] == "Recovered"
    # Not admitted (evicted and released): not ready, waiting for a start again.
    released = workload(cond("QuotaReserved", "False", "Pending"), ready)
    stopped = q.pods_ready_patch(released, False, NOW)
    assert stopped is not None
    assert {c["type"]: c["reason"] for c in stopped["status"]["conditions"]}["PodsReady"] == "WaitForStart"


class FakeWorkloads:
    """The Kueue client's calls, against one in-memory Workload."""

    def __init__(self) -> None:
        self.stored: dict[str, Any] | None = None
        self.calls: list[str] = []
        self.conflict_next = False

    async def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.calls.append("get")
        return copy.deepcopy(self.stored)

    async def create(self, manifest: dict[str, Any]) -> dict[str, Any] | None:
        self.calls.append("create")
        self.stored = copy.deepcopy(manifest) | {"status": {}}
        self.stored["metadata"] |= {"resourceVersion": "1", "generation": 1, "uid": "wl-uid"}
        return copy.deepcopy(self.stored)

    async def delete(self, namespace: str, name: str) -> None:
        self.calls.append("delete")
        self.stored = None

    async def patch(
        self, namespace: str, name: str, patch: dict[str, Any], status: bool
    ) -> dict[str, Any] | None:
        self.calls.append("patch_status" if status else "patch")
        assert self.stored is not None
        if self.conflict_next:
            self.conflict_next = False
            return None
        part = "status" if status else "spec"
        self.stored[part] = {**self.stored.get(part, {}), **patch[part]}
        self.stored[part] = {k: v for k, v in self.stored[part].items() if v is not None}
        self.stored["metadata"]["resourceVersion"] = str(int(self.stored["metadata"]["resourceVersion"]) + 1)
        return copy.deepcopy(self.stored)


def manifest() -> dict[str, Any]:
    pod = {"metadata": {"labels": {}}, "spec": {"containers": [{"name": "sglang"}]}}
    return q.workload_manifest("job", UID, "ns", "lq", 2, pod, active=True)


def facts(
    phase: Phase, message: str = "", suspend: bool = False, pods_left: int = 0, pods_ready: bool = False
) -> q.JobFacts:
    return q.JobFacts("lq", phase, message, suspend, pods_left, pods_ready)


def test_job_queue_creates_once_gives_quota_back_after_eviction_and_finishes() -> None:
    fake = FakeWorkloads()
    jq = q.JobQueue(fake, "ns", "job", UID, clock=lambda: 0.0)  # type: ignore[arg-type]

    async def run() -> None:
        view = await jq.admission("lq", manifest, finished=False)
        assert view.admission == q.Admission.PENDING and fake.calls == ["get", "create"]
        assert (await jq.admission("lq", manifest, finished=False)).admission == q.Admission.PENDING
        assert fake.calls == ["get", "create"]  # no second read within REREAD_SECONDS, no second create
        # Kueue admits, then preempts it (watch events).
        assert fake.stored is not None
        fake.stored["status"] = {"conditions": list(ADMITTED), "admission": {"clusterQueue": "cq"}}
        fake.stored["metadata"]["resourceVersion"] = "5"
        jq.seen(copy.deepcopy(fake.stored))
        assert (await jq.admission("lq", manifest, finished=False)).admission == q.Admission.ADMITTED
        fake.stored["status"]["conditions"].append(PREEMPTED)
        fake.stored["metadata"]["resourceVersion"] = "6"
        jq.seen(copy.deepcopy(fake.stored))
        assert (await jq.admission("lq", manifest, finished=False)).admission == q.Admission.EVICTED
        # Pods still there: no release yet.
        await jq.settle(facts(Phase.SUSPENDING, pods_left=2, pods_ready=True))
        assert fake.stored["status"].get("admission")  # pods still there: the quota is kept
        fake.calls.clear()
        await jq.settle(facts(Phase.SUSPENDED))
        assert fake.calls == ["patch_status"]
        assert "admission" not in fake.stored["status"]
        assert q.condition(fake.stored, "QuotaReserved")["status"] == "False"  # type: ignore[index]
        # A lost race with Kueue: nothing applied, the Workload is read again before the next decision.
        fake.stored["status"]["conditions"] = list(ADMITTED)
        jq.seen(copy.deepcopy(fake.stored))
        fake.conflict_next = True
        fake.calls.clear()
        await jq.settle(facts(Phase.SUCCEEDED, "done"))
        assert fake.calls == ["patch_status"] and not q.is_true(fake.stored, "Finished")
        await jq.admission("lq", manifest, finished=True)
        assert fake.calls[-1] == "get"
        await jq.settle(facts(Phase.SUCCEEDED, "done"))
        assert q.is_true(fake.stored, "Finished")
        # The job continues (iterations raised): the finished Workload goes, a new one is made next round.
        jq.seen(copy.deepcopy(fake.stored))
        await jq.settle(facts(Phase.PENDING))
        assert fake.calls[-1] == "delete" and fake.stored is None
        await jq.admission("lq", manifest, finished=False)
        assert fake.calls[-1] == "create"

    asyncio.run(run())


def test_job_queue_mirrors_suspend_to_active() -> None:
    fake = FakeWorkloads()
    jq = q.JobQueue(fake, "ns", "job", UID, clock=lambda: 0.0)  # type: ignore[arg-type]

    async def run() -> None:
        await jq.admission("lq", manifest, finished=False)
        await jq.settle(facts(Phase.SUSPENDED, suspend=True))
        assert fake.stored is not None and fake.stored["spec"]["active"] is False
        await jq.settle(facts(Phase.PENDING))
        assert fake.stored["spec"]["active"] is True

    asyncio.run(run())


def test_no_queue_label_touches_nothing() -> None:
    fake = FakeWorkloads()
    jq = q.JobQueue(fake, "ns", "job", UID)  # type: ignore[arg-type]
    assert asyncio.run(jq.admission(None, manifest, finished=False)).admission == q.Admission.NOT_QUEUED
    assert fake.calls == []


def test_a_rounds_facts_for_kueue() -> None:
    """job_facts: none for a job that names no queue; the gang is ready only when every pod is; suspend
    is the spec's, false while the spec is invalid."""
    spec = RLJobSpec.model_validate(
        {
            "replicas": 2,
            "suspend": True,
            "template": {"spec": {"containers": [{"name": "sglang"}, {"name": "trainer"}]}},
            "weights": {"initialVersion": "0", "initialPath": "/m"},
        }
    )
    queued = {"metadata": {"labels": {q.QUEUE_LABEL: "lq"}}}
    status = RLJobStatus(phase=Phase.ROLLOUT, replicas=2, ready_replicas=1, message="m")
    assert q.job_facts({"metadata": {}}, spec, status, 2) is None
    assert q.job_facts(queued, spec, status, 2) == q.JobFacts("lq", Phase.ROLLOUT, "m", True, 2, False)
    ready = status.model_copy(update={"ready_replicas": 2, "message": None})
    assert q.job_facts(queued, None, ready, 2) == q.JobFacts("lq", Phase.ROLLOUT, "", False, 2, True)
    none = RLJobStatus(phase=Phase.PENDING)
    assert q.job_facts(queued, spec, none, 0) == q.JobFacts("lq", Phase.PENDING, "", True, 0, False)
