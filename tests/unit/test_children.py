"""The pods the operator generates: the user's template plus exactly our injections."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from rljob.api import parse_spec
from rljob.api.spec import DNS_1035_LABEL, DNS_LABEL, JOB_NAME_MAX_LENGTH, LABEL_VALUE, MAX_REPLICAS
from rljob.controller.children import (
    AGENT_CONTAINER,
    LABEL_GANG,
    LABEL_INDEX,
    LABEL_JOB,
    TOKEN_VOLUME,
    AgentOptions,
    Refusal,
    gang_pod,
    headless_service,
    refusal_spec_error,
    spec_field,
    token_secret,
)

ROOT = Path(__file__).resolve().parents[2]


def demo_spec():  # type: ignore[no-untyped-def]
    doc = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
    return parse_spec(doc["spec"])


def test_gang_pod_injects_agent_token_env_and_probe() -> None:
    spec = demo_spec()
    pod = gang_pod(
        "demo", "uid-1", spec, index=1, gang=2, options=AgentOptions(image="agent:1"), iterations=3
    )
    meta = pod["metadata"]
    assert meta["name"] == "demo-1"
    assert meta["labels"][LABEL_JOB] == "demo" and meta["labels"][LABEL_INDEX] == "1"
    assert meta["labels"][LABEL_GANG] == "2"
    assert meta["ownerReferences"][0]["uid"] == "uid-1" and meta["ownerReferences"][0]["controller"] is True
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert list(containers) == ["sglang", "trainer", AGENT_CONTAINER]
    agent = containers[AGENT_CONTAINER]
    assert agent["image"] == "agent:1"
    assert agent["securityContext"]["runAsNonRoot"] is True
    assert agent["securityContext"]["readOnlyRootFilesystem"] is True
    assert agent["securityContext"]["allowPrivilegeEscalation"] is False
    assert "--token-file" in agent["args"]
    assert "$(POD_IP):8471" in agent["args"]  # the operator-facing port binds the pod IP only
    assert "127.0.0.1:8472" in agent["args"]  # the trainer-facing port is loopback only
    engine = agent["args"].index("--engine-listen")  # the SGLang-compatible endpoint: loopback only
    assert agent["args"][engine + 1] == "127.0.0.1:8473"
    assert agent["args"][agent["args"].index("--refit-source") + 1] == "disk"
    assert agent["args"][agent["args"].index("--engine") + 1] == "sglang"  # spec.engine's default
    # SGLang liveness goes through the agent to /ping (never /health, which fails while paused).
    probe = containers["sglang"]["livenessProbe"]["httpGet"]
    assert probe == {"path": "/probe/engine", "port": 8471}
    trainer_env = {e["name"]: e.get("value") for e in containers["trainer"]["env"]}
    assert trainer_env["RLJOB_AGENT_URL"] == "http://127.0.0.1:8472"
    assert trainer_env["RLJOB_ENGINE_URL"] == "http://127.0.0.1:8473"
    assert trainer_env["RLJOB_REFIT_SOURCE"] == "disk"
    assert trainer_env["RLJOB_ENGINE"] == "sglang"
    assert trainer_env["RLJOB_WEIGHTS_DIR"] == "/weights"  # the user's own env is kept
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False  # the agent has no Kubernetes credentials
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["rljob-agent-token"]["secret"]["secretName"] == "demo-agent-token"
    assert "weights" in volumes


def test_a_vllm_pod_tells_the_agent_and_the_trainer_its_engine_and_where_it_listens() -> None:
    doc = yaml.safe_load((ROOT / "examples/rljob-vllm.yaml").read_text())
    pod = gang_pod("demo", "u", parse_spec(doc["spec"]), 0, 0, AgentOptions(), 3)
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    assert list(containers) == ["vllm", "trainer", AGENT_CONTAINER]
    args = containers[AGENT_CONTAINER]["args"]
    assert args[args.index("--engine") + 1] == "vllm"
    assert args[args.index("--engine-server-url") + 1] == "http://127.0.0.1:8000"  # vLLM's default port
    assert args[args.index("--refit-source") + 1] == "tensor"
    trainer_env = {e["name"]: e.get("value") for e in containers["trainer"]["env"]}
    assert trainer_env["RLJOB_ENGINE"] == "vllm"
    assert trainer_env["RLJOB_ENGINE_SERVER_URL"] == "http://127.0.0.1:8000"
    # Its liveness through the agent, whose engine asks vLLM's own liveness route.
    assert containers["vllm"]["livenessProbe"]["httpGet"] == {"path": "/probe/engine", "port": 8471}
    assert pod["spec"]["shareProcessNamespace"] is True  # CUDA IPC from the trainer into vLLM


def test_a_native_sidecar_agent_holds_back_the_pod_until_the_operator_watches_it() -> None:
    spec = demo_spec()
    options = AgentOptions(image="agent:1", native_sidecar=True)
    pod = gang_pod("demo", "uid-1", spec, index=0, gang=0, options=options, iterations=3)
    (agent,) = [c for c in pod["spec"]["initContainers"] if c["name"] == AGENT_CONTAINER]
    probe = agent["startupProbe"]
    assert probe["httpGet"] == {"path": "/probe/gang", "port": 8471}
    # It keeps failing for as long as the gang may wait to be placed: the operator restarts the gang then.
    waits = spec.phase_timeout_seconds.initializing
    assert probe["periodSeconds"] * probe["failureThreshold"] > waits
    plain = gang_pod("demo", "uid-1", spec, 0, 0, AgentOptions(image="agent:1"), 3)
    (agent,) = [c for c in plain["spec"]["containers"] if c["name"] == AGENT_CONTAINER]
    assert "startupProbe" not in agent  # a regular container's probe holds nothing back


def test_user_env_wins_over_injected_env() -> None:
    doc = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
    doc["spec"]["template"]["spec"]["containers"][1]["env"].append(
        {"name": "RLJOB_REFIT_SOURCE", "value": "x"}
    )
    pod = gang_pod("demo", "u", parse_spec(doc["spec"]), 0, 0, AgentOptions(), None)
    env = [e for e in pod["spec"]["containers"][1]["env"] if e["name"] == "RLJOB_REFIT_SOURCE"]
    assert [e["value"] for e in env] == ["x"]


def test_template_is_not_mutated() -> None:
    spec = demo_spec()
    before = spec.model_dump()
    gang_pod("demo", "u", spec, 0, 0, AgentOptions(), None)
    assert spec.model_dump() == before


def test_secret_and_service() -> None:
    secret = token_secret("demo", "u", "tok")
    assert secret["data"]["token"] == "dG9r"
    svc = headless_service("demo", "u", demo_spec())
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"] == {LABEL_JOB: "demo"}


def test_agent_shares_the_rollout_containers_gpu_claim() -> None:
    doc = next(
        d for d in yaml.safe_load_all((ROOT / "examples/rljob-gpu.yaml").read_text()) if d["kind"] == "RLJob"
    )
    pod = gang_pod("j", "u", parse_spec(doc["spec"]), 0, 0, AgentOptions(), None)
    agent = pod["spec"]["containers"][-1]
    assert agent["name"] == AGENT_CONTAINER
    assert agent["resources"]["claims"] == [{"name": "gpu"}]


def test_the_longest_job_name_gives_valid_children_at_the_largest_index() -> None:
    """JOB_NAME_MAX_LENGTH (api/spec.py) is what the children need: the Secret's job label, the Service
    name (DNS-1035), the pod's hostname (its name, a DNS-1123 label) at index MAX_REPLICAS - 1."""
    name = "a" * JOB_NAME_MAX_LENGTH
    label_value = re.compile(LABEL_VALUE)
    secret = token_secret(name, "u", "t")
    assert all(len(v) <= 63 and label_value.match(v) for v in secret["metadata"]["labels"].values())
    service = headless_service(name, "u", demo_spec())
    assert len(service["metadata"]["name"]) <= 63 and re.match(DNS_1035_LABEL, service["metadata"]["name"])
    largest = demo_spec().model_copy(update={"replicas": MAX_REPLICAS})
    pod = gang_pod(name, "u", largest, MAX_REPLICAS - 1, 0, AgentOptions(), None)
    hostname = pod["spec"]["hostname"]
    assert hostname == pod["metadata"]["name"] and len(hostname) == 63 and re.match(DNS_LABEL, hostname)
    assert all(len(v) <= 63 and label_value.match(v) for v in pod["metadata"]["labels"].values())


