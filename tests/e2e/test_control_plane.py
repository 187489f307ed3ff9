"""Smoke tests of the e2e harness itself: the real control plane (API server, scheduler,
controller-manager), RBAC, schema validation, the fake kubelet's GPU nodes and the
`python -m rljob.testing.cluster` CLI."""

from __future__ import annotations

import http.client
import ipaddress
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rljob.testing import cluster
from rljob.testing.kubeaccess import ApiError, KubeApi, Kubectl, service_account_kubeconfig, wait_for
from rljob.testing.kubelet import ContainerContext, Kubelet, Launch, NodeShape, remap_paths, table_mapping

KubeletFactory = Callable[..., Kubelet]

REPO = Path(__file__).resolve().parents[2]

WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.e2e.rljob.io"},
    "spec": {
        "group": "e2e.rljob.io",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "required": ["replicas"],
                                "properties": {
                                    "replicas": {"type": "integer", "minimum": 1},
                                    "mode": {"type": "string", "enum": ["colocated", "split"]},
                                },
                            },
                            "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
                        },
                    }
                },
            }
        ],
    },
}


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "e2e.rljob.io/v1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def widget_crd(kubectl: Kubectl) -> str:
    kubectl.apply(WIDGET_CRD)
    kubectl("wait", "--for=condition=Established", "crd/widgets.e2e.rljob.io", "--timeout=30s")
    return "widgets.e2e.rljob.io"


