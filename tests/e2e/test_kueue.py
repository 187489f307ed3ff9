"""Kueue (built from Go modules, hack/build-kueue.sh) against the local control plane: the test world's
Kueue runs and admits by quota, all pods of a workload at once or none."""

from __future__ import annotations

import contextlib
import copy
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.controller import queueing
from rljob.testing import kueue as kq
from rljob.testing.cluster import ControlPlaneError, ensure_binaries
from rljob.testing.harness import ROOT, OperatorProcess, get_rljob, wait_rljob
from rljob.testing.install import HelmError, install_chart, operator_kubeconfig, uninstall_chart
from rljob.testing.kubeaccess import ApiError, KubeApi, Kubectl, delete_namespace, wait_for
from rljob.testing.pods import SIM_ARGS_ENV, rljob_mapping

REPO = Path(__file__).resolve().parents[2]


def test_kueue_pin_agrees_with_go_module() -> None:
    """The Python constant and the consumer module pin the same Kueue release."""
    gomod = (REPO / "hack/kueue/go.mod").read_text()
    assert re.search(rf"^\s*(require\s+)?sigs\.k8s\.io/kueue {kq.KUEUE_VERSION}\b", gomod, re.M)
    assert re.search(r"^tool sigs\.k8s\.io/kueue/cmd/kueue$", gomod, re.M)
    assert str(kq.kueue_binary()).endswith(f"kueue-{kq.KUEUE_VERSION}/kueue")


def test_manifests_come_from_the_module_renamed_like_kueues_kustomization() -> None:
    names = {c["metadata"]["name"]: c for c in kq.crds()}
    kinds = ("workloads", "clusterqueues", "localqueues", "resourceflavors", "workloadpriorityclasses")
    assert {f"{k}.kueue.x-k8s.io" for k in kinds} <= set(names)
    workload = names["workloads.kueue.x-k8s.io"]
    storage = [v["name"] for v in workload["spec"]["versions"] if v["storage"]]
    assert storage == ["v1beta2"] == [kq.API_VERSION.split("/")[1]]
    service = workload["spec"]["conversion"]["webhook"]["clientConfig"]["service"]
    assert service == {"namespace": "kueue-system", "name": "kueue-webhook-service", "path": "/convert"}
    assert "conversion" not in names["resourceflavors.kueue.x-k8s.io"]["spec"]
    rbac = {(o["kind"], o["metadata"]["name"]): o for o in kq.rbac()}
    binding = rbac[("ClusterRoleBinding", "kueue-manager-rolebinding")]
    assert binding["roleRef"]["name"] == "kueue-manager-role"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "kueue-controller-manager", "namespace": "kueue-system"}
    ]
    role = rbac[("ClusterRole", "kueue-manager-role")]
    workload_rules = [r for r in role["rules"] if "workloads/status" in r.get("resources", [])]
    assert workload_rules and "patch" in workload_rules[0]["verbs"]


@pytest.fixture(scope="module")
def kueue(admin_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[kq.LocalKueue]:
    try:
        kq.ensure_kueue_binary(build=True)
    except Exception as exc:
        pytest.fail(f"e2e needs the Kueue binary: {exc}", pytrace=False)
    # All-or-nothing with ready pods (Kueue's waitForPodsReady): while an admitted workload's pods are not
    # all ready, Kueue admits nothing else, and evicts it after the timeout. The RLJob tests pass only if
    # the operator reports PodsReady as Kueue's own job integrations do.
    pods_ready = {"waitForPodsReady": {"timeout": "3m", "blockAdmission": True}}
    with kq.LocalKueue(
        admin_kubeconfig, tmp_path_factory.mktemp("kueue"), extra_config=pods_ready
    ) as running:
        yield running


def queues(api: KubeApi, namespace: str, gpus: int) -> str:
    """A ResourceFlavor, a ClusterQueue with `gpus` GPUs for this namespace only, and its LocalQueue `lq`.
    Returns the ClusterQueue's name."""
    kq.apply(api, kq.resource_flavor())
    name = f"cq-{namespace}"[:63]
    selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    kq.apply(api, kq.cluster_queue(name, gpus, namespace_selector=selector))
    kq.apply(api, kq.local_queue(namespace, "lq", name))
    kq.cluster_queue_ready(api, name)
    return name


def raw_workload(namespace: str, name: str, pods: int, gpus_per_pod: int) -> dict[str, Any]:
    container = {"name": "c", "image": "none", "resources": {"limits": {kq.GPU: str(gpus_per_pod)}}}
    return {
        "apiVersion": kq.API_VERSION,
        "kind": "Workload",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "queueName": "lq",
            "podSets": [{"name": "main", "count": pods, "template": {"spec": {"containers": [container]}}}],
        },
    }


