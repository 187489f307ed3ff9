"""Fixtures for the e2e tier: a real control plane (etcd, kube-apiserver, kube-scheduler,
kube-controller-manager), fresh namespaces, the matching kubectl, fake kubelets with simulated GPU nodes.

The control plane is started once per session from the cached binaries (hack/build-binaries.sh
builds them if missing), or reused from `RLJOB_KUBECONFIG`. Missing binaries that cannot be built
make the e2e tests fail, never skip, unless `RLJOB_SKIP_E2E=1`.
"""

from __future__ import annotations

import copy
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.testing.cluster import ControlPlaneError, LocalControlPlane, ensure_binaries
from rljob.testing.harness import ROOT
from rljob.testing.kubeaccess import KubeApi, Kubectl, create_namespace, delete_namespace, kubectl_env
from rljob.testing.kubelet import Kubelet, Mapping, default_mapping
from rljob.testing.pods import SIM_ARGS_ENV

SKIP_E2E = os.environ.get("RLJOB_SKIP_E2E") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if SKIP_E2E:
        skip = pytest.mark.skip(reason="RLJOB_SKIP_E2E=1")
        for item in items:
            if item.get_closest_marker("e2e") is not None:
                item.add_marker(skip)


@dataclass(frozen=True)
class ControlPlane:
    """The API server the e2e tier talks to; `local` is None when reused from RLJOB_KUBECONFIG."""

    kubeconfig: Path
    api: KubeApi
    local: LocalControlPlane | None


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if SKIP_E2E:
        pytest.skip("RLJOB_SKIP_E2E=1")
    external = os.environ.get("RLJOB_KUBECONFIG")
    if external:
        yield ControlPlane(Path(external), KubeApi.from_kubeconfig(external), None)
        return
    try:
        binaries = ensure_binaries(build=True)
    except ControlPlaneError as exc:
        pytest.fail(f"e2e needs the control-plane binaries: {exc}", pytrace=False)
    plane = LocalControlPlane(tmp_path_factory.mktemp("control-plane"), binaries)
    plane.start()
    # Every `kubectl` a test or a tool starts is the server's release (no version-skew warnings).
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", kubectl_env()["PATH"])
        try:
            yield ControlPlane(plane.kubeconfig, KubeApi.from_kubeconfig(plane.kubeconfig), plane)
        finally:
            plane.stop()


@pytest.fixture(scope="session")
def admin_kubeconfig(control_plane: ControlPlane) -> Path:
    """Kubeconfig of a system:masters user."""
    return control_plane.kubeconfig


@pytest.fixture(scope="session")
def kube_api(control_plane: ControlPlane) -> KubeApi:
    """Admin JSON REST access (rljob.testing.kubeaccess.KubeApi)."""
    return control_plane.api


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kube_api: KubeApi) -> Iterator[str]:
    """A fresh namespace per test, returned once its default ServiceAccount exists (pods are admitted).
    Deletion is requested afterwards and left to the namespace controller (not awaited)."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{uuid.uuid4().hex[:6]}"
    create_namespace(kube_api, name, labels={"rljob.io/e2e": "true"})
    yield name
    delete_namespace(kube_api, name)


@pytest.fixture(scope="session")
def kubectl(admin_kubeconfig: Path) -> Kubectl:
    return Kubectl(admin_kubeconfig)


KubeletFactory = Callable[..., Kubelet]


@pytest.fixture
def kubelet_factory(admin_kubeconfig: Path, namespace: str, tmp_path: Path) -> Iterator[KubeletFactory]:
    """make(mapping=..., namespaces=[namespace], **Kubelet kwargs) -> a started Kubelet with its nodes
    registered (default: 2 nodes of 8 GPUs), stopped at teardown (its processes killed, its nodes
    deleted, so the next test's pods never land on them). Scratch dirs and logs: tmp_path/kubelet-N."""
    started: list[Kubelet] = []

    def make(mapping: Mapping = default_mapping, namespaces: list[str] | None = None, **kw: Any) -> Kubelet:
        kw.setdefault("scratch_root", tmp_path / f"kubelet-{len(started)}")
        # Unique node names per test: a pod left bound to an earlier test's node never counts here.
        kw.setdefault("node_prefix", f"gpu-{namespace[-6:]}-{len(started)}")
        kubelet = Kubelet(admin_kubeconfig, namespaces or [namespace], mapping, **kw)
        started.append(kubelet)
        return kubelet.start()

    yield make
    for kubelet in started:
        kubelet.stop()


@pytest.fixture
def kubelet(kubelet_factory: KubeletFactory) -> Kubelet:
    """A fake kubelet (2 GPU nodes) for the test's namespace that runs command + args as given."""
    return kubelet_factory()


@pytest.fixture(scope="session")
def rljob_crd(kubectl: Kubectl) -> None:
    """The project's CRDs, applied (idempotent) and Established."""
    kubectl("apply", "-f", str(ROOT / "crds"))
    kubectl("wait", "--for=condition=Established", "crd/rljobs.rljob.io", "--timeout=30s")


def simulated_rljob(
    name: str, replicas: int = 2, iterations: int = 2, train_seconds: float = 0.5, sim_args: str = ""
) -> dict[str, Any]:
    """examples/rljob.yaml (one nvidia.com/gpu per pod) renamed, with its own claim and a quick emulator:
    what a user applies, sized for a test."""
    manifest = copy.deepcopy(yaml.safe_load((ROOT / "examples/rljob.yaml").read_text()))
    manifest["metadata"] = {"name": name}
    spec = manifest["spec"]
    spec.update(replicas=replicas, iterations=iterations, podsAfterFinished="Keep")
    spec["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] = f"{name}-weights"
    sglang, trainer = spec["template"]["spec"]["containers"]
    emulator = {"name": SIM_ARGS_ENV, "value": f"--tokens-per-second 0 {sim_args}"}
    sglang["env"] = [*sglang.get("env", []), emulator]
    trainer["args"] = ["--prompts", "2", "--samples-per-prompt", "2", "--train-seconds", str(train_seconds)]
    return dict(manifest)


@pytest.fixture
def simulated_rljob_factory() -> Callable[..., dict[str, Any]]:
    """simulated_rljob(name, replicas=, iterations=, train_seconds=, sim_args=) -> an RLJob manifest."""
    return simulated_rljob
