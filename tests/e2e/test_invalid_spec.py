"""RLJobs that can never run, on a real kube-apiserver + etcd with the real operator: refused at admission
with the field named where the CRD can tell (CEL generated from operator/rljob/api), else Failed with
reason InvalidSpec naming the field, within one reconcile and without a traceback or a daemon retry in
the operator's log. Also the job-level outcomes of the spec: a release that can never meet `verify`
fails permanently (no gang restart), and raising `iterations` after Succeeded continues the job."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_operator
import yaml
from test_operator import RL, job, versions

from rljob.api.crd import CRD_NAME, build_crd
from rljob.testing.harness import ROOT, rljob_path, wait_rljob
from rljob.testing.kubeaccess import KubeApi, Kubectl

pytestmark = pytest.mark.e2e
rl = test_operator.rl  # the operator tier's fixture (operator, kubelet, namespace), under its name

Edit = Callable[[dict[str, Any]], None]


def named(name: str, edit: Edit | None = None) -> dict[str, Any]:
    manifest = job(name, iterations=1)
    if edit is not None:
        edit(manifest["spec"])
    return manifest


def containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return list(spec["template"]["spec"]["containers"])


def add_container(name: str) -> Edit:
    return lambda spec: spec["template"]["spec"]["containers"].append({"name": name, "image": "busybox"})


def add_volume(name: str) -> Edit:
    return lambda spec: spec["template"]["spec"]["volumes"].append({"name": name, "emptyDir": {}})


def template_metadata(**meta: Any) -> Edit:
    return lambda spec: spec["template"].update(metadata=meta)


def pull_policy(policy: str | int) -> Edit:
    return lambda spec: containers(spec)[0].update(imagePullPolicy=policy)


def refused(kubectl: Kubectl, api: KubeApi, namespace: str, manifest: dict[str, Any]) -> str:
    result = kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest), namespace=namespace, check=False)
    assert result.returncode != 0, result.stdout
    assert api.get(rljob_path(namespace))["items"] == []  # nothing was stored
    return result.stderr


@pytest.mark.parametrize(
    ("manifest", "field", "why"),
    [
        (named("a" * 64), "metadata.name", "must be at most 58 characters"),
        (named("rl.job"), "metadata.name", "must be a DNS-1035 label"),
        (named("1job"), "metadata.name", "must be a DNS-1035 label"),
        (named("agent", add_container("rljob-agent")), "spec.template.spec.containers", "is reserved"),
        (named("token", add_volume("rljob-agent-token")), "spec.template.spec.volumes", "is reserved"),
        (named("twice", add_container("sglang")), "spec.template.spec.containers[2]", "Duplicate value"),
        (
            named("port", lambda spec: spec.setdefault("rollout", {}).update(port=8472)),
            "spec.rollout.port",
            "the agent's trainer port",
        ),
        (
            named("label", template_metadata(labels={"app": "not ok!"})),
            "spec.template.metadata.labels.app",
            "should match",
        ),
        (
            named("note", template_metadata(annotations={"note": 1})),
            "spec.template.metadata.annotations.note",
            "must be of type string",
        ),
    ],
    ids=[
        "64-characters",
        "dot",
        "leading-digit",
        "agent-container",
        "token-volume",
        "duplicate",
        "port",
        "label-value",
        "annotation-not-a-string",
    ],
)
def test_admission_refuses_what_the_children_cannot_carry(
    kubectl: Kubectl,
    kube_api: KubeApi,
    namespace: str,
    crd: None,
    manifest: dict[str, Any],
    field: str,
    why: str,
) -> None:
    stderr = refused(kubectl, kube_api, namespace, manifest)
    assert f"{field}: " in stderr and why in stderr, stderr


VLLM_EXAMPLE = yaml.safe_load((ROOT / "examples/rljob-vllm.yaml").read_text())


def on_vllm(name: str, edit: Edit | None = None) -> dict[str, Any]:
    """examples/rljob-vllm.yaml renamed (engine: vllm), edited."""
    manifest = copy.deepcopy(VLLM_EXAMPLE)
    manifest["metadata"] = {"name": name}
    if edit is not None:
        edit(manifest["spec"])
    return manifest


def tags(*names: str) -> Edit:
    return lambda spec: spec["release"].update(tags=list(names))


def engine(name: str) -> Edit:
    return lambda spec: spec.update(engine=name)


@pytest.mark.parametrize(
    ("manifest", "field", "why"),
    [
        (
            on_vllm("graphs", tags("kv_cache", "weights", "cuda_graph")),
            "spec.release.tags",
            "engine vllm cannot release cuda_graph: its CUDA graphs stay on the GPU through a sleep",
        ),
        (
            on_vllm("weights", tags("weights")),
            "spec.release.tags",
            "engine vllm releases its weights only together with its KV cache",
        ),
        (
            on_vllm("nodes", lambda spec: spec.update(rollout={"podsPerInstance": 2})),
            "spec.rollout.podsPerInstance",
            "engine vllm cannot span an instance over several pods",
        ),
        (
            # The SGLang example on vLLM: the rollout container is vLLM's by default, and there is none.
            named("sglang-on-vllm", engine("vllm")),
            "spec.rollout.container",
            "rollout.container must name a container of template.spec.containers",
        ),
        (
            # vLLM's default port, 8000, is the engine's: the trainer's rendezvous cannot take it.
            on_vllm("master", lambda spec: spec.update(trainer={"masterPort": 8000})),
            "spec.trainer.masterPort",
            "trainer.masterPort must differ from agent.port, rollout.port",
        ),
        (named("tgi", engine("tgi")), "spec.engine", 'supported values: "sglang", "vllm"'),
        (
            named("wait", lambda spec: spec.update(rollout={"drain": {"mode": "wait"}})),
            "spec.rollout.drain.mode",
            "engine sglang has no drain that lets running requests finish",
        ),
    ],
    ids=[
        "cuda-graph",
        "weights-alone",
        "pods-per-instance",
        "container",
        "master-port",
        "unknown-engine",
        "wait-on-sglang",
    ],
)
def test_admission_refuses_what_the_engine_cannot_do(
    kubectl: Kubectl,
    kube_api: KubeApi,
    namespace: str,
    crd: None,
    manifest: dict[str, Any],
    field: str,
    why: str,
) -> None:
    stderr = refused(kubectl, kube_api, namespace, manifest)
    assert f"{field}: " in stderr and why in stderr, stderr


def test_what_a_job_leaves_to_its_engine_is_admitted_and_the_engine_is_immutable(
    kubectl: Kubectl, kube_api: KubeApi, namespace: str, crd: None
) -> None:
    """The same masterPort and tags pass where the job's engine allows them; the engine never changes."""
    vllm = on_vllm("vllm", tags("kv_cache"))  # KV alone: the version decides
    vllm["spec"]["rollout"] = {"drain": {"mode": "wait"}}  # vLLM's wait pause lets running requests finish
    kubectl.apply(vllm, namespace=namespace)
    master_port_8000 = named("sglang", lambda spec: spec.update(trainer={"masterPort": 8000}))
    kubectl.apply(master_port_8000, namespace=namespace)
    stored = kube_api.get(rljob_path(namespace, "vllm"))["spec"]
    assert stored["engine"] == "vllm" and stored["release"]["tags"] == ["kv_cache"]
    assert "container" not in stored["rollout"] and "port" not in stored["rollout"]  # the engine's
    assert kube_api.get(rljob_path(namespace, "sglang"))["spec"]["engine"] == "sglang"  # the default
    for name, other in (("vllm", "sglang"), ("sglang", "vllm")):
        patch = ["patch", "rljob", name, "--type=merge", "-p", f'{{"spec":{{"engine":"{other}"}}}}']
        result = kubectl(*patch, namespace=namespace, check=False)
        assert result.returncode != 0 and "spec.engine: " in result.stderr, result.stderr
        assert "engine is immutable" in result.stderr, result.stderr
    table = kubectl("get", "rljob", namespace=namespace).stdout
    assert table.split()[:7] == ["NAME", "PHASE", "ITERATION", "WEIGHTS", "READY", "ENGINE", "AGE"], table
    engines = {line.split()[0]: line.split()[-2] for line in table.splitlines()[1:]}
    assert engines == {"sglang": "sglang", "vllm": "vllm"}, table