@pytest.mark.e2e
def test_kueue_admits_whole_workloads_by_gpu_quota(
    kueue: kq.LocalKueue, kube_api: KubeApi, namespace: str
) -> None:
    """4 GPUs of quota, two workloads of 3 pods x 1 GPU: one is admitted with all 3 pods, the other not at
    all (no partial admission), with Kueue's reason in its QuotaReserved condition."""
    assert kueue.running()
    queues(kube_api, namespace, gpus=4)
    try:
        for name in ("first", "second"):
            kq.apply(kube_api, raw_workload(namespace, name, pods=3, gpus_per_pod=1))
        check_all_or_nothing(kube_api, namespace)
    finally:  # no pod of these ever becomes ready: gone, they hold up no other test's admission
        for name in ("first", "second"):
            with contextlib.suppress(ApiError):
                kube_api.delete(f"/apis/{kq.API_VERSION}/namespaces/{namespace}/workloads/{name}")


def check_all_or_nothing(kube_api: KubeApi, namespace: str) -> None:
    def settled() -> list[dict[str, Any]] | None:
        items = kq.workloads(kube_api, namespace)
        return items if all(kq.condition(w, "QuotaReserved") for w in items) and len(items) == 2 else None

    items = {w["metadata"]["name"]: w for w in wait_for(settled, timeout=30, what="both workloads seen")}
    admitted = [n for n, w in items.items() if kq.is_true(w, "Admitted")]
    assert len(admitted) == 1, {n: w["status"] for n, w in items.items()}
    winner = items[admitted[0]]
    assignment = winner["status"]["admission"]["podSetAssignments"][0]
    assert assignment["count"] == 3 and assignment["resourceUsage"][kq.GPU] == "3"
    loser = items[({"first", "second"} - set(admitted)).pop()]
    waiting = kq.condition(loser, "QuotaReserved")
    assert waiting is not None and waiting["status"] == "False"
    assert f"insufficient unused quota for {kq.GPU}" in waiting["message"], waiting
    assert "admission" not in loser["status"]


# --- RLJobs under Kueue ------------------------------------------------------------------------------
EXAMPLE = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())


