"""An RLJob placed by the real kube-scheduler on simulated GPU nodes: a gang larger than the free GPUs
waits (its last member Unschedulable, the job not started, the placed members' GPU containers not
started, condition Scheduled=False says why), and runs once a node is added."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob.testing.harness import OperatorProcess, get_rljob, phase_is, wait_rljob
from rljob.testing.kubeaccess import KubeApi, Kubectl, wait_for
from rljob.testing.kubelet import Kubelet, NodeShape
from rljob.testing.pods import rljob_mapping

pytestmark = pytest.mark.e2e

ONE_GPU = NodeShape(gpus=1, cpu="8", memory="64Gi")


def gang(api: KubeApi, namespace: str, job: str) -> list[dict[str, Any]]:
    got = api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"rljob.io/job={job}")
    return sorted(got["items"], key=lambda p: p["metadata"]["name"])


def unschedulable(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The PodScheduled condition when the scheduler found no node for the pod."""
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition["type"] == "PodScheduled" and condition.get("reason") == "Unschedulable":
            return dict(condition)
    return None


def wait_for_unschedulable_member(
    api: KubeApi, namespace: str, job: str, replicas: int
) -> list[dict[str, Any]]:
    """Waits until the operator created the whole gang and the scheduler gave up on one member."""

    def seen() -> list[dict[str, Any]] | None:
        pods = gang(api, namespace, job)
        return pods if len(pods) == replicas and any(unschedulable(p) for p in pods) else None

    return wait_for(seen, timeout=60, interval=0.2, what=f"{replicas} pods of {job}, one Unschedulable")


@pytest.fixture
def operator(
    admin_kubeconfig: Path, namespace: str, rljob_crd: None, tmp_path: Path
) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(admin_kubeconfig, [namespace], tmp_path / "operator.log").start()
    yield proc
    proc.stop()


def test_gang_larger_than_free_gpus_waits_then_runs_after_a_node_is_added(
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Callable[..., Kubelet],
    simulated_rljob_factory: Callable[..., dict[str, Any]],
    operator: OperatorProcess,
) -> None:
    kubelet = kubelet_factory(mapping=rljob_mapping(), nodes=3, shape=ONE_GPU)  # capacity: 3 one-GPU pods
    kubectl.apply(simulated_rljob_factory("wide", replicas=4, iterations=2), namespace=namespace)
    pods = wait_for_unschedulable_member(kube_api, namespace, "wide", 4)
    (waiting,) = [p for p in pods if not p["spec"].get("nodeName")]
    condition = unschedulable(waiting)
    assert condition is not None and "Insufficient nvidia.com/gpu" in condition["message"], condition
    assert waiting["status"]["phase"] == "Pending"
    bound = sorted(p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName"))
    assert bound == sorted(kubelet.node_names)  # one GPU each: one pod per node

    # While a member cannot be placed the job does not start: no iteration, no weights committed.
    for _ in range(10):
        status = get_rljob(kube_api, namespace, "wide").get("status", {})
        assert status.get("phase", "Pending") == "Pending", status
        assert not status.get("iteration") and not status.get("weightHistory"), status
        assert unschedulable(
            kube_api.get(f"/api/v1/namespaces/{namespace}/pods/{waiting['metadata']['name']}")
        )
        time.sleep(0.5)

    added = kubelet.add_node(shape=ONE_GPU)
    obj = wait_rljob(
        kube_api, namespace, "wide", phase_is("Succeeded"), timeout=150, what="Succeeded",
        on_timeout=operator.log_tail,
    )  # fmt: skip
    assert obj["status"]["weightVersion"] == "2" and obj["status"]["restarts"] == 0
    scheduled = {c["type"]: c for c in obj["status"]["conditions"]}["Scheduled"]
    assert (scheduled["status"], scheduled["reason"]) == ("True", "GangPlaced"), scheduled
    placed = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in gang(kube_api, namespace, "wide")}
    assert placed[waiting["metadata"]["name"]] == added
    assert sorted(placed.values()) == sorted(kubelet.node_names)


def containers(pod: dict[str, Any]) -> dict[str, str]:
    """Container name -> its state (running, waiting, terminated), init containers too."""
    status = pod.get("status") or {}
    listed = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    return {c["name"]: next(iter(c.get("state") or {"waiting": {}})) for c in listed}


def test_no_member_of_an_incomplete_gang_starts_its_gpu_containers(
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Callable[..., Kubelet],
    simulated_rljob_factory: Callable[..., dict[str, Any]],
    operator: OperatorProcess,
) -> None:
    """The scheduler binds 3 of the 4 pods; their agents run, but SGLang and the trainer wait for the
    agent's startup probe, which passes only once the operator watches the gang, which it does only once
    the gang is placed whole. The job says why it waits (docs/control-plane.md, "Gangs that do not fit")."""
    kubelet_factory(mapping=rljob_mapping(), nodes=3, shape=ONE_GPU)
    kubectl.apply(simulated_rljob_factory("half", replicas=4, iterations=2), namespace=namespace)
    pods = wait_for_unschedulable_member(kube_api, namespace, "half", 4)
    (waiting,) = [p for p in pods if not p["spec"].get("nodeName")]

    def condition() -> dict[str, Any] | None:
        conditions = get_rljob(kube_api, namespace, "half").get("status", {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == "Scheduled" and c["status"] == "False"), None)

    said = wait_for(condition, timeout=30, interval=0.25, what="condition Scheduled=False")
    assert said["reason"] == "Unschedulable", said
    assert "1 of 4 pods cannot be placed" in said["message"], said
    assert "Insufficient nvidia.com/gpu" in said["message"], said
    assert waiting["metadata"]["name"] in said["message"]
    status = get_rljob(kube_api, namespace, "half")["status"]
    assert status["phase"] == "Pending" and status["reason"] == "Unschedulable", status
    about = "involvedObject.name=half,reason=Unschedulable"

    def events() -> list[dict[str, Any]]:
        return kube_api.get(f"/api/v1/namespaces/{namespace}/events", fieldSelector=about)["items"]

    # Events are posted after the status write, off the lifecycle's path (controller/conductor.py).
    wait_for(lambda: events() or None, timeout=10, interval=0.25, what="the Unschedulable event")
    assert [e["type"] for e in events()] == ["Warning"], events()  # said once

    # For 10 s: the placed members' agents run, SGLang and the trainer never start, no pod is Running.
    placed = [p["metadata"]["name"] for p in pods if p["spec"].get("nodeName")]
    agent_seen = set()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pod in gang(kube_api, namespace, "half"):
            name, state = pod["metadata"]["name"], containers(pod)
            assert pod["status"].get("phase") == "Pending", (name, pod["status"].get("phase"))
            assert state.get("sglang", "waiting") == "waiting", (name, state)
            assert state.get("trainer", "waiting") == "waiting", (name, state)
            if state.get("rljob-agent") == "running":
                agent_seen.add(name)
        time.sleep(0.5)
    assert agent_seen == set(placed), (agent_seen, placed)  # the gate is the agent's probe, not a dead pod
