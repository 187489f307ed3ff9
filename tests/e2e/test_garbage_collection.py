"""Cleanup done by the cluster, not by the operator: the controller-manager's garbage collector collects
an RLJob's children through their ownerReferences, and the namespace controller finishes deleting a
namespace with a running RLJob in it (the fake kubelet lets the pods terminate)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rljob.testing.harness import OperatorProcess, get_rljob, phase_is, rljob_path, wait_rljob
from rljob.testing.kubeaccess import ApiError, KubeApi, Kubectl, delete_namespace, wait_for
from rljob.testing.kubelet import Kubelet
from rljob.testing.pods import rljob_mapping

pytestmark = pytest.mark.e2e


def children(api: KubeApi, namespace: str, job: str) -> dict[str, dict[str, Any]]:
    """The RLJob's pods, token Secret and Service that exist now, by `Kind/name`."""
    found: dict[str, dict[str, Any]] = {}
    pods = api.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"rljob.io/job={job}")["items"]
    for pod in pods:
        found[f"Pod/{pod['metadata']['name']}"] = pod
    for kind, path in (("Secret", f"secrets/{job}-agent-token"), ("Service", f"services/{job}")):
        try:
            found[f"{kind}/{path.split('/')[1]}"] = api.get(f"/api/v1/namespaces/{namespace}/{path}")
        except ApiError as exc:
            if exc.status != 404:
                raise
    return found


def start_job(
    api: KubeApi, kubectl: Kubectl, namespace: str, operator: OperatorProcess, manifest: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Applies the RLJob and waits until it runs (Rollout or later): its 2 pods, Secret and Service exist."""
    name = manifest["metadata"]["name"]
    kubectl.apply(manifest, namespace=namespace)
    running = phase_is("Rollout", "Draining", "Releasing", "Training", "Refitting", "Resuming")
    wait_rljob(api, namespace, name, running, timeout=120, what="running", on_timeout=operator.log_tail)
    found = children(api, namespace, name)
    assert sorted(found) == sorted(
        [f"Pod/{name}-0", f"Pod/{name}-1", f"Secret/{name}-agent-token", f"Service/{name}"]
    )
    return found


def test_deleted_rljob_children_are_collected_by_the_garbage_collector(
    admin_kubeconfig: Path,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Callable[..., Kubelet],
    simulated_rljob_factory: Callable[..., dict[str, Any]],
    rljob_crd: None,
    tmp_path: Path,
) -> None:
    """The operator is stopped and the RLJob's finalizer removed, so nothing of ours cleans up: the pods,
    Secret and Service go because their ownerReferences name the deleted RLJob."""
    kubelet = kubelet_factory(mapping=rljob_mapping())
    operator = OperatorProcess(admin_kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        # Long enough to still run when the operator is stopped: 50 iterations of a 1 s training step.
        job = simulated_rljob_factory("orphaned", iterations=50, train_seconds=1.0)
        found = start_job(kube_api, kubectl, namespace, operator, job)
    finally:
        operator.stop()
    assert not operator.alive
    owner = get_rljob(kube_api, namespace, "orphaned")
    for key, child in found.items():
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "RLJob", "orphaned", owner["metadata"]["uid"], True,
        ), key  # fmt: skip
    pods = {
        name.split("/")[1]: kubelet.runner(namespace, name.split("/")[1]) for name in found if "Pod/" in name
    }
    processes = [p for r in pods.values() if r is not None for p in r.processes().values()]
    assert len(processes) == 6, pods  # sglang, trainer, agent in each pod
    assert owner["metadata"].get("finalizers"), "the operator puts a finalizer on the RLJob"

    kube_api.merge_patch(rljob_path(namespace, "orphaned"), {"metadata": {"finalizers": None}})
    kubectl("delete", "rljob", "orphaned", "--wait=true", "--timeout=30s", namespace=namespace)

    # The garbage collector notices the RLJob kind at its next discovery resync (30 s) at the latest.
    wait_for(lambda: not children(kube_api, namespace, "orphaned"), timeout=120, interval=0.5,
             what="the garbage collector to delete the pods, Secret and Service")  # fmt: skip
    assert all(p.poll() is not None for p in processes), "the kubelet stopped the collected pods' processes"
    assert not operator.alive and operator.starts == 1  # nobody of ours acted


def test_namespace_deletion_completes_and_its_pods_terminate(
    kube_api: KubeApi, kubectl: Kubectl, namespace: str, kubelet: Kubelet
) -> None:
    """The namespace controller deletes every object in the namespace; the kubelet stops the running
    pods' processes and finalizes their deletion, so the namespace goes away."""
    sleeper = {
        "name": "main",
        "image": "python:3.11",
        "command": ["python3", "-c", "import time; time.sleep(600)"],
    }
    for name in ("one", "two"):
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": "sleepers"}},
               "spec": {"terminationGracePeriodSeconds": 5, "containers": [sleeper]}}  # fmt: skip
        kubectl.apply(pod, namespace=namespace)
    kubectl("create", "secret", "generic", "s", "--from-literal=k=v", namespace=namespace)
    kubectl("create", "configmap", "c", "--from-literal=k=v", namespace=namespace)
    kubectl("create", "service", "clusterip", "sleepers", "--tcp=80:8080", namespace=namespace)

    def running() -> list[Any] | None:
        runners = [kubelet.runner(namespace, name) for name in ("one", "two")]
        procs = [p for r in runners if r is not None for p in r.processes().values()]
        return procs if len(procs) == 2 else None

    processes = wait_for(running, timeout=30, what="both pods' processes running")
    delete_namespace(kube_api, namespace, wait=90)
    assert all(p.poll() is not None for p in processes)
    assert kube_api.get("/api/v1/pods", fieldSelector=f"metadata.namespace={namespace}")["items"] == []


def test_namespace_deletion_completes_with_a_running_rljob(
    admin_kubeconfig: Path,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Callable[..., Kubelet],
    simulated_rljob_factory: Callable[..., dict[str, Any]],
    rljob_crd: None,
    tmp_path: Path,
) -> None:
    """The namespace controller deletes the pods first (the kubelet stops them; the conductor's creates are
    refused, and it stops), then the RLJob (kopf, still watching the namespace, stops the daemon and runs
    the finalizer) and the rest; then the namespace is gone and the operator still runs, never crashed."""
    kubelet_factory(mapping=rljob_mapping())
    operator = OperatorProcess(admin_kubeconfig, [namespace], tmp_path / "operator.log").start()
    try:
        job = simulated_rljob_factory("doomed", iterations=50, train_seconds=1.0)
        start_job(kube_api, kubectl, namespace, operator, job)
        began = time.monotonic()
        try:
            delete_namespace(kube_api, namespace, wait=60)
        except TimeoutError as exc:
            try:
                meta = get_rljob(kube_api, namespace, "doomed")["metadata"]
                deleted, finalizers = meta.get("deletionTimestamp"), meta.get("finalizers")
                left = f"RLJob deleted at {deleted}, finalizers: {finalizers}"
            except ApiError as err:
                left = f"RLJob: {err}"
            pytest.fail(f"{exc}\n{left}\n--- operator log:\n{operator.log_tail(15)}")
        print(f"namespace {namespace} deleted in {time.monotonic() - began:.1f} s")
        assert operator.alive, operator.log_tail()
    finally:
        operator.stop()
    log = operator.log_path.read_text(errors="replace")
    assert "failed with an exception" not in log, operator.log_tail()
    assert kube_api.get("/api/v1/pods", fieldSelector=f"metadata.namespace={namespace}")["items"] == []