def get_pod(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any]:
    pod: dict[str, Any] = kubectl.json("get", "pod", name, namespace=namespace)
    return pod


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def pids_mentioning(text: str) -> set[int]:
    """Live processes whose command line contains `text` (psutil-free, from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes() and pid_alive(int(entry.name)):
                    found.add(int(entry.name))
            except OSError:
                continue
    return found


def test_pinned_versions_agree_with_go_modules() -> None:
    """The Python constants, the Go consumer modules and the build script pin the same releases."""
    k8s_mod = (REPO / "hack/k8s/go.mod").read_text()
    assert re.search(rf"^\s*(require\s+)?k8s\.io/kubernetes {cluster.K8S_VERSION}\b", k8s_mod, re.M)
    staging = re.findall(r"^\s*(k8s\.io/\S+) => \1 (v\S+)$", k8s_mod, re.M)
    assert len(staging) >= 31
    assert {v for _, v in staging} == {"v0." + cluster.K8S_VERSION.removeprefix("v1.")}
    etcd_mod = (REPO / "hack/etcd/go.mod").read_text()
    assert re.search(
        rf"^\s*(require\s+)?go\.etcd\.io/etcd/server/v3 {cluster.ETCD_VERSION}\b", etcd_mod, re.M
    )
    script = (REPO / "hack/build-binaries.sh").read_text()
    assert f'HELM_VERSION="{cluster.HELM_VERSION}"' in script
    # Every Kubernetes binary comes from the one consumer module, so they are one release.
    components = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")
    assert set(re.findall(r"^tool k8s\.io/kubernetes/cmd/(\S+)$", k8s_mod, re.M)) == set(components)
    assert re.search(r'^K8S_COMMANDS="' + " ".join(components) + '"$', script, re.M)


@pytest.mark.e2e
def test_server_reports_pinned_release(kubectl: Kubectl, kube_api: KubeApi) -> None:
    version = kubectl("version", "-o", "json")
    assert "WARNING" not in version.stderr, version.stderr  # no version skew
    both = json.loads(version.stdout)
    assert both["serverVersion"]["gitVersion"] == cluster.K8S_VERSION
    assert both["clientVersion"]["gitVersion"] == cluster.K8S_VERSION
    assert kube_api.get("/version")["minor"] == cluster.K8S_VERSION.split(".")[1]


@pytest.mark.e2e
def test_scheduler_and_controller_manager_authenticate_as_their_own_users(
    admin_kubeconfig: Path, kube_api: KubeApi, tmp_path: Path
) -> None:
    plane = cluster.LocalControlPlane.attach(admin_kubeconfig.parent)
    if plane is None:
        pytest.skip("RLJOB_KUBECONFIG: not a local control plane")
    for component, user in (
        ("kube-scheduler", "system:kube-scheduler"),
        ("kube-controller-manager", "system:kube-controller-manager"),
    ):
        api = KubeApi.from_kubeconfig(plane.component_kubeconfig(component))
        review = api.post(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
        assert review["status"]["userInfo"]["username"] == user
        assert "system:masters" not in review["status"]["userInfo"].get("groups", [])
    # --use-service-account-credentials: each controller runs as its own ServiceAccount.
    wanted = {"generic-garbage-collector", "namespace-controller", "node-controller", "pod-garbage-collector"}

    def accounts() -> bool:
        listed = kube_api.get("/api/v1/namespaces/kube-system/serviceaccounts")["items"]
        return wanted <= {sa["metadata"]["name"] for sa in listed}

    wait_for(accounts, timeout=60, interval=0.5, what=f"ServiceAccounts {sorted(wanted)} in kube-system")


@pytest.mark.e2e
def test_custom_resource_create_get_patch_status(kubectl: Kubectl, namespace: str, widget_crd: str) -> None:
    kubectl.apply(widget("w1", replicas=2, mode="split"), namespace=namespace)
    got = kubectl.json("get", "widget", "w1", namespace=namespace)
    assert got["spec"] == {"replicas": 2, "mode": "split"}

    kubectl(
        "patch",
        "widget",
        "w1",
        "--subresource=status",
        "--type=merge",
        "-p",
        '{"status": {"phase": "Running"}}',
        namespace=namespace,
    )
    # With a status subresource, the main resource ignores status changes and vice versa.
    kubectl(
        "patch", "widget", "w1", "--type=merge", "-p", '{"status": {"phase": "Ignored"}}', namespace=namespace
    )
    got = kubectl.json("get", "widget", "w1", namespace=namespace)
    assert got["status"] == {"phase": "Running"}
    assert got["metadata"]["generation"] == 1


@pytest.mark.e2e
def test_schema_validation_refuses_invalid_object_with_field_path(
    kubectl: Kubectl, namespace: str, widget_crd: str
) -> None:
    result = kubectl(
        "apply",
        "-f",
        "-",
        namespace=namespace,
        check=False,
        input=json.dumps(widget("bad", replicas=0, mode="bogus")),
    )
    assert result.returncode != 0, result.stdout
    assert "spec.replicas" in result.stderr and "spec.mode" in result.stderr, result.stderr
    assert "NotFound" in kubectl("get", "widget", "bad", namespace=namespace, check=False).stderr


@pytest.mark.e2e
def test_project_crds_apply_and_become_established(kubectl: Kubectl) -> None:
    files = sorted((REPO / "crds").glob("*.yaml"))
    if not files:
        pytest.skip("no CRDs in crds/ yet")
    kubectl("apply", "-f", str(REPO / "crds"))
    for f in files:
        kubectl("wait", "--for=condition=Established", "-f", str(f), "--timeout=30s")


@pytest.mark.e2e
def test_rbac_is_enforced_for_service_account_tokens(
    kubectl: Kubectl, admin_kubeconfig: Path, namespace: str, tmp_path: Path
) -> None:
    sa_kubeconfig = service_account_kubeconfig(
        admin_kubeconfig, namespace, "nobody", tmp_path / "sa.kubeconfig"
    )
    denied = kubectl("get", "pods", namespace=namespace, kubeconfig=sa_kubeconfig, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr
    with pytest.raises(ApiError) as raised:
        KubeApi.from_kubeconfig(sa_kubeconfig).get(f"/api/v1/namespaces/{namespace}/pods")
    assert raised.value.status == 403

    kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", namespace=namespace)
    kubectl(
        "create",
        "rolebinding",
        "nobody-reads",
        "--role=pod-reader",
        f"--serviceaccount={namespace}:nobody",
        namespace=namespace,
    )
    wait_for(
        lambda: (
            kubectl("get", "pods", namespace=namespace, kubeconfig=sa_kubeconfig, check=False).returncode == 0
        ),
        timeout=10,
        what="RoleBinding to take effect",
    )
    can_create = kubectl(
        "auth", "can-i", "create", "pods", namespace=namespace, kubeconfig=sa_kubeconfig, check=False
    )
    assert can_create.stdout.strip() == "no"


def web_pod(name: str, restart_policy: str = "Always") -> dict[str, Any]:
    """A pod serving its Secret volume over HTTP on its pod IP, with a readiness probe."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": restart_policy,
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "web",
                    "image": "python:3.11",
                    "command": ["python3", "-m", "http.server", "--bind", "$(POD_IP)", "8080"],
                    "args": ["--directory", "/etc/web"],
                    "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                    "ports": [{"name": "http", "containerPort": 8080}],
                    "volumeMounts": [{"name": "content", "mountPath": "/etc/web", "readOnly": True}],
                    "readinessProbe": {"httpGet": {"path": "/index.txt", "port": "http"}, "periodSeconds": 1},
                }
            ],
            "volumes": [{"name": "content", "secret": {"secretName": "web-content"}}],
        },
    }


