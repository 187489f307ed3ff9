"""Kueue (built from Go modules, hack/build-kueue.sh) against the local control plane: the test world's
Kueue runs and admits by quota, all pods of a workload at once or none."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rljob.testing import kueue as kq
from rljob.testing.kubeaccess import KubeApi, wait_for

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
    with kq.LocalKueue(admin_kubeconfig, tmp_path_factory.mktemp("kueue")) as running:
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
    for name in ("first", "second"):
        kq.apply(kube_api, raw_workload(namespace, name, pods=3, gpus_per_pod=1))

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