@pytest.fixture(scope="module")
def rljob_crd(kubectl: Kubectl) -> None:
    kubectl("apply", "-f", str(ROOT / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=30s")


@pytest.fixture
def operator_identity(
    admin_kubeconfig: Path, kube_api: KubeApi, namespace: str, rljob_crd: None, tmp_path: Path
) -> Iterator[Path]:
    """The chart installed with namespaced RBAC watching the test namespace, and a kubeconfig holding a
    token of the chart's ServiceAccount: the operator under Kueue has exactly the chart's rights, the
    Workload rules included (a missing verb is a 403 in the operator's log and a job that never runs)."""
    try:
        helm = ensure_binaries(build=True).helm
    except ControlPlaneError as exc:
        pytest.fail(f"the Kueue tests need helm: {exc}", pytrace=False)
    suffix = uuid.uuid4().hex[:6]  # the chart's names (release + "-metrics" ...) stay under 63 characters
    release, release_ns = f"rljob-{suffix}", f"rljob-system-{suffix}"
    install_chart(helm, admin_kubeconfig, release, release_ns, [namespace])
    try:
        yield operator_kubeconfig(kube_api, None, release_ns, tmp_path / "sa.kubeconfig")
    finally:
        with contextlib.suppress(HelmError):
            uninstall_chart(helm, admin_kubeconfig, release, release_ns)
        delete_namespace(kube_api, release_ns)


@dataclass
class Queued:
    """The operator, a fake kubelet and Kueue, for one test namespace."""

    api: KubeApi
    kubectl: Kubectl
    namespace: str
    operator: OperatorProcess
    scratch: Path  # the fake kubelet's scratch root

    def get(self, name: str) -> dict[str, Any]:
        return get_rljob(self.api, self.namespace, name)

    def wait(
        self, name: str, probe: Callable[[dict[str, Any]], bool], what: str, timeout: float = 120
    ) -> dict[str, Any]:
        return wait_rljob(
            self.api, self.namespace, name, probe, timeout, what, on_timeout=self.operator.log_tail
        )

    def pods(self, name: str) -> list[dict[str, Any]]:
        got = self.api.get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=f"rljob.io/job={name}")
        return list(got["items"])

    def events(self, name: str) -> list[dict[str, Any]]:
        got = self.api.get(
            f"/api/v1/namespaces/{self.namespace}/events", fieldSelector=f"involvedObject.name={name}"
        )
        return sorted(got["items"], key=lambda e: e.get("firstTimestamp") or "")

    def agent_log(self, pod: str, uid: str) -> str:
        """What the agent of that pod logged (the fake kubelet keeps its containers' logs)."""
        logs = list((self.scratch / self.namespace).glob(f"{pod}-{uid[:8]}/logs/rljob-agent.log"))
        assert len(logs) == 1, logs
        return logs[0].read_text(errors="replace")

    def workload(self, name: str) -> dict[str, Any]:
        workload = queueing.workload_name(name, self.get(name)["metadata"]["uid"])
        return self.api.get(f"/apis/{kq.API_VERSION}/namespaces/{self.namespace}/workloads/{workload}")


@pytest.fixture
def queued(
    kueue: kq.LocalKueue,
    operator_identity: Path,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Any,
    tmp_path: Path,
) -> Iterator[Queued]:
    kubelet_factory(mapping=rljob_mapping(), scratch_root=tmp_path / "kubelet")
    operator = OperatorProcess(operator_identity, [namespace], tmp_path / "operator.log").start()
    try:
        yield Queued(kube_api, kubectl, namespace, operator, tmp_path / "kubelet")
    finally:
        operator.stop()


def rljob(
    name: str, *, replicas: int = 2, iterations: int = 2, prompts: int = 4, sim_args: str = ""
) -> dict[str, Any]:
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"] = {"name": name, "labels": {queueing.QUEUE_LABEL: "lq"}}
    spec = manifest["spec"]
    spec.update(replicas=replicas, iterations=iterations)
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    sglang, trainer = spec["template"]["spec"]["containers"]
    sglang["env"] = [
        *sglang.get("env", []),
        {"name": SIM_ARGS_ENV, "value": f"--tokens-per-second 0 {sim_args}"},
    ]
    trainer["args"] = ["--prompts", str(prompts), "--samples-per-prompt", "2", "--train-seconds", "0.5"]
    return manifest


def phase_of(obj: dict[str, Any]) -> str:
    return str(obj.get("status", {}).get("phase", "Pending"))


def queued_condition(obj: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == "Queued"), None)


def versions(obj: dict[str, Any]) -> list[str]:
    return [w["version"] for w in obj["status"].get("weightHistory", [])]