def http_get(ip: str, port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(ip, port, timeout=2)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def wait_ready(kubectl: Kubectl, namespace: str, name: str, timeout: float = 30) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        pod = get_pod(kubectl, namespace, name)
        return pod if is_ready(pod) else None

    return wait_for(ready, timeout=timeout, what=f"pod {name} Ready")


@pytest.mark.e2e
def test_kubelet_runs_pod_on_loopback_ip_and_stops_it_on_delete(
    kubectl: Kubectl, namespace: str, kubelet: Kubelet
) -> None:
    kubectl(
        "create",
        "secret",
        "generic",
        "web-content",
        "--from-literal=index.txt=hello from a pod",
        namespace=namespace,
    )
    kubectl.apply(web_pod("web"), namespace=namespace)
    pod = wait_ready(kubectl, namespace, "web")
    status = pod["status"]
    ip = ipaddress.IPv4Address(status["podIP"])
    assert ip.is_loopback and str(ip) != "127.0.0.1"
    assert status["phase"] == "Running" and status["podIPs"] == [{"ip": str(ip)}]
    assert status["hostIP"] == "127.0.0.1" and pod["spec"]["nodeName"] in kubelet.node_names
    scheduled = kubectl.json(
        "get", "events", "--field-selector=involvedObject.name=web,reason=Scheduled", namespace=namespace
    )["items"]
    reporters = [e.get("reportingComponent") or e["source"].get("component") for e in scheduled]
    assert reporters == ["default-scheduler"], scheduled  # bound by the scheduler, not the kubelet
    (container,) = status["containerStatuses"]
    assert container["ready"] and container["started"] and "running" in container["state"]
    assert http_get(str(ip), 8080, "/index.txt") == (200, b"hello from a pod")

    runner = kubelet.runner(namespace, "web")
    assert runner is not None
    pid = runner.processes()["web"].pid
    # A plain delete (grace period 5s): the kubelet stops the process and finalizes the pod.
    kubectl("delete", "pod", "web", "--wait=true", "--timeout=30s", namespace=namespace)
    wait_for(lambda: not pid_alive(pid), timeout=10, what="process stopped")
    with pytest.raises(OSError):
        http_get(str(ip), 8080, "/index.txt")


@pytest.mark.e2e
def test_kubelet_reflects_exits_under_restart_policy(
    kubectl: Kubectl, namespace: str, kubelet: Kubelet
) -> None:
    def exiting(name: str, policy: str, code: int) -> dict[str, Any]:
        script = f"import sys, time; time.sleep(0.3); sys.exit({code})"
        container = {"name": "main", "image": "python:3.11", "command": ["python3", "-c", script]}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {"restartPolicy": policy, "containers": [container]},
        }

    kubectl.apply(exiting("never-fails", "Never", 3), namespace=namespace)
    kubectl.apply(exiting("never-succeeds", "Never", 0), namespace=namespace)
    kubectl.apply(exiting("onfailure", "OnFailure", 7), namespace=namespace)

    def phase_is(name: str, phase: str) -> dict[str, Any] | None:
        pod = get_pod(kubectl, namespace, name)
        return pod if pod["status"].get("phase") == phase else None

    failed = wait_for(lambda: phase_is("never-fails", "Failed"), timeout=30, what="Failed")
    assert failed["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    succeeded = wait_for(lambda: phase_is("never-succeeds", "Succeeded"), timeout=30, what="Succeeded")
    assert succeeded["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"

    def restarted() -> dict[str, Any] | None:
        (status,) = get_pod(kubectl, namespace, "onfailure")["status"].get("containerStatuses", [{}])
        return status if status.get("restartCount", 0) >= 2 else None

    status = wait_for(restarted, timeout=30, what="two restarts")
    assert status["lastState"]["terminated"]["exitCode"] == 7
    assert get_pod(kubectl, namespace, "onfailure")["status"]["phase"] == "Running"


@pytest.mark.e2e
def test_kubelet_starts_containers_only_after_a_sidecars_startup_probe_passes(
    kubectl: Kubectl, namespace: str, kubelet: Kubelet, tmp_path: Path
) -> None:
    """What the operator's gang gate relies on (docs/control-plane.md, "Gangs that do not fit"): a native
    sidecar with a startupProbe holds back the pod's containers until the probe passes."""
    go = tmp_path / "go"
    check = f"import os, sys; sys.exit(0 if os.path.exists({str(go)!r}) else 1)"
    sleeper = {"image": "python:3.11", "command": ["python3", "-c", "import time; time.sleep(600)"]}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gated"},
        "spec": {
            "terminationGracePeriodSeconds": 1,
            "initContainers": [
                {
                    **sleeper,
                    "name": "gate",
                    "restartPolicy": "Always",
                    "startupProbe": {
                        "exec": {"command": ["python3", "-c", check]},
                        "periodSeconds": 1,
                        "failureThreshold": 600,
                    },
                }
            ],
            "containers": [{**sleeper, "name": "main"}],
        },
    }
    kubectl.apply(pod, namespace=namespace)

    def statuses() -> tuple[dict[str, Any], dict[str, Any], str]:
        status = get_pod(kubectl, namespace, "gated").get("status", {})
        inits, mains = status.get("initContainerStatuses") or [{}], status.get("containerStatuses") or [{}]
        return inits[0], mains[0], status.get("phase", "")

    wait_for(lambda: "running" in statuses()[0].get("state", {}), timeout=30, what="the sidecar running")
    for _ in range(6):  # the probe fails every second: the container is held back
        gate, main, phase = statuses()
        assert gate["started"] is False and "running" in gate["state"], gate
        assert "running" not in main.get("state", {}) and phase == "Pending", (main, phase)
        time.sleep(0.5)
    go.touch()
    wait_for(lambda: "running" in statuses()[1].get("state", {}), timeout=30, what="the container running")
    gate, main, phase = statuses()
    assert gate["started"] is True and phase == "Running"
    assert gate["restartCount"] == 0  # failures below failureThreshold never kill it


@pytest.mark.e2e
def test_kubelet_custom_mapping_sees_env_secrets_and_remapped_mounts(
    kubectl: Kubectl, namespace: str, kubelet_factory: KubeletFactory
) -> None:
    def agent(ctx: ContainerContext) -> Launch:
        code = (
            "import json, os, sys, time; json.dump(dict(os.environ), open(sys.argv[1], 'w')); time.sleep(60)"
        )
        return Launch([sys.executable, "-c", code, ctx.remap("/var/out/env.json")], env={"MAPPED": ctx.name})

    kubelet = kubelet_factory(table_mapping(by_image={"example.com/agent": agent}))
    kubectl("create", "secret", "generic", "creds", "--from-literal=token=s3cret", namespace=namespace)
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "MY_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "OUT", "value": "/var/out/env.json"},
        {"name": "URL", "value": "http://$(MY_IP):9000"},
    ]
    container = {
        "name": "agent",
        "image": "example.com/agent:1.0",
        "env": env,
        "volumeMounts": [{"name": "out", "mountPath": "/var/out"}],
    }
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "agent"},
            "spec": {"containers": [container], "volumes": [{"name": "out", "emptyDir": {}}]},
        },
        namespace=namespace,
    )
    pod = wait_ready(kubectl, namespace, "agent")
    runner = kubelet.runner(namespace, "agent")
    assert runner is not None
    out = runner.scratch / "volumes" / "out" / "env.json"
    seen = wait_for(lambda: json.loads(out.read_text()), timeout=10, what="env.json written")
    ip = pod["status"]["podIP"]
    assert (seen["TOKEN"], seen["MY_NS"], seen["MY_IP"], seen["MAPPED"]) == ("s3cret", namespace, ip, "agent")
    assert seen["OUT"] == str(out) and seen["URL"] == f"http://{ip}:9000"
    assert "KUBECONFIG" not in seen  # the host's credentials do not leak into pods
    assert remap_paths("--out=/var/out/x /var/outside", {"/var/out": Path("/s")}) == "--out=/s/x /var/outside"