def test_the_injected_names_are_the_reserved_ones() -> None:
    pod = gang_pod("demo", "u", demo_spec(), 0, 0, AgentOptions(), None)
    assert pod["spec"]["containers"][-1]["name"] == AGENT_CONTAINER == "rljob-agent"
    assert pod["spec"]["volumes"][-1]["name"] == TOKEN_VOLUME == "rljob-agent-token"


# Status bodies as kube-apiserver v1.34 answers a refused create.
INVALID_LABEL = {
    "kind": "Status",
    "status": "Failure",
    "message": 'Pod "j-0" is invalid: metadata.labels: Invalid value: "not ok!": a valid label must be ...',
    "reason": "Invalid",
    "details": {
        "name": "j-0",
        "kind": "Pod",
        "causes": [
            {
                "reason": "FieldValueInvalid",
                "message": 'Invalid value: "not ok!": a valid label must be ...',
                "field": "metadata.labels",
            },
            {
                "reason": "FieldValueNotSupported",
                "message": 'Unsupported value: "Sometimes"',
                "field": "spec.containers[0].imagePullPolicy",
            },
        ],
    },
    "code": 422,
}
UNDECODABLE = {
    "kind": "Status",
    "status": "Failure",
    "message": 'Pod in version "v1" cannot be handled as a Pod: json: cannot unmarshal number into Go struct '
    "field ObjectMeta.metadata.annotations of type string",
    "reason": "BadRequest",
    "code": 400,
}


