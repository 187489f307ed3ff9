"""Smoke tests of the e2e harness itself: the real control plane, RBAC, schema validation, the fake
kubelet and the `python -m rljob.testing.cluster` CLI."""

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
from rljob.testing.kubelet import ContainerContext, Kubelet, Launch, remap_paths, table_mapping

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


@pytest.mark.e2e
def test_server_reports_pinned_release(kubectl: Kubectl, kube_api: KubeApi) -> None:
    version = kubectl.json("version")
    assert version["serverVersion"]["gitVersion"] == cluster.K8S_VERSION
    assert kube_api.get("/version")["minor"] == cluster.K8S_VERSION.split(".")[1]


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
    assert status["hostIP"] == "127.0.0.1" and pod["spec"]["nodeName"] == kubelet.node_name
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
@pytest.mark.timeout(300)
def test_cluster_cli_up_is_idempotent_and_down_leaves_nothing(admin_kubeconfig: Path, tmp_path: Path) -> None:
    workdir = tmp_path / "cluster"
    first = run_cluster_cli("up", "--dir", str(workdir))
    assert first.returncode == 0, first.stderr
    pids = pids_mentioning(str(workdir))
    assert len(pids) == 2, pids  # etcd + kube-apiserver
    second = run_cluster_cli("up", "--dir", str(workdir))
    assert second.returncode == 0 and "already running" in second.stdout, second.stdout + second.stderr
    assert pids_mentioning(str(workdir)) == pids
    assert run_cluster_cli("status", "--dir", str(workdir)).returncode == 0
    kubeconfig = f"--kubeconfig={workdir / 'kubeconfig'}"
    version = subprocess.run(
        ["kubectl", kubeconfig, "get", "--raw", "/version"], capture_output=True, text=True, timeout=30
    )
    assert json.loads(version.stdout)["gitVersion"] == cluster.K8S_VERSION

    started = time.monotonic()
    down = run_cluster_cli("down", "--dir", str(workdir))
    assert down.returncode == 0, down.stderr
    assert pids_mentioning(str(workdir)) == set()
    assert not [p for p in pids if pid_alive(p)]
    assert not workdir.exists()
    assert run_cluster_cli("status", "--dir", str(workdir)).returncode == 1
    assert time.monotonic() - started < 30