def run_cluster_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rljob.testing.cluster", *args], capture_output=True, text=True, timeout=180
    )


@pytest.mark.e2e
def test_kubelet_registers_gpu_nodes_with_heartbeats_and_removes_them_on_stop(
    kubectl: Kubectl, kube_api: KubeApi, kubelet_factory: KubeletFactory
) -> None:
    shape = NodeShape(gpus=4, cpu="16", memory="64Gi")
    kubelet = kubelet_factory(nodes=2, shape=shape, heartbeat=0.5)
    names = kubelet.node_names
    assert len(names) == 2
    for name in names:
        node = kubectl.json("get", "node", name)
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "4"
        assert node["status"]["allocatable"] == node["status"]["capacity"]
        assert (node["status"]["capacity"]["cpu"], node["status"]["capacity"]["memory"]) == ("16", "64Gi")
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
        assert ready["Ready"] == "True"
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{names[0]}"
    first = kube_api.get(lease_path)
    assert first["spec"]["holderIdentity"] == names[0] and first["spec"]["leaseDurationSeconds"] == 40
    assert first["metadata"]["ownerReferences"][0]["kind"] == "Node"
    wait_for(
        lambda: kube_api.get(lease_path)["spec"]["renewTime"] > first["spec"]["renewTime"],
        timeout=10,
        what="Lease renewed",
    )
    # The node lifecycle controller keeps heartbeating nodes free of not-ready/unreachable taints.
    time.sleep(1)
    taints = [t for n in names for t in kubectl.json("get", "node", n)["spec"].get("taints") or []]
    assert taints == []
    added = kubelet.add_node(shape=NodeShape(gpus=1))
    assert kubectl.json("get", "node", added)["status"]["capacity"]["nvidia.com/gpu"] == "1"
    kubelet.stop()
    gone = kubectl("get", "nodes", *names, added, "--ignore-not-found", "-o", "name").stdout.strip()
    assert gone == ""


