"""Kueue (sigs.k8s.io/kueue) in the test world: its CRDs and RBAC from its Go module, its manager binary
(hack/build-kueue.sh) run against a LocalControlPlane, and quota objects for the simulated GPU nodes.

Nothing here is committed from Kueue: the CRDs, the manager's ClusterRole/Role and the empty webhook
Secret are read at install time from the module cache (`go env GOMODCACHE`/sigs.k8s.io/kueue@<version>/
config/components), with the same renames Kueue's kustomization applies (config/default/
kustomization.yaml@v0.17.0: namespace kueue-system, name prefix `kueue-`).

How it runs (why each setting, cmd/kueue/main.go@v0.17.0):
- leader election off (one replica); health and metrics on free loopback ports;
- its own ServiceAccount `kueue-controller-manager` with exactly Kueue's RBAC (a TokenRequest token);
- no webhook configurations are registered with the API server, so nothing Kueue serves sits in the
  request path of the API server. Kueue's webhooks only add a finalizer to ClusterQueues/
  ResourceFlavors and drop `minCount` from Workloads (pkg/webhooks/*_webhook.go@v0.17.0): the objects
  made here are complete without them;
- internal certificate management stays on: with it off the manager insists on metrics certificates
  at the fixed path /etc/kueue/metrics/certs (main.go:223-242). Its cert rotator fills the webhook
  Secret, injects the CA into the CRDs' conversion stanza (so the CRDs carry that stanza, as Kueue's own
  install does: config/components/crd/patches/webhook_in_*.yaml) and waits for the Secret's files in
  webhook.certDir, where a kubelet would mount them; LocalKueue writes them there itself. No Service
  routes to the webhook server, so only the storage version v1beta2 is usable (reading v1beta1 would
  need the conversion webhook); everything here uses v1beta2;
- the visibility API server (an aggregated API) is off: it is not needed and would bind a fixed port;
- `RLJob.v1alpha1.rljob.io` is listed in integrations.externalFrameworks, as Kueue documents for an
  external integration (site/content/en/docs/tasks/dev/integrate_a_custom_job.md). That registers the
  kind in a lookup table only (pkg/controller/jobframework/integrationmanager.go:149-169@v0.17.0): Kueue
  builds no controller for it; the rljob operator itself creates and follows the Workloads.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from rljob.testing.cluster import ControlPlaneError, binary_path, die_with_parent, free_port
from rljob.testing.kubeaccess import (
    ApiError,
    JsonObj,
    KubeApi,
    service_account_kubeconfig,
    wait_for,
)

# Pinned version; hack/kueue/go.mod must agree (tests/unit/test_kueue_world.py checks it).
KUEUE_VERSION = "v0.17.0"
KUEUE_MODULE = "sigs.k8s.io/kueue"
NAMESPACE = "kueue-system"
SERVICE_ACCOUNT = "kueue-controller-manager"
NAME_PREFIX = "kueue-"  # what Kueue's kustomization prefixes to every namespaced/RBAC object
GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta2"  # the storage version of every Kueue CRD in v0.17.0
RLJOB_FRAMEWORK = "RLJob.v1alpha1.rljob.io"
GPU = "nvidia.com/gpu"

# The CRDs Kueue's own install gives a conversion webhook (config/components/crd/kustomization.yaml:19-24).
_CONVERTED = ("localqueues", "clusterqueues", "cohorts", "workloads", "multikueueclusters")
# Kueue's RBAC for its manager (config/components/rbac/kustomization.yaml), leader election left out.
_RBAC_FILES = (
    "service_account.yaml",
    "role.yaml",
    "role_binding.yaml",
    "manager_secrets_role.yaml",
    "manager_secrets_role_binding.yaml",
    "metrics_auth_role.yaml",
    "metrics_auth_role_binding.yaml",
)


def repo_root() -> Path | None:
    root = Path(__file__).resolve().parents[3]
    return root if (root / "hack" / "kueue" / "go.mod").is_file() else None


def kueue_binary() -> Path:
    return binary_path("kueue", KUEUE_VERSION)


def ensure_kueue_binary(build: bool = True) -> Path:
    """The cached manager binary, built with hack/build-kueue.sh if missing and allowed."""
    binary = kueue_binary()
    if os.access(binary, os.X_OK):
        return binary
    root = repo_root()
    if not build or root is None:
        raise ControlPlaneError(
            f"missing {binary}; build it with hack/build-kueue.sh (needs Go and the Go proxy)"
        )
    print("rljob.testing.kueue: building Kueue with hack/build-kueue.sh", file=sys.stderr, flush=True)
    done = subprocess.run(["bash", str(root / "hack" / "build-kueue.sh")], check=False)
    if done.returncode != 0 or not os.access(binary, os.X_OK):
        raise ControlPlaneError(f"hack/build-kueue.sh failed (exit {done.returncode})")
    return binary


@cache
def module_dir() -> Path:
    """Kueue's module source in the Go module cache (downloaded from the proxy when absent)."""
    env = {**os.environ, "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=mod"}
    root = repo_root()
    cwd = root / "hack" / "kueue" if root else None
    try:
        done = subprocess.run(
            ["go", "mod", "download", "-json", f"{KUEUE_MODULE}@{KUEUE_VERSION}"],
            capture_output=True, text=True, env=env, cwd=cwd, timeout=600, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ControlPlaneError(f"go mod download {KUEUE_MODULE}@{KUEUE_VERSION}: {exc}") from None
    if done.returncode != 0:
        raise ControlPlaneError(
            f"go mod download {KUEUE_MODULE}@{KUEUE_VERSION}: {done.stderr or done.stdout}"
        )
    path = Path(json.loads(done.stdout)["Dir"])
    if not (path / "config" / "components" / "crd" / "bases").is_dir():
        raise ControlPlaneError(f"{path} has no config/components/crd/bases")
    return path


def _load(path: Path) -> list[JsonObj]:
    # libyaml's loader when PyYAML has it: the Workload CRD is 1.4 MB of YAML.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return [doc for doc in yaml.load_all(path.read_text(), Loader=loader) if doc]


def crds(source: Path | None = None) -> list[JsonObj]:
    """Kueue's CRDs, the converted ones with the conversion stanza its install adds (namespace and
    Service renamed as its kustomization does)."""
    components = (source or module_dir()) / "config" / "components" / "crd"
    out = []
    for path in sorted((components / "bases").glob("*.yaml")):
        for crd in _load(path):
            plural = crd["spec"]["names"]["plural"]
            if plural in _CONVERTED:
                patch = _load(components / "patches" / f"webhook_in_{plural}.yaml")[0]
                conversion = copy.deepcopy(patch["spec"]["conversion"])
                service = conversion["webhook"]["clientConfig"]["service"]
                service["namespace"] = NAMESPACE
                service["name"] = NAME_PREFIX + service["name"]
                crd["spec"]["conversion"] = conversion
            out.append(crd)
    return out


def rbac(source: Path | None = None) -> list[JsonObj]:
    """Kueue's manager ServiceAccount, ClusterRoles, Role and bindings, renamed like its kustomization."""
    rbac_dir = (source or module_dir()) / "config" / "components" / "rbac"
    out = []
    for name in _RBAC_FILES:
        for obj in _load(rbac_dir / name):
            meta = obj["metadata"]
            meta["name"] = NAME_PREFIX + meta["name"]
            if "namespace" in meta:
                meta["namespace"] = NAMESPACE
            if "roleRef" in obj:
                obj["roleRef"]["name"] = NAME_PREFIX + obj["roleRef"]["name"]
            for subject in obj.get("subjects", []):
                subject["name"] = NAME_PREFIX + subject["name"]
                subject["namespace"] = NAMESPACE
            out.append(obj)
    return out


def webhook_secret(source: Path | None = None) -> JsonObj:
    """The empty Secret Kueue's cert rotator fills (its RBAC may update it, not create it)."""
    secret = _load((source or module_dir()) / "config" / "components" / "internalcert" / "secret.yaml")[0]
    secret["metadata"] = {"name": NAME_PREFIX + secret["metadata"]["name"], "namespace": NAMESPACE}
    return secret


def _collection(obj: JsonObj) -> str:
    """The REST collection path of a manifest object (the kinds this module creates)."""
    api_version, kind = obj["apiVersion"], obj["kind"]
    plural = {
        "CustomResourceDefinition": "customresourcedefinitions",
        "ServiceAccount": "serviceaccounts",
        "Secret": "secrets",
        "Namespace": "namespaces",
        "ClusterRole": "clusterroles",
        "ClusterRoleBinding": "clusterrolebindings",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "ResourceFlavor": "resourceflavors",
        "ClusterQueue": "clusterqueues",
        "LocalQueue": "localqueues",
        "WorkloadPriorityClass": "workloadpriorityclasses",
        "Workload": "workloads",
    }[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    namespace = obj["metadata"].get("namespace")
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def object_path(obj: JsonObj) -> str:
    return f"{_collection(obj)}/{obj['metadata']['name']}"


def apply(api: KubeApi, obj: JsonObj) -> JsonObj:
    """Creates the object, or replaces an existing one's spec/rules/data (keeping its resourceVersion)."""
    try:
        return api.post(_collection(obj), obj)
    except ApiError as exc:
        if exc.status != 409:
            raise
    path = object_path(obj)
    for _ in range(5):
        current = api.get(path)
        body = copy.deepcopy(obj)
        body["metadata"] = {**obj["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}
        if "status" in current and obj["kind"] == "CustomResourceDefinition":
            # Keep the CA the cert rotator injected into the conversion stanza: Kueue's rotator only
            # re-injects on a Secret event.
            bundle = (current["spec"].get("conversion") or {}).get("webhook", {}).get("clientConfig", {})
            if bundle.get("caBundle") and body["spec"].get("conversion", {}).get("webhook"):
                body["spec"]["conversion"]["webhook"]["clientConfig"]["caBundle"] = bundle["caBundle"]
        try:
            return api.request("PUT", path, body)
        except ApiError as exc:
            if exc.status != 409:
                raise
    raise ControlPlaneError(f"{path}: conflicts on every update")


def install_crds(api: KubeApi, source: Path | None = None, timeout: float = 60.0) -> list[str]:
    """Creates (or updates) Kueue's CRDs and waits until each is Established. Returns their names."""
    names = []
    for crd in crds(source):
        apply(api, crd)
        names.append(crd["metadata"]["name"])

    def established() -> bool:
        for name in names:
            crd = api.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conds = {c["type"]: c["status"] for c in crd.get("status", {}).get("conditions", [])}
            if conds.get("Established") != "True":
                return False
        return True

    wait_for(established, timeout=timeout, interval=0.2, what="Kueue's CRDs Established")
    return names


class LocalKueue:
    """Kueue's manager against the API server of `admin_kubeconfig`, state and logs under `workdir`.
    Use as a context manager, or start()/stop()."""

    def __init__(
        self,
        admin_kubeconfig: Path | str,
        workdir: Path | str,
        binary: Path | None = None,
        die_with_parent: bool = True,
        extra_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.admin_kubeconfig = Path(admin_kubeconfig)
        self.workdir = Path(workdir).resolve()
        self.binary = binary
        self.die_with_parent = die_with_parent
        self.extra_config = dict(extra_config or {})
        self.api = KubeApi.from_kubeconfig(self.admin_kubeconfig)
        self.proc: subprocess.Popen[bytes] | None = None
        self.health_port = 0
        self.metrics_port = 0
        self.webhook_port = 0

    @property
    def log_file(self) -> Path:
        return self.workdir / "kueue.log"

    @property
    def kubeconfig(self) -> Path:
        """Kueue's own credentials: its ServiceAccount, bound to its RBAC only."""
        return self.workdir / "kueue.kubeconfig"

    def config(self) -> JsonObj:
        """The manager's Configuration (config.kueue.x-k8s.io/v1beta2)."""
        cfg: JsonObj = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": f"127.0.0.1:{self.metrics_port}"},
            "webhook": {
                "host": "127.0.0.1",
                "port": self.webhook_port,
                "certDir": str(self.cert_dir),
            },
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {
                "enable": True,
                "webhookServiceName": f"{NAME_PREFIX}webhook-service",
                "webhookSecretName": webhook_secret()["metadata"]["name"],
            },
            "clientConnection": {"qps": 50, "burst": 100},
            "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [RLJOB_FRAMEWORK]},
            "featureGates": {"VisibilityOnDemand": False},
        }
        cfg.update(self.extra_config)
        return cfg

    def install(self) -> None:
        """CRDs, the kueue-system namespace, Kueue's RBAC and its webhook Secret (idempotent)."""
        install_crds(self.api)
        with contextlib.suppress(ApiError):
            self.api.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": NAMESPACE}})  # fmt: skip
        for obj in rbac():
            apply(self.api, obj)
        with contextlib.suppress(ApiError):  # exists: keep the certificate already in it
            self.api.post(_collection(webhook_secret()), webhook_secret())

    def start(self, timeout: float = 120.0) -> LocalKueue:
        binary = self.binary or ensure_kueue_binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.install()
        service_account_kubeconfig(self.admin_kubeconfig, NAMESPACE, SERVICE_ACCOUNT, self.kubeconfig,
                                   create=False)  # fmt: skip
        self.health_port, self.metrics_port, self.webhook_port = free_port(), free_port(), free_port()
        config = self.workdir / "kueue-config.yaml"
        config.write_text(json.dumps(self.config(), indent=2))  # JSON is YAML
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", str(self.workdir)),
            "KUBECONFIG": str(self.kubeconfig),
        }
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), f"--config={config}", "--zap-log-level=info"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=self.workdir, start_new_session=True,
                preexec_fn=die_with_parent if self.die_with_parent else None,
            )  # fmt: skip
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def cert_dir(self) -> Path:
        return self.workdir / "webhook-certs"

    def _mount_webhook_secret(self) -> bool:
        """What the kubelet does for Kueue's Deployment (a Secret volume at webhook.certDir): the cert
        rotator fills the Secret, then waits for its files to appear there before the manager starts
        (cert-controller pkg/rotator/rotator.go:877-898@v0.16.0). True once the files are written."""
        secret = self.api.get(object_path(webhook_secret()))
        data = secret.get("data") or {}
        if "tls.crt" not in data or "tls.key" not in data:
            return False
        self.cert_dir.mkdir(parents=True, exist_ok=True)
        for key, value in data.items():
            tmp = self.cert_dir / f".{key}.tmp"
            tmp.write_bytes(base64.b64decode(value))
            tmp.chmod(0o600)
            tmp.replace(self.cert_dir / key)
        return True

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout
        last = ""
        mounted = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ControlPlaneError(f"kueue exited with {self.proc.returncode}:\n{self.tail()}")
            if not mounted:
                mounted = self._mount_webhook_secret()
            try:
                with opener.open(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.3)
        raise ControlPlaneError(f"kueue not ready after {timeout}s ({last}):\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)

    def __enter__(self) -> LocalKueue:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- quota objects for the simulated GPU nodes ---------------------------------------------------------
def resource_flavor(name: str = "sim-gpu", node_labels: Mapping[str, str] | None = None) -> JsonObj:
    """A ResourceFlavor. Without node labels it stands for every node (the fake kubelet's GPU nodes)."""
    spec: JsonObj = {"nodeLabels": dict(node_labels)} if node_labels else {}
    return {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": spec}


def cluster_queue(
    name: str,
    gpus: int | str,
    flavor: str = "sim-gpu",
    cpu: str = "1000",
    memory: str = "10Ti",
    preemption: str = "LowerPriority",
    namespace_selector: Mapping[str, Any] | None = None,
) -> JsonObj:
    """A ClusterQueue whose GPU quota is `gpus`. Kueue admits a workload only when every resource its pods
    request is covered, so CPU and memory are covered too, with quotas large enough never to bind.
    `preemption` is withinClusterQueue (LowerPriority: a higher-priority workload evicts lower ones)."""
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": dict(namespace_selector or {}),  # {}: every namespace
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", GPU],
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [
                                {"name": "cpu", "nominalQuota": cpu},
                                {"name": "memory", "nominalQuota": memory},
                                {"name": GPU, "nominalQuota": str(gpus)},
                            ],
                        }
                    ],
                }
            ],
            "preemption": {"withinClusterQueue": preemption},
        },
    }


