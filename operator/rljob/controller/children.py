"""Child objects of an RLJob, as plain manifests: the agent token Secret, a headless Service, and the
gang's pods (the user's template plus our agent sidecar). Pure functions: no API calls here."""

from __future__ import annotations

import base64
import copy
import secrets
from dataclasses import dataclass
from typing import Any

from rljob.api.crd import GROUP, KIND, VERSION
from rljob.api.spec import RLJobSpec

LABEL_JOB = "rljob.io/job"
LABEL_INDEX = "rljob.io/index"
LABEL_GANG = "rljob.io/gang"
LABEL_ROLE = "rljob.io/role"
AGENT_CONTAINER = "rljob-agent"
TOKEN_VOLUME = "rljob-agent-token"
TOKEN_DIR = "/var/run/rljob/agent"
TOKEN_KEY = "token"
TRAINER_PORT = 8472


@dataclass(frozen=True)
class AgentOptions:
    """How the operator injects the agent (operator flags / chart values)."""

    image: str = "ghcr.io/rljob/rljob-agent:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    gpu_probe: str = "nvml"  # the agent's --gpu-probe: a plugin import path for simulated pods
    cpu_request: str = "50m"
    memory_request: str = "64Mi"
    memory_limit: str = "256Mi"


def token_secret_name(job: str) -> str:
    return f"{job}-agent-token"


def pod_name(job: str, index: int) -> str:
    return f"{job}-{index}"


def owner_reference(job: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": job,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def job_labels(job: str) -> dict[str, str]:
    return {LABEL_JOB: job, "app.kubernetes.io/managed-by": "rljob-operator"}


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_secret(job: str, uid: str, token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": token_secret_name(job),
            "labels": job_labels(job),
            "ownerReferences": [owner_reference(job, uid)],
        },
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def headless_service(job: str, uid: str, spec: RLJobSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": job, "labels": job_labels(job), "ownerReferences": [owner_reference(job, uid)]},
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_JOB: job},
            "publishNotReadyAddresses": True,
            "ports": [{"name": "agent", "port": spec.agent.port, "targetPort": spec.agent.port}],
        },
    }


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _with_env(container: dict[str, Any], env: list[dict[str, Any]]) -> None:
    """Our variables go first; a user's variable of the same name wins (it comes later)."""
    names = {e["name"] for e in container.get("env", [])}
    container["env"] = [e for e in env if e["name"] not in names] + list(container.get("env", []))


def agent_container(spec: RLJobSpec, options: AgentOptions) -> dict[str, Any]:
    port = spec.agent.port
    return {
        "name": AGENT_CONTAINER,
        "image": options.image,
        "imagePullPolicy": options.image_pull_policy,
        "command": ["rljob-agent"],
        "args": [
            "--listen",
            f"$(POD_IP):{port}",
            "--trainer-listen",
            f"127.0.0.1:{TRAINER_PORT}",
            "--sglang-url",
            f"http://127.0.0.1:{spec.rollout.port}",
            "--token-file",
            f"{TOKEN_DIR}/{TOKEN_KEY}",
            "--gpu-probe",
            options.gpu_probe,
        ],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            # NVML must see the pod's GPUs; with the NVIDIA runtime a sidecar needs this to read memory.
            _env("NVIDIA_VISIBLE_DEVICES", "all"),
            _env("NVIDIA_DRIVER_CAPABILITIES", "utility"),
        ],
        "ports": [{"name": "agent", "containerPort": port}],
        "volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": port}, "periodSeconds": 2},
        "resources": {
            "requests": {"cpu": options.cpu_request, "memory": options.memory_request},
            "limits": {"memory": options.memory_limit},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def sglang_liveness(spec: RLJobSpec) -> dict[str, Any]:
    """SGLang binds 127.0.0.1, which a kubelet probe can't reach, so the probe goes through the agent,
    which asks SGLang's `/ping`. Never `/health`: it blocks while paused, then fails."""
    return {
        "httpGet": {"path": "/probe/sglang", "port": spec.agent.port},
        "initialDelaySeconds": 30,
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 6,
    }


def gang_pod(
    job: str, uid: str, spec: RLJobSpec, index: int, gang: int, options: AgentOptions, iterations: int | None
) -> dict[str, Any]:
    template = spec.template.model_dump(mode="json", by_alias=True, exclude_none=True)
    meta = copy.deepcopy(template.get("metadata") or {})
    pod_spec: dict[str, Any] = copy.deepcopy(template["spec"])
    labels = {**meta.get("labels", {}), **job_labels(job), LABEL_INDEX: str(index), LABEL_GANG: str(gang)}
    common_env = [
        _env("RLJOB_JOB_NAME", job),
        _env("RLJOB_POD_INDEX", str(index)),
        _env("RLJOB_REPLICAS", str(spec.replicas)),
    ]
    for container in pod_spec["containers"]:
        if container["name"] == spec.trainer.container:
            _with_env(
                container,
                [
                    *common_env,
                    _env("RLJOB_AGENT_URL", f"http://127.0.0.1:{TRAINER_PORT}"),
                    _env("RLJOB_SGLANG_URL", f"http://127.0.0.1:{spec.rollout.port}"),
                    _env("RLJOB_REFIT_SOURCE", spec.refit.source.value),
                    *([_env("RLJOB_ITERATIONS", str(iterations))] if iterations else []),
                ],
            )
        elif container["name"] == spec.rollout.container:
            _with_env(container, common_env)
            container["livenessProbe"] = sglang_liveness(spec)
    agent = agent_container(spec, options)
    rollout = next(c for c in pod_spec["containers"] if c["name"] == spec.rollout.container)
    claims = (rollout.get("resources") or {}).get("claims")
    if claims:
        # DRA: containers of a pod can share a ResourceClaim, so NVML in the agent sees SGLang's GPUs.
        agent["resources"]["claims"] = copy.deepcopy(claims)
    pod_spec["containers"].append(agent)
    pod_spec.setdefault("volumes", []).append(
        {"name": TOKEN_VOLUME, "secret": {"secretName": token_secret_name(job), "defaultMode": 0o444}}
    )
    # A lost member is handled by restarting the gang; a silently restarted container would rejoin a
    # lock-step iteration with its memory state gone.
    pod_spec["restartPolicy"] = "Never"
    pod_spec.setdefault("automountServiceAccountToken", False)
    pod_spec.setdefault("subdomain", job)
    pod_spec.setdefault("hostname", pod_name(job, index))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(job, index),
            "labels": labels,
            "annotations": meta.get("annotations", {}),
            "ownerReferences": [owner_reference(job, uid)],
        },
        "spec": pod_spec,
    }