def test_the_longest_allowed_name_runs(rl: RL) -> None:
    """58 characters: the last pod's name (NAME-1) and hostname, the Service and the Secret all fit."""
    name = "a" * 58
    rl.apply(job(name, iterations=1))
    obj = rl.wait(name, "Succeeded", timeout=120)
    assert obj["status"]["weightVersion"] == "1"


def assert_failed_as_invalid_spec(rl: RL, name: str, field: str) -> dict[str, Any]:
    """Failed/InvalidSpec naming `field`; no pod ever existed; one Warning event; no retry loop."""
    obj = rl.wait(name, "Failed", timeout=30)
    status = obj["status"]
    assert status["reason"] == "InvalidSpec", status
    assert f"{field}: " in status["message"], status["message"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Failed"] == "True" and conditions["Ready"] == "False", conditions
    assert status.get("restarts", 0) == 0
    deadline = time.monotonic() + 10
    while not [e for e in rl.events(name) if e["reason"] == "InvalidSpec"] and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # several operator rounds (tick 1 s): nothing more happens
    events = rl.events(name)
    invalid = [e for e in events if e["reason"] == "InvalidSpec"]
    assert len(invalid) == 1 and invalid[0]["type"] == "Warning", events
    assert field in invalid[0]["message"]
    assert "PodsCreated" not in {e["reason"] for e in events}
    assert rl.pods(name) == []
    assert rl.get(name)["status"]["phase"] == "Failed"
    log = rl.operator.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
    assert "failed with an exception" not in log, log[-4000:]  # kopf retrying the daemon
    assert rl.operator.alive
    return obj


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        # The CRD checks label and annotation values, not keys: the operator's models refuse a bad key.
        (template_metadata(labels={"bad key!": "x"}), "spec.template.metadata.labels.bad key!.[key]"),
        # Nobody but the API server knows the pod's own rules: the dry run of a pod is refused.
        (pull_policy("Sometimes"), "spec.template.spec.containers[0].imagePullPolicy"),
        # A number where a string belongs: the API server cannot decode the body (400), naming the field
        # without its index; the operator finds the container in what it sent (children.located_field).
        (pull_policy(5), "spec.template.spec.containers[0].imagePullPolicy"),
    ],
    ids=[
        "label-key",
        "pod-refused-by-the-api-server",
        "pod-body-that-does-not-decode",
    ],
)
def test_specs_admission_accepts_but_no_pod_can_come_from_fail_as_invalid_spec(
    rl: RL, edit: Edit, field: str
) -> None:
    rl.apply(named("bad", edit))
    assert_failed_as_invalid_spec(rl, "bad", field)