def local_queue(namespace: str, name: str, cluster_queue_name: str) -> JsonObj:
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue_name},
    }


def workload_priority_class(name: str, value: int, description: str = "") -> JsonObj:
    return {
        "apiVersion": API_VERSION,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
        "description": description,
    }


def workloads(api: KubeApi, namespace: str) -> list[JsonObj]:
    items: list[JsonObj] = api.get(f"/apis/{API_VERSION}/namespaces/{namespace}/workloads")["items"]
    return items


def condition(obj: JsonObj, kind: str) -> JsonObj | None:
    for cond in obj.get("status", {}).get("conditions", []) or []:
        if cond.get("type") == kind:
            return dict(cond)
    return None


def is_true(obj: JsonObj, kind: str) -> bool:
    cond = condition(obj, kind)
    return cond is not None and cond.get("status") == "True"


def cluster_queue_ready(api: KubeApi, name: str, timeout: float = 30.0) -> JsonObj:
    """Waits until Kueue reports the ClusterQueue Active (its flavors exist and it is usable)."""

    def active() -> JsonObj | None:
        cq = api.get(f"/apis/{API_VERSION}/clusterqueues/{name}")
        return cq if is_true(cq, "Active") else None

    return wait_for(active, timeout=timeout, interval=0.2, what=f"ClusterQueue {name} Active")
