"""The pods the operator generates: the user's template plus exactly our injections."""

from __future__ import annotations

from pathlib import Path

import yaml

from rljob.api import parse_spec
from rljob.controller.children import (
    AGENT_CONTAINER,
    LABEL_GANG,
    LABEL_INDEX,
    LABEL_JOB,
    AgentOptions,
    gang_pod,
    headless_service,
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
    # SGLang liveness goes through the agent to /ping (never /health, which fails while paused).
    probe = containers["sglang"]["livenessProbe"]["httpGet"]
    assert probe == {"path": "/probe/sglang", "port": 8471}
    trainer_env = {e["name"]: e.get("value") for e in containers["trainer"]["env"]}
    assert trainer_env["RLJOB_AGENT_URL"] == "http://127.0.0.1:8472"
    assert trainer_env["RLJOB_REFIT_SOURCE"] == "disk"
    assert trainer_env["RLJOB_WEIGHTS_DIR"] == "/weights"  # the user's own env is kept
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False  # the agent has no Kubernetes credentials
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["rljob-agent-token"]["secret"]["secretName"] == "demo-agent-token"
    assert "weights" in volumes


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