def test_a_refused_pod_names_the_template_field() -> None:
    error = refusal_spec_error(Refusal.from_status("Pod", "j-0", INVALID_LABEL))
    assert error.startswith(
        'spec.template.metadata.labels: Invalid value: "not ok!": a valid label must be ...; '
        'spec.template.spec.containers[0].imagePullPolicy: Unsupported value: "Sometimes"'
    )
    assert error.endswith("(the API server refused Pod j-0)")


def test_a_body_that_does_not_decode_names_the_field_from_the_message() -> None:
    error = refusal_spec_error(Refusal.from_status("Pod", "j-0", UNDECODABLE))
    assert error.startswith("spec.template.metadata.annotations: Pod in version")


def test_a_body_that_does_not_decode_names_the_list_element_from_what_was_sent() -> None:
    """encoding/json names `spec.containers.imagePullPolicy`; the pod sent says which container."""
    pod = gang_pod("j", "u", demo_spec(), 0, 0, AgentOptions(), None)
    pod["spec"]["containers"][1]["imagePullPolicy"] = 5
    message = (
        'Pod in version "v1" cannot be handled as a Pod: json: cannot unmarshal number into Go struct field '
        "Container.spec.containers.imagePullPolicy of type v1.PullPolicy"
    )
    status = {"kind": "Status", "message": message, "reason": "BadRequest", "code": 400}
    error = refusal_spec_error(Refusal.from_status("Pod", "j-0", status, pod))
    assert error.startswith("spec.template.spec.containers[1].imagePullPolicy: Pod in version"), error
    pod["spec"]["containers"][0]["imagePullPolicy"] = 6  # two candidates: the path as encoding/json gave it
    error = refusal_spec_error(Refusal.from_status("Pod", "j-0", status, pod))
    assert error.startswith("spec.template.spec.containers.imagePullPolicy: Pod in version"), error


@pytest.mark.parametrize(
    ("kind", "field", "expected"),
    [
        ("Pod", "metadata.name", "metadata.name"),
        ("Pod", "spec.volumes[1].name", "spec.template.spec.volumes[1].name"),
        ("Pod", "", "spec.template"),
        ("Secret", "metadata.labels", "metadata.name"),  # its only label value is the job's name
        ("Service", "metadata.name", "metadata.name"),
        ("Service", "spec.ports[0].port", "spec.agent.port"),
    ],
)
def test_child_fields_map_to_the_rljob_field_they_come_from(kind: str, field: str, expected: str) -> None:
    assert spec_field(kind, field) == expected


def test_quantities_reach_the_api_server_as_the_user_wrote_them() -> None:
    """No client library sits between the operator and the API server (kubeclient/apiserver.py): a number
    is a valid quantity there (`nvidia.com/gpu: 1`), and the pod carries it unchanged."""
    doc = yaml.safe_load((ROOT / "examples/rljob.yaml").read_text())
    sglang = doc["spec"]["template"]["spec"]["containers"][0]
    sglang["resources"] = {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}, "requests": {"cpu": 0.5}}
    pod = gang_pod("j", "u", parse_spec(doc["spec"]), 0, 0, AgentOptions(), None)
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources == {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}, "requests": {"cpu": 0.5}}