@pytest.mark.e2e
def test_two_rljobs_over_the_gpu_quota_run_one_after_the_other(queued: Queued, kube_api: KubeApi) -> None:
    """3 GPUs of quota, two RLJobs of 2 pods x 1 GPU: the second waits with no pod and a Queued condition
    naming its Workload while the first runs to Succeeded, then runs itself."""
    queues(kube_api, queued.namespace, gpus=3)
    queued.kubectl.apply(rljob("first"), namespace=queued.namespace)
    queued.wait(
        "first",
        lambda o: phase_of(o) not in ("Pending", "Suspending", "Suspended"),
        "first admitted and started",
    )
    queued.kubectl.apply(rljob("second"), namespace=queued.namespace)
    # Kueue's own reason reaches the condition once Kueue has tried to admit it.
    waiting = queued.wait(
        "second",
        lambda o: (
            phase_of(o) == "Suspended" and "insufficient" in (queued_condition(o) or {}).get("message", "")
        ),
        "second queued with Kueue's reason",
    )
    cond = queued_condition(waiting)
    assert cond is not None and cond["status"] == "True" and cond["reason"] == "WaitingForQuota", cond
    workload = queued.workload("second")["metadata"]["name"]
    assert f"Workload {workload} in LocalQueue lq" in cond["message"], cond
    assert f"insufficient unused quota for {kq.GPU}" in cond["message"], cond
    assert waiting["status"]["reason"] == "WaitingForQuota" and queued.pods("second") == []
    # While the first runs, the second never has a pod.
    while phase_of(first := queued.get("first")) != "Succeeded":
        assert queued.pods("second") == []
        assert phase_of(first) != "Failed", first["status"]
        time.sleep(0.3)
    done = queued.wait("second", lambda o: phase_of(o) == "Succeeded", "second Succeeded", timeout=150)
    assert done["status"]["weightVersion"] == "2" and versions(done) == ["0", "1", "2"]
    assert kq.is_true(queued.workload("first"), "Finished")  # set once its pods were gone: quota released
    cond = queued_condition(done)
    assert cond is not None and cond["status"] == "False" and cond["reason"] == "Admitted", cond


def urgent_job(namespace: str, priority_class: str) -> dict[str, Any]:
    """A batch Job that Kueue's own batch/job integration admits: 1 GPU at high priority. Created
    suspended, as Kueue's Job webhook (not registered here) would make it."""
    container = {"name": "work", "image": "busybox", "command": ["sleep", "3"]}
    container["resources"] = {"limits": {kq.GPU: "1"}}
    labels = {queueing.QUEUE_LABEL: "lq", "kueue.x-k8s.io/priority-class": priority_class}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "urgent", "namespace": namespace, "labels": labels},
        "spec": {
            "suspend": True,
            "backoffLimit": 0,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        },
    }


