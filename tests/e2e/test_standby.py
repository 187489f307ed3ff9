"""Two operator replicas with leader election (controller/leader.py) on the real API server: one acts,
the other waits; SIGKILL the active one mid-iteration and the standby finishes the job."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
from test_operator import SLOW, assert_monotonic, crd, job, versions  # noqa: F401  (crd: a fixture)

from rljob.testing.cluster import ensure_binaries
from rljob.testing.harness import OperatorProcess, phase_is, wait_rljob
from rljob.testing.install import HelmError, install_chart, operator_kubeconfig, uninstall_chart
from rljob.testing.kubeaccess import KubeApi, Kubectl, delete_namespace
from rljob.testing.pods import rljob_mapping

pytestmark = pytest.mark.e2e

# Short timings so the test is quick; the chart's defaults are 15/10/2.
ELECTION = ["--leader-elect-lease-seconds=6", "--leader-elect-renew-deadline-seconds=4"]
ELECTION += ["--leader-elect-retry-seconds=0.5"]


def chart_replicas(
    kube_api: KubeApi, release_ns: str, watched: str, tmp_path: Path
) -> tuple[str, list[OperatorProcess]]:
    """The chart's Deployment as two local processes: its args (less the ports two processes on one
    host cannot share), its ServiceAccount's rights (a TokenRequest token), one identity each."""
    (deploy,) = kube_api.get(f"/apis/apps/v1/namespaces/{release_ns}/deployments")["items"]
    assert deploy["spec"]["replicas"] == 2
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    args = [a for a in args if not a.startswith(("--metrics-port=", "--health-endpoint=", "--log-json"))]
    lease = next(a.split("=", 1)[1] for a in args if a.startswith("--leader-elect-name="))
    kubeconfig = operator_kubeconfig(kube_api, None, release_ns, tmp_path / "sa.kubeconfig")
    replicas = [
        OperatorProcess(
            kubeconfig,
            [],
            tmp_path / f"{who}.log",
            extra_args=[
                *args,
                *ELECTION,
                f"--leader-elect-namespace={release_ns}",
                f"--leader-elect-identity={who}",
            ],
        )
        for who in ("replica-a", "replica-b")
    ]
    return lease, replicas


def holder(api: KubeApi, namespace: str, name: str) -> str | None:
    try:
        lease = api.get(f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}")
    except Exception:
        return None
    spec: dict[str, Any] = lease.get("spec", {})
    return spec.get("holderIdentity")


def wait_for(predicate: Any, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(what)


@pytest.mark.usefixtures("crd")
def test_standby_takes_over_when_the_active_replica_dies(
    admin_kubeconfig: Path,
    kube_api: KubeApi,
    kubectl: Kubectl,
    namespace: str,
    kubelet_factory: Any,
    tmp_path: Path,
) -> None:
    helm = ensure_binaries(build=True).helm
    release_ns = f"{namespace}-op"
    install_chart(helm, admin_kubeconfig, "rljob", release_ns, [namespace])
    kubelet_factory(mapping=rljob_mapping())
    lease, (a, b) = chart_replicas(kube_api, release_ns, namespace, tmp_path)
    try:
        a.start()
        wait_for(lambda: holder(kube_api, release_ns, lease) == "replica-a", 30, "replica-a never led")
        b.start()
        kubectl.apply(job("ha", iterations=3, sim_args=SLOW, train_seconds=1.0), namespace=namespace)
        seen = wait_rljob(
            kube_api, namespace, "ha", phase_is("Training"), 120, "Training", on_timeout=a.log_tail
        )
        assert holder(kube_api, release_ns, lease) == "replica-a"
        assert "standby: waiting" in b.log_tail(200) and "leading as" not in b.log_tail(200), b.log_tail()
        a.kill()
        killed = time.monotonic()
        takeover = wait_for(lambda: holder(kube_api, release_ns, lease) == "replica-b", 30, "no takeover")
        moved = wait_rljob(
            kube_api,
            namespace,
            "ha",
            lambda o: o["status"].get("epoch", 0) > seen["status"]["epoch"],
            60,
            "progressing after the takeover",
            on_timeout=b.log_tail,
        )
        resumed = time.monotonic() - killed
        print(
            f"\ntakeover: lease to the standby {takeover:.2f}s, "
            f"first status write {resumed:.2f}s after SIGKILL (lease 6 s, retry 0.5 s)"
        )
        assert moved["status"]["phase"] != "Failed"
        obj = wait_rljob(
            kube_api, namespace, "ha", phase_is("Succeeded"), 180, "Succeeded", on_timeout=b.log_tail
        )
        status = obj["status"]
        assert status["weightVersion"] == "3" and status["restarts"] == 0, status.get("message")
        assert versions(obj) == ["0", "1", "2", "3"]
        assert_monotonic(versions(obj))
        assert takeover < 6 + 2, f"takeover took {takeover:.1f}s, lease is 6s"
        assert "Forbidden" not in b.log_tail(2000), b.log_tail()
    finally:
        a.stop()
        b.stop()
        with contextlib.suppress(HelmError):
            uninstall_chart(helm, admin_kubeconfig, "rljob", release_ns)
        delete_namespace(kube_api, release_ns)