@pytest.mark.e2e
def test_scheduler_places_gpu_pods_by_free_capacity(
    kubectl: Kubectl, namespace: str, kubelet_factory: KubeletFactory
) -> None:
    kubelet = kubelet_factory(nodes=2, shape=NodeShape(gpus=8))

    def gpu_pod(name: str, gpus: int) -> dict[str, Any]:
        container = {
            "name": "main",
            "image": "python:3.11",
            "command": ["python3", "-c", "import time; time.sleep(600)"],
            "resources": {"limits": {"nvidia.com/gpu": gpus}},
        }
        spec = {"containers": [container]}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

    for name in ("six-a", "six-b", "six-c"):
        kubectl.apply(gpu_pod(name, 6), namespace=namespace)

    def placed() -> dict[str, str] | None:
        pods = kubectl.json("get", "pods", namespace=namespace)["items"]
        nodes = {p["metadata"]["name"]: p["spec"].get("nodeName", "") for p in pods}
        return nodes if sum(1 for n in nodes.values() if n) == 2 else None

    nodes = wait_for(placed, timeout=30, what="two pods bound")
    bound = sorted(n for n in nodes.values() if n)
    assert bound == sorted(kubelet.node_names)  # 6 + 6 > 8: one per node
    (waiting,) = [name for name, node in nodes.items() if not node]

    def unschedulable() -> dict[str, Any] | None:
        pod = get_pod(kubectl, namespace, waiting)
        conditions = {c["type"]: c for c in pod["status"].get("conditions", [])}
        scheduled = conditions.get("PodScheduled", {})
        return scheduled if scheduled.get("reason") == "Unschedulable" else None

    condition = wait_for(unschedulable, timeout=30, what=f"{waiting} Unschedulable")
    assert "Insufficient nvidia.com/gpu" in condition["message"], condition
    assert get_pod(kubectl, namespace, waiting)["status"]["phase"] == "Pending"
    # A pod that fits still schedules next to them: 2 GPUs are free on each node.
    kubectl.apply(gpu_pod("two", 2), namespace=namespace)
    wait_ready(kubectl, namespace, "two")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_cluster_cli_up_is_idempotent_and_down_leaves_nothing(admin_kubeconfig: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "cluster"
    first = run_cluster_cli("up", "--dir", str(workdir), "--nodes", "2", "--gpus-per-node", "8")
    assert first.returncode == 0, first.stderr
    for component in ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"):
        version = cluster.ETCD_VERSION if component == "etcd" else cluster.K8S_VERSION
        row = rf"^\s+{component}\s+{re.escape(version)}\s+pid \d+"
        assert re.search(row, first.stdout, re.M), first.stdout
    pids = pids_mentioning(str(workdir))
    assert len(pids) == 5, pids  # etcd, kube-apiserver, kube-scheduler, kube-controller-manager, fake kubelet
    second = run_cluster_cli("up", "--dir", str(workdir))
    assert second.returncode == 0 and "already running" in second.stdout, second.stdout + second.stderr
    assert pids_mentioning(str(workdir)) == pids
    assert run_cluster_cli("status", "--dir", str(workdir)).returncode == 0
    kubeconfig = f"--kubeconfig={workdir / 'kubeconfig'}"
    version = subprocess.run(
        ["kubectl", kubeconfig, "get", "--raw", "/version"], capture_output=True, text=True, timeout=30
    )
    assert json.loads(version.stdout)["gitVersion"] == cluster.K8S_VERSION
    nodes = subprocess.run(
        ["kubectl", kubeconfig, "get", "nodes", "-o", "json"], capture_output=True, text=True, timeout=30
    )
    capacity = [n["status"]["capacity"]["nvidia.com/gpu"] for n in json.loads(nodes.stdout)["items"]]
    assert capacity == ["8", "8"]
    assert re.search(r"^rljob-gpu-0\s+True\s+8\s+64\s+512Gi", first.stdout, re.M), first.stdout

    started = time.monotonic()
    down = run_cluster_cli("down", "--dir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert pids_mentioning(str(workdir)) == set()
    assert not [p for p in pids if pid_alive(p)]
    assert not workdir.exists()
    assert run_cluster_cli("status", "--dir", str(workdir)).returncode == 1
    assert time.monotonic() - started < 30
