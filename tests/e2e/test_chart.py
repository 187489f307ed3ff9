"""The Helm chart, installed as a user would: real helm, real kubectl, the real local kube-apiserver.

- `helm lint --strict` is clean; `helm template` output passes a server-side dry run;
- bad values are refused by values.schema.json with the field named, at template and at install time;
- `helm install` creates the CRD (from the chart's crds/), the ServiceAccount, exactly the RBAC the
  operator needs (checked rule by rule and with `kubectl auth can-i --as=` the operator's identity),
  and `helm uninstall` removes everything but the CRD (crds/ CRDs are never deleted by helm);
- a TokenRequest token of the chart's ServiceAccount gets 403 outside its rights, and the real operator
  started with it drives an RLJob's children and finalizer without a single Forbidden.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from rljob.emulator.probe import PROBE as EMULATOR_PROBE
from rljob.testing.cluster import ControlPlaneError, ensure_binaries
from rljob.testing.harness import ROOT, OperatorProcess
from rljob.testing.install import (
    CHART,
    HelmError,
    install_chart,
    operator_kubeconfig,
    run_helm,
    uninstall_chart,
)
from rljob.testing.kubeaccess import ApiError, KubeApi, Kubectl, create_namespace, delete_namespace, wait_for

pytestmark = pytest.mark.e2e

SA = "rljob-operator"
CRD = "rljobs.rljob.io"

# (apiGroup, resource, verb): everything the operator's Role/ClusterRole may grant, and nothing more.
# operator/rljob/controller/kube.py + kopf (watch/list, annotation and finalizer patches).
OPERATOR_RIGHTS = frozenset(
    [("rljob.io", "rljobs", v) for v in ("get", "list", "watch", "patch", "delete")]
    + [("rljob.io", "rljobs/status", "patch"), ("rljob.io", "rljobs/finalizers", "update")]
    + [("", "pods", v) for v in ("list", "watch", "create", "delete")]
    + [("", "secrets", v) for v in ("get", "create", "delete")]
    + [("", "services", v) for v in ("create", "delete")]
    + [("", "events", "create")]
    # Kueue: the Workloads of queued RLJobs (operator/rljob/controller/queueing.py).
    + [("kueue.x-k8s.io", "workloads", v) for v in ("get", "list", "watch", "create", "patch", "delete")]
    + [("kueue.x-k8s.io", "workloads/status", "patch")]
)
# kopf's read-only cluster observation (rbac.scanning, on by default): CRDs always, namespaces when the
# operator is given namespaces. Without them kopf retries each forbidden call for ~1 min at start.
SCAN_CRDS = frozenset([("apiextensions.k8s.io", "customresourcedefinitions", v) for v in ("list", "watch")])
SCAN_NAMESPACES = frozenset([("", "namespaces", v) for v in ("list", "watch")])
# Leader election (controller/leader.py): create any Lease, get/update only the operator's own.
LEADER_RULES = [
    {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    {
        "apiGroups": ["coordination.k8s.io"],
        "resources": ["leases"],
        "resourceNames": ["rljob-operator"],
        "verbs": ["get", "update"],
    },
]
LEADER_ROLE = "rljob-operator-leader-election"


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return ensure_binaries(build=True).helm
    except ControlPlaneError as exc:
        pytest.fail(f"the chart tests need helm: {exc}", pytrace=False)


def helm_template(helm: Path, *args: str, namespace: str = "rljob-system") -> str:
    return run_helm(helm, ["template", "rljob", str(CHART), f"--namespace={namespace}", *args]).stdout


def set_args(values: Sequence[str]) -> list[str]:
    return [arg for v in values for arg in ("--set", v)]


def rules_of(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    """The (apiGroup, resource, verb) triples a Role/ClusterRole grants (no resourceNames or URLs)."""
    triples = set()
    for rule in role.get("rules", []):
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for verb in rule.get("verbs", []):
                    triples.add((group, resource, verb))
    return triples


def can_i(
    kubectl: Kubectl, identity: str, checks: Sequence[tuple[str, ...]], namespace: str | None
) -> dict[tuple[str, ...], bool]:
    """`kubectl auth can-i VERB RESOURCE [--subresource=...] --as=IDENTITY`, concurrently."""

    def one(check: tuple[str, ...]) -> bool:
        done = kubectl("auth", "can-i", *check, f"--as={identity}", namespace=namespace, check=False)
        answer = done.stdout.strip()
        assert answer in ("yes", "no"), f"can-i {check}: {done.stdout}{done.stderr}"
        return answer == "yes"

    with ThreadPoolExecutor(max_workers=8) as pool:
        return dict(zip(checks, pool.map(one, checks), strict=True))


def identity(namespace: str) -> str:
    return f"system:serviceaccount:{namespace}:{SA}"


@dataclass(frozen=True)
class Release:
    name: str
    namespace: str  # the release's (and the operator's) namespace
    watched: str
    unwatched: str
    output: str


@pytest.fixture(scope="module")
def namespaced_release(
    helm: Path, admin_kubeconfig: Path, kube_api: KubeApi, kubectl: Kubectl
) -> Iterator[Release]:
    """The chart installed with rbac.scope=namespaced, watching one fresh namespace."""
    suffix = uuid.uuid4().hex[:6]
    watched, unwatched = f"chart-watched-{suffix}", f"chart-unwatched-{suffix}"
    for ns in (watched, unwatched):
        create_namespace(kube_api, ns, labels={"rljob.io/e2e": "true"})
    release = Release(f"rljob-{suffix}", f"rljob-system-{suffix}", watched, unwatched, "")
    out = install_chart(helm, admin_kubeconfig, release.name, release.namespace, [watched])
    kubectl("wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=30s")
    # Established is not served yet: a new CRD's storage answers 429 for a moment.
    wait_for(
        lambda: kube_api.get(f"/apis/rljob.io/v1alpha1/namespaces/{watched}/rljobs"), what="rljobs served"
    )
    yield Release(release.name, release.namespace, watched, unwatched, out)
    with contextlib.suppress(HelmError):  # already gone if a test uninstalled it
        uninstall_chart(helm, admin_kubeconfig, release.name, release.namespace)
    for ns in (watched, unwatched, release.namespace):
        delete_namespace(kube_api, ns)


# --- offline: lint, render, schema ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [
        [],
        [
            "rbac.scope=namespaced",
            "watchNamespaces={team-a,team-b}",
            "networkPolicy.enabled=true",
            "metrics.serviceMonitor.enabled=true",
        ],
        ["watchNamespaces={team-*,!team-x}", "image.digest=sha256:" + "a" * 64, "operator.logJson=false"],
    ],
    ids=["defaults", "namespaced-all-options", "cluster-patterns"],
)
def test_helm_lint_is_clean(helm: Path, values: list[str]) -> None:
    out = run_helm(helm, ["lint", "--strict", str(CHART), *set_args(values)]).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


def test_rendering_follows_values(helm: Path) -> None:
    """Args, images, scope and the optional objects come from values; the security settings are fixed."""
    docs = [d for d in yaml.safe_load_all(helm_template(helm)) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "Role",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    deploy = next(d for d in docs if d["kind"] == "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # Two replicas, one acting: the other waits for the Lease.
    assert deploy["spec"]["replicas"] == 2 and deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    (leader_role,) = [d for d in docs if d["kind"] == "Role"]
    assert leader_role["metadata"] == {
        **leader_role["metadata"],
        "name": LEADER_ROLE,
        "namespace": "rljob-system",
    }
    assert leader_role["rules"] == LEADER_RULES
    assert "--leader-elect" in container["args"] and "--leader-elect-name=rljob-operator" in container["args"]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert container["image"] == "ghcr.io/rljob/rljob-operator:0.1.0"
    assert container["args"][:4] == [
        "--all-namespaces",
        "--agent-image=ghcr.io/rljob/rljob-agent:0.1.0",
        "--agent-image-pull-policy=IfNotPresent",
        "--agent-gpu-probe=nvml",
    ]
    assert "--log-json" in container["args"] and "--metrics-port=9090" in container["args"]
    assert "--health-endpoint=http://0.0.0.0:8080/healthz" in container["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"metrics": 9090, "health": 8080}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["runAsNonRoot"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert pod["serviceAccountName"] == SA
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    assert rules_of(cluster_role) == OPERATOR_RIGHTS | SCAN_CRDS
    # A changed CRD rolls the operator (kopf has no right to watch CRDs, it rescans at start).
    assert len(deploy["spec"]["template"]["metadata"]["annotations"]["checksum/crd"]) == 64

    docs = [
        d
        for d in yaml.safe_load_all(
            helm_template(
                helm,
                *set_args(
                    [
                        "rbac.scope=namespaced",
                        "watchNamespaces={team-a,team-b}",
                        "networkPolicy.enabled=true",
                        "metrics.serviceMonitor.enabled=true",
                        "agent.image.tag=dev",
                        "agent.gpuProbe=" + EMULATOR_PROBE,
                    ]
                ),
            )
        )
        if d
    ]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    # Namespaced: the application rights only in the watched namespaces; cluster-wide, only kopf's scan.
    (scanning,) = by_kind["ClusterRole"]
    # Cluster-scoped names carry the release namespace: teams can each install under the same release name.
    assert scanning["metadata"]["name"] == "rljob-operator-rljob-system-scanning"
    assert rules_of(scanning) == SCAN_CRDS | SCAN_NAMESPACES
    assert by_kind["ClusterRoleBinding"][0]["roleRef"]["name"] == scanning["metadata"]["name"]
    by_kind["Role"] = [r for r in by_kind["Role"] if r["metadata"]["name"] != LEADER_ROLE]
    by_kind["RoleBinding"] = [r for r in by_kind["RoleBinding"] if r["metadata"]["name"] != LEADER_ROLE]
    assert sorted(r["metadata"]["namespace"] for r in by_kind["Role"]) == ["team-a", "team-b"]
    assert sorted(r["metadata"]["namespace"] for r in by_kind["RoleBinding"]) == ["team-a", "team-b"]
    for role in by_kind["Role"]:
        assert rules_of(role) == OPERATOR_RIGHTS
    args = by_kind["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:3] == [
        "--namespace=team-a",
        "--namespace=team-b",
        "--agent-image=ghcr.io/rljob/rljob-agent:dev",
    ]
    assert f"--agent-gpu-probe={EMULATOR_PROBE}" in args
    (monitor,) = by_kind["ServiceMonitor"]
    (service,) = by_kind["Service"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"] == "metrics"
    policies = by_kind["NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    for policy in policies:
        spec = policy["spec"]
        assert spec["podSelector"] == {"matchExpressions": [{"key": "rljob.io/job", "operator": "Exists"}]}
        from_operator, from_gang = spec["ingress"]
        assert from_operator["ports"] == [{"protocol": "TCP", "port": 8471}]
        peer = from_operator["from"][0]
        assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "rljob-system"}
        assert (
            peer["podSelector"]["matchLabels"].items()
            <= by_kind["Deployment"][0]["spec"]["template"]["metadata"]["labels"].items()
        )
        # Gang members reach each other on every port except the agent's.
        tcp = [(p["port"], p["endPort"]) for p in from_gang["ports"] if p["protocol"] == "TCP"]
        assert tcp == [(1, 8470), (8472, 65535)]

    def cluster_rules(*values: str) -> list[set[tuple[str, str, str]]]:
        rendered = yaml.safe_load_all(helm_template(helm, *set_args(values)))
        return [rules_of(d) for d in rendered if d and d["kind"] == "ClusterRole"]

    # rbac.scanning=false: a namespaced install has no cluster-scoped rights at all...
    assert cluster_rules("rbac.scope=namespaced", "watchNamespaces={a}", "rbac.scanning=false") == []
    assert cluster_rules("rbac.scanning=false") == [set(OPERATOR_RIGHTS)]
    # ...but kopf can only resolve patterns by listing namespaces.
    assert cluster_rules("watchNamespaces={team-*}", "rbac.scanning=false") == [
        OPERATOR_RIGHTS | SCAN_NAMESPACES
    ]
    assert cluster_rules("watchNamespaces={team-*}") == [OPERATOR_RIGHTS | SCAN_CRDS | SCAN_NAMESPACES]


@pytest.mark.parametrize(
    ("values", "field"),
    [
        (["rbac.scope=bogus"], "'/rbac/scope'"),
        (["replicas=2"], "'replicas' not allowed"),  # HA is not offered: see the chart README
        (["agent.gpuProbe=cuda"], "'/agent/gpuProbe'"),
        (["metrics.port=70000"], "'/metrics/port'"),
        (["image.pullPolicy=Sometimes"], "'/image/pullPolicy'"),
        (["image.digest=sha256:nope"], "'/image/digest'"),
        (["rbac.scope=namespaced"], "'/watchNamespaces'"),  # namespaced needs namespaces
        (["rbac.scope=namespaced", "watchNamespaces={team-*}"], "'/watchNamespaces/0'"),
        (["networkPolicy.enabled=true"], "'/watchNamespaces'"),
        (["watchNamespaces={Team_A}"], "'/watchNamespaces/0'"),
        (["resources.limits.memory=lots"], "'/resources/limits/memory'"),
    ],
)
def test_schema_refuses_bad_values_naming_the_field(helm: Path, values: list[str], field: str) -> None:
    with pytest.raises(HelmError) as err:
        helm_template(helm, *set_args(values))
    assert "values don't meet the specifications of the schema" in err.value.stderr
    assert field in err.value.stderr, err.value.stderr


# --- against the real API server -----------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["cluster", "namespaced"])
def test_rendered_chart_passes_server_side_dry_run(
    helm: Path, kubectl: Kubectl, kube_api: KubeApi, namespace: str, scope: str
) -> None:
    second = f"{namespace}-b"
    create_namespace(kube_api, second)
    try:
        watch = f"watchNamespaces={{{namespace},{second}}}"
        values = [f"rbac.scope={scope}", watch, "networkPolicy.enabled=true"]
        manifest = helm_template(helm, "--include-crds", *set_args(values), namespace=namespace)
        done = kubectl(
            "apply",
            "--server-side",
            "--dry-run=server",
            "--field-manager=helm-dry-run",
            "-f",
            "-",
            input=manifest,
        )
    finally:
        delete_namespace(kube_api, second)
    applied = sorted(line.split()[0].split("/")[0] for line in done.stdout.splitlines())
    cluster_rbac = ["clusterrole.rbac.authorization.k8s.io", "clusterrolebinding.rbac.authorization.k8s.io"]
    cluster_rbac += ["role.rbac.authorization.k8s.io", "rolebinding.rbac.authorization.k8s.io"]  # the Lease
    expected = {
        "cluster": cluster_rbac,  # the operator's ClusterRole (with kopf's scan)
        "namespaced": cluster_rbac  # kopf's scan only
        + ["role.rbac.authorization.k8s.io"] * 2
        + ["rolebinding.rbac.authorization.k8s.io"] * 2,
    }[scope]
    assert applied == sorted(
        [
            "customresourcedefinition.apiextensions.k8s.io",
            "deployment.apps",
            "networkpolicy.networking.k8s.io",
            "networkpolicy.networking.k8s.io",
            "service",
            "serviceaccount",
            *expected,
        ]
    ), done.stdout
    assert all("(server dry run)" in line for line in done.stdout.splitlines())


def test_install_refuses_bad_values_and_creates_nothing(
    helm: Path, admin_kubeconfig: Path, kubectl: Kubectl, namespace: str
) -> None:
    with pytest.raises(HelmError) as err:
        bad = {"rbac": {"scope": "everywhere"}}
        install_chart(helm, admin_kubeconfig, "bad", namespace, [namespace], bad)
    assert "'/rbac/scope'" in err.value.stderr
    listed = run_helm(helm, ["list", "--all", f"--namespace={namespace}", "--output=json"], admin_kubeconfig)
    assert json.loads(listed.stdout) == []
    assert kubectl("get", "serviceaccount", SA, namespace=namespace, check=False).returncode != 0


def test_install_creates_crd_account_and_namespaced_rbac(
    namespaced_release: Release, kubectl: Kubectl
) -> None:
    rel = namespaced_release
    assert "kubectl get rljob" in rel.output and "kubectl rljob status NAME" in rel.output  # NOTES.txt
    assert "examples/rljob-vllm.yaml" in rel.output
    crd = kubectl.json("get", "crd", CRD)
    assert crd["spec"]["versions"][0]["name"] == "v1alpha1"
    assert crd["spec"]["versions"][0]["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    assert columns["Engine"] == ".spec.engine"
    # The chart's CRD admits a job on either engine, its engine's defaults left to the models.
    for example in ("rljob.yaml", "rljob-vllm.yaml"):
        path = str(ROOT / "examples" / example)
        dry = kubectl("apply", "--dry-run=server", "-f", path, namespace=rel.watched)
        assert "(server dry run)" in dry.stdout, dry.stdout
    account = kubectl.json("get", "serviceaccount", SA, namespace=rel.namespace)
    assert account["metadata"]["labels"]["app.kubernetes.io/instance"] == rel.name
    deploy = kubectl.json(
        "get", "deployment", "-l", f"app.kubernetes.io/instance={rel.name}", namespace=rel.namespace
    )["items"]
    assert len(deploy) == 1
    args = deploy[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--namespace={rel.watched}" in args and f"--agent-gpu-probe={EMULATOR_PROBE}" in args
    roles = kubectl.json("get", "role", "-l", f"app.kubernetes.io/instance={rel.name}", namespace=rel.watched)
    assert len(roles["items"]) == 1 and rules_of(roles["items"][0]) == OPERATOR_RIGHTS
    scanning = kubectl.json("get", "clusterrole", "-l", f"app.kubernetes.io/instance={rel.name}")["items"]
    assert len(scanning) == 1 and rules_of(scanning[0]) == SCAN_CRDS | SCAN_NAMESPACES
    leader = f"{deploy[0]['metadata']['name']}-leader-election"  # the Lease's rights, nothing else
    for ns, allowed in ((rel.unwatched, []), (rel.namespace, [leader, leader])):
        got = kubectl.json(
            "get", "role,rolebinding", "-l", f"app.kubernetes.io/instance={rel.name}", namespace=ns
        )["items"]
        assert sorted(r["metadata"]["name"] for r in got) == allowed, ns


NEEDED = [
    ("list", "pods"),
    ("watch", "pods"),
    ("create", "pods"),
    ("delete", "pods"),
    ("get", "rljobs.rljob.io"),
    ("list", "rljobs.rljob.io"),
    ("watch", "rljobs.rljob.io"),
    ("patch", "rljobs.rljob.io"),
    ("delete", "rljobs.rljob.io"),
    ("patch", "rljobs.rljob.io", "--subresource=status"),
    ("create", "events"),
    ("get", "secrets"),
    ("create", "secrets"),
    ("delete", "secrets"),
    ("create", "services"),
    ("delete", "services"),
]
NOT_GRANTED = [
    ("*", "*"),
    ("get", "nodes"),
    ("list", "nodes"),
    ("create", "pods", "--subresource=exec"),
    ("create", "pods", "--subresource=attach"),
    ("get", "pods", "--subresource=log"),
    ("update", "pods"),
    ("patch", "pods"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("update", "secrets"),
    ("update", "rljobs.rljob.io", "--subresource=status"),
    ("create", "rljobs.rljob.io"),
    ("delete", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("create", "serviceaccounts", "--subresource=token"),
    ("get", "configmaps"),
    ("create", "deployments.apps"),
]


def test_operator_identity_can_do_what_it_needs_and_nothing_more(
    namespaced_release: Release, kubectl: Kubectl
) -> None:
    rel = namespaced_release
    who = identity(rel.namespace)
    watched = can_i(kubectl, who, NEEDED + NOT_GRANTED, rel.watched)
    assert [c for c in NEEDED if not watched[c]] == [], "missing rights in the watched namespace"
    assert [c for c in NOT_GRANTED if watched[c]] == [], "rights beyond the operator's needs"
    elsewhere = can_i(kubectl, who, NEEDED, rel.unwatched)
    assert [c for c in NEEDED if elsewhere[c]] == [], "namespaced scope leaks into an unwatched namespace"
    own = can_i(kubectl, who, [("get", "secrets"), ("list", "pods")], rel.namespace)
    assert not any(own.values()), "the operator needs nothing in its own namespace"
    cluster = can_i(
        kubectl,
        who,
        [
            ("list", "pods", "--all-namespaces"),
            ("get", "secrets", "--all-namespaces"),
            ("list", "namespaces"),  # kopf's scan: read-only
            ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
            ("get", "namespaces"),
            ("get", "customresourcedefinitions.apiextensions.k8s.io"),
            ("delete", "namespaces"),
            ("update", "customresourcedefinitions.apiextensions.k8s.io"),
        ],
        None,
    )
    assert [check for check, yes in cluster.items() if yes] == [
        ("list", "namespaces"),
        ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
    ]


def test_service_account_token_is_refused_outside_its_rights(
    namespaced_release: Release, kube_api: KubeApi, tmp_path: Path
) -> None:
    rel = namespaced_release
    kubeconfig = operator_kubeconfig(kube_api, None, rel.namespace, tmp_path / "sa.kubeconfig")
    sa_api = KubeApi.from_kubeconfig(kubeconfig)
    review = sa_api.post(
        "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )
    assert review["status"]["userInfo"]["username"] == identity(rel.namespace)
    assert sa_api.get(f"/api/v1/namespaces/{rel.watched}/pods")["items"] == []
    assert sa_api.get(f"/apis/rljob.io/v1alpha1/namespaces/{rel.watched}/rljobs")["items"] == []
    for path in (
        "/api/v1/nodes",
        f"/api/v1/namespaces/{rel.unwatched}/secrets/anything",
        f"/api/v1/namespaces/{rel.watched}/secrets",  # get by name only; never list
        f"/api/v1/namespaces/{rel.unwatched}/pods",
        "/api/v1/pods",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/rljobs.rljob.io",  # list/watch only
    ):
        with pytest.raises(ApiError) as err:
            sa_api.get(path)
        assert err.value.status == 403, path


def wait_with_log(
    probe: Callable[[], bool], operator: OperatorProcess, kubectl: Kubectl, namespace: str, what: str
) -> None:
    try:
        wait_for(probe, timeout=30, interval=0.2, what=what)
    except TimeoutError as exc:
        seen = kubectl("get", "rljob,pod,secret,service", "-o", "wide", namespace=namespace, check=False)
        status = kubectl(
            "get", "rljob", "-o", "jsonpath={.items[*].status}", namespace=namespace, check=False
        )
        raise AssertionError(
            f"{exc}\n--- objects:\n{seen.stdout}{seen.stderr}\n--- status: {status.stdout}\n"
            f"--- operator log:\n{operator.log_tail()}"
        ) from None


def test_operator_runs_with_exactly_the_charts_rights(
    namespaced_release: Release, kube_api: KubeApi, kubectl: Kubectl, tmp_path: Path
) -> None:
    """The real operator, as the chart's ServiceAccount: creates the token Secret, the Service and the gang
    pods, writes status, and on deletion its finalizer removes the children. No call is forbidden."""
    rel = namespaced_release
    kubeconfig = operator_kubeconfig(kube_api, None, rel.namespace, tmp_path / "sa.kubeconfig")
    job = yaml.safe_load((ROOT / "examples" / "rljob.yaml").read_text())
    name = job["metadata"]["name"]
    with OperatorProcess(kubeconfig, [rel.watched], tmp_path / "operator.log") as operator:
        kubectl.apply(job, namespace=rel.watched)

        def children() -> bool:
            pods = kubectl.json("get", "pods", "-l", f"rljob.io/job={name}", namespace=rel.watched)["items"]
            has = (
                kubectl(
                    "get", f"secret/{name}-agent-token", f"service/{name}", namespace=rel.watched, check=False
                ).returncode
                == 0
            )
            status = kubectl.json("get", "rljob", name, namespace=rel.watched).get("status", {})
            return (
                has and len(pods) == job["spec"]["replicas"] and bool(status.get("conditions"))
            )  # status written (Pending omits phase)

        wait_with_log(children, operator, kubectl, rel.watched, f"the operator created {name}'s children")
        kubectl("delete", "rljob", name, "--wait=false", namespace=rel.watched)

        def cleaned() -> bool:
            left = kubectl(
                "get",
                f"rljob/{name}",
                f"secret/{name}-agent-token",
                f"service/{name}",
                "--ignore-not-found",
                "-o",
                "name",
                namespace=rel.watched,
            ).stdout.strip()
            pods = kubectl.json("get", "pods", "-l", f"rljob.io/job={name}", namespace=rel.watched)["items"]
            return not left and not pods

        wait_with_log(cleaned, operator, kubectl, rel.watched, "the finalizer cleaned up")
        assert operator.alive, operator.log_tail()
    log = (tmp_path / "operator.log").read_text()
    forbidden = [
        line for line in log.splitlines() if "403" in line or "orbidden" in line or "permission" in line
    ]
    assert forbidden == [], "\n".join(forbidden)


def test_cluster_scope_install_and_uninstall(
    helm: Path, admin_kubeconfig: Path, kube_api: KubeApi, kubectl: Kubectl, namespace: str
) -> None:
    release = f"rljob-cluster-{uuid.uuid4().hex[:6]}"
    release_ns = f"{release}-system"
    install_chart(helm, admin_kubeconfig, release, release_ns, [])  # no namespaces: cluster scope
    try:
        roles = kubectl.json("get", "clusterrole", "-l", f"app.kubernetes.io/instance={release}")["items"]
        assert len(roles) == 1 and rules_of(roles[0]) == OPERATOR_RIGHTS | SCAN_CRDS
        binding = kubectl.json("get", "clusterrolebinding", roles[0]["metadata"]["name"])
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SA, "namespace": release_ns}]
        who = identity(release_ns)
        anywhere = can_i(kubectl, who, NEEDED + NOT_GRANTED, namespace)
        assert [c for c in NEEDED if not anywhere[c]] == []
        assert [c for c in NOT_GRANTED if anywhere[c]] == []
        cluster = can_i(
            kubectl,
            who,
            [("list", "pods", "--all-namespaces"), ("get", "nodes"), ("list", "namespaces")],
            None,
        )
        assert cluster == {
            ("list", "pods", "--all-namespaces"): True,
            ("get", "nodes"): False,
            ("list", "namespaces"): False,
        }
    finally:
        uninstall_chart(helm, admin_kubeconfig, release, release_ns)
        delete_namespace(kube_api, release_ns)
    assert (
        kubectl.json("get", "clusterrole,clusterrolebinding", "-l", f"app.kubernetes.io/instance={release}")[
            "items"
        ]
        == []
    )


def test_upgrade_then_uninstall_keeps_the_crd(
    helm: Path, admin_kubeconfig: Path, kube_api: KubeApi, kubectl: Kubectl, namespace: str
) -> None:
    """`helm upgrade` leaves the CRD alone; `helm uninstall` never deletes a crds/ CRD (that would delete
    every RLJob and, through ownerReferences, their GPU pods); everything else goes."""
    release, release_ns = f"rljob-un-{uuid.uuid4().hex[:6]}", f"{namespace}-op"
    install_chart(helm, admin_kubeconfig, release, release_ns, [namespace])
    try:
        selector = f"app.kubernetes.io/instance={release}"
        crd_version = kubectl.json("get", "crd", CRD)["metadata"]["resourceVersion"]
        out = install_chart(
            helm, admin_kubeconfig, release, release_ns, [namespace], {"networkPolicy": {"enabled": True}}
        )
        assert "REVISION: 2" in out
        assert kubectl.json("get", "crd", CRD)["metadata"]["resourceVersion"] == crd_version
        assert kubectl.json("get", "role,networkpolicy", "-l", selector, namespace=namespace)["items"]
        out = uninstall_chart(helm, admin_kubeconfig, release, release_ns)
        assert "uninstalled" in out
        assert (
            kubectl.json("get", "role,rolebinding,networkpolicy", "-l", selector, namespace=namespace)[
                "items"
            ]
            == []
        )
        assert kubectl.json("get", "clusterrole,clusterrolebinding", "-l", selector)["items"] == []
        assert (
            kubectl.json("get", "deployment,service,serviceaccount", "-l", selector, namespace=release_ns)[
                "items"
            ]
            == []
        )
        kubectl("get", "crd", CRD)  # still there
        listed = run_helm(
            helm, ["list", "--all", f"--namespace={release_ns}", "--output=json"], admin_kubeconfig
        )
        assert json.loads(listed.stdout) == []
    finally:
        delete_namespace(kube_api, release_ns)