def without_admission_rules(crd_manifest: dict[str, Any]) -> dict[str, Any]:
    """The CRD with the job-name and reserved-name CEL removed: what an older CRD left installed (or a
    hand-edited one) lets through."""
    variant = copy.deepcopy(crd_manifest)
    schema = variant["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    schema.pop("x-kubernetes-validations")
    pod = schema["properties"]["spec"]["properties"]["template"]["properties"]["spec"]["properties"]
    for field in ("containers", "volumes"):
        pod[field].pop("x-kubernetes-validations")
    return variant


def install_crd(kubectl: Kubectl, manifest: dict[str, Any] | None = None) -> None:
    """Apply the CRD (crds/ when None) and wait until it serves. Polled: `kubectl wait` fails outright
    on a CRD whose status has no conditions yet."""
    if manifest is None:
        kubectl("apply", "-f", str(ROOT / "crds"))
    else:
        kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))
    deadline = time.monotonic() + 30
    while True:
        conditions = kubectl.json("get", "crd", CRD_NAME).get("status", {}).get("conditions") or []
        if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
            return
        assert time.monotonic() < deadline, conditions
        time.sleep(0.2)


@pytest.fixture(scope="session")
def crd(kubectl: Kubectl) -> None:
    install_crd(kubectl)


@pytest.fixture
def crd_without_admission_rules(kubectl: Kubectl, crd: None) -> Iterator[None]:
    install_crd(kubectl, without_admission_rules(build_crd()))
    try:
        yield
    finally:
        install_crd(kubectl)  # the real CRD for every later test


def test_a_spec_forced_past_admission_fails_as_invalid_spec(
    rl: RL, crd_without_admission_rules: None
) -> None:
    rl.apply(named("forced", add_container("rljob-agent")))  # the API server stores it now
    assert_failed_as_invalid_spec(rl, "forced", "spec.template.spec.containers")
    rl.apply(job("forced.dotted", iterations=1))
    obj = assert_failed_as_invalid_spec(rl, "forced.dotted", "metadata.name")
    assert "DNS-1035" in obj["status"]["message"]


def test_release_that_can_never_meet_verify_fails_without_spending_the_backoff_limit(rl: RL) -> None:
    """Only cuda_graph (2 GiB of the emulator's 60 GiB per GPU) can never free half the memory."""
    manifest = job("shortfall", iterations=2, backoff=3)
    manifest["spec"]["release"] = {
        "tags": ["cuda_graph"],
        "verify": {"minFreedFraction": 0.5, "timeoutSeconds": 2},
    }
    rl.apply(manifest)
    obj = rl.wait("shortfall", "Failed", timeout=90)
    status = obj["status"]
    assert status["reason"] == "ReleaseShortfall", status
    assert status["restarts"] == 0, status
    assert "GPU 0 freed" in status["message"] and "bytes" in status["message"], status["message"]
    assert "GangMemberLost" not in {e["reason"] for e in rl.events("shortfall")}
    assert "Traceback" not in rl.operator.log_path.read_text(errors="replace")


@pytest.mark.parametrize("keep", [True, False], ids=["pods-kept", "pods-deleted"])
def test_raising_iterations_after_succeeded_continues_to_the_new_count(rl: RL, keep: bool) -> None:
    name = f"more-{'keep' if keep else 'delete'}"
    rl.apply(job(name, iterations=3, keep=keep))
    obj = rl.wait(name, "Succeeded", timeout=150)
    assert versions(obj) == ["0", "1", "2", "3"]
    rl.kubectl(
        "patch", "rljob", name, "--type=merge", "-p", '{"spec":{"iterations":4}}', namespace=rl.namespace
    )
    obj = wait_rljob(
        rl.api,
        rl.namespace,
        name,
        lambda o: o.get("status", {}).get("phase") == "Succeeded" and o["status"].get("iteration") == 4,
        150,
        "Succeeded at iteration 4",
        on_timeout=rl.operator.log_tail,
    )
    status = obj["status"]
    assert status["weightVersion"] == "4"
    assert versions(obj) == ["0", "1", "2", "3", "4"]
    assert "Traceback" not in rl.operator.log_path.read_text(errors="replace")