@pytest.mark.e2e
def test_preempted_in_rollout_drains_keeps_its_weights_and_finishes_after_readmission(
    queued: Queued, kube_api: KubeApi
) -> None:
    """2 GPUs of quota, an RLJob of 2 pods in Rollout; a high-priority batch Job asks for 1 GPU: Kueue
    preempts the RLJob, which drains and releases its memory (every agent, verified) before Suspending
    deletes its pods, and keeps its
    committed weights; the Job runs; the RLJob is admitted again and finishes with a continuous weight
    history."""
    ns = queued.namespace
    queues(kube_api, ns, gpus=2)
    kq.apply(kube_api, kq.workload_priority_class("rljob-e2e-high", 1000))
    queued.kubectl.apply(
        rljob("low", iterations=3, prompts=20, sim_args="--tokens-per-second 100"), namespace=ns
    )
    queued.wait(
        "low",
        lambda o: o.get("status", {}).get("iteration", 0) >= 2 and phase_of(o) == "Rollout",
        "in rollout of iteration 2",
    )
    gang = {p["metadata"]["name"]: p["metadata"]["uid"] for p in queued.pods("low")}

    # The gang is up: PodsReady lets Kueue admit (here: preempt for) the next workload.
    def gang_ready() -> dict[str, Any] | None:
        return (
            kq.condition(queued.workload("low"), "PodsReady")
            if kq.is_true(queued.workload("low"), "PodsReady")
            else None
        )

    ready = wait_for(gang_ready, timeout=10, what="PodsReady on the RLJob's Workload")
    assert ready is not None and ready["reason"] == "Started", ready
    kube_api.post(f"/apis/batch/v1/namespaces/{ns}/jobs", urgent_job(ns, "rljob-e2e-high"))

    stopped = queued.wait("low", lambda o: phase_of(o) == "Suspended", "preempted and suspended", timeout=60)
    status = stopped["status"]
    kept = status["weightVersion"]
    assert kept in ("1", "2"), status  # an iteration that was committing when Kueue evicted commits first
    assert [w["version"] for w in status["weightHistory"]][-1] == kept
    phases = [s["phase"] for s in status["timeline"]]
    assert "Suspending" in phases and phases.index("Suspending") > phases.index("Rollout"), phases
    stop = len(phases) - 1 - phases[::-1].index("Suspending")
    assert phases[stop - 2 : stop] == ["Draining", "Releasing"], phases  # released before the pods went
    assert (status["timeline"][stop - 1].get("freedBytes") or 0) > 0, status["timeline"][stop - 1]
    assert status["reason"] in ("Evicted", "WaitingForQuota"), status
    # Events are posted off the lifecycle's path: they may trail the status by a moment.
    evicted = wait_for(
        lambda: [e for e in queued.events("low") if e["reason"] == "Evicted"],
        timeout=10,
        what="an Evicted event",
    )
    assert "(Preempted)" in evicted[0]["message"], evicted
    assert queued.pods("low") == []
    # Every agent of the gang drained, then released (the epochs before Suspending's), and that was the
    # last thing it did before its pod went (Suspending deletes the gang only once every agent verified).
    drained = f"command drain epoch={status['epoch'] - 2} succeeded"
    released = f"command release epoch={status['epoch'] - 1} succeeded"
    for name, uid in gang.items():
        log = queued.agent_log(name, uid)
        commands = [line for line in log.splitlines() if " command " in line and "accepted" not in line]
        assert len(commands) >= 2 and drained in commands[-2] and released in commands[-1], commands[-3:]

    # The Job Kueue admitted in the RLJob's place runs to completion (Kueue's own batch/job integration:
    # its Workload is named by the scheme queueing.workload_name follows).
    job = kube_api.get(f"/apis/batch/v1/namespaces/{ns}/jobs/urgent")
    job_workload = queueing.workload_name("urgent", job["metadata"]["uid"], kind="Job", group="batch")
    job_workload_path = f"/apis/{kq.API_VERSION}/namespaces/{ns}/workloads/{job_workload}"
    wait_for(
        lambda: kq.is_true(kube_api.get(job_workload_path), "Admitted"),
        timeout=30,
        what=f"the Job's Workload {job_workload} admitted once the RLJob gave its quota back",
    )

    def job_done() -> bool:
        job = kube_api.get(f"/apis/batch/v1/namespaces/{ns}/jobs/urgent")
        conditions = job.get("status", {}).get("conditions", [])
        return any(c["type"] == "Complete" and c["status"] == "True" for c in conditions)

    wait_for(job_done, timeout=60, what="the urgent Job completes")
    done = queued.wait(
        "low", lambda o: phase_of(o) == "Succeeded", "Succeeded after readmission", timeout=150
    )
    assert done["status"]["weightVersion"] == "3"
    assert versions(done) == ["0", "1", "2", "3"]  # continuous: resumed from the kept version
    assert done["status"]["restarts"] == 0  # an eviction is not a failure
    messages = [e["message"] for e in queued.events("low")]
    assert any(f"loading committed weights {kept}" in m for m in messages), messages
    workload = queued.workload("low")
    assert (kq.condition(workload, "Requeued") or {}).get("reason") == "Preempted", workload["status"]
