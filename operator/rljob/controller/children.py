"""Child objects of an RLJob, as plain manifests: the agent token Secret, a headless Service, and the
gang's pods (the user's template plus our agent sidecar). Pure functions: no API calls here."""

from __future__ import annotations

import base64
import copy
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rljob.api.agent import CONTAINER_ENV, TRAINER_CONTAINER_ENV
from rljob.api.crd import GROUP, KIND, VERSION

# The names injected into every pod are reserved in the spec (api/spec.py refuses them in a template).
from rljob.api.spec import (
    AGENT_CONTAINER,
    AGENT_ENGINE_PORT,
    AGENT_TRAINER_PORT,
    TOKEN_VOLUME,
    RefitSource,
    RLJobSpec,
)
from rljob.controller.topology import Topology

LABEL_JOB = "rljob.io/job"
LABEL_INDEX = "rljob.io/index"
LABEL_GANG = "rljob.io/gang"
TOKEN_DIR = "/var/run/rljob/agent"
TOKEN_KEY = "token"
# The agent's record (agent/record.py): a memory-backed emptyDir, alive as long as the pod (as the engine's
# state is) and across the agent's restarts; its write before each non-idempotent engine call costs nothing.
STATE_VOLUME = "rljob-agent-state"
STATE_DIR = "/var/run/rljob/state"
TRAINER_PORT = AGENT_TRAINER_PORT


@dataclass(frozen=True)
class AgentOptions:
    """How the operator injects the agent (operator flags / chart values)."""

    image: str = "ghcr.io/rljob/rljob-agent:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    gpu_probe: str = "nvml"  # the agent's --gpu-probe: a plugin import path for simulated pods
    cpu_request: str = "50m"
    memory_request: str = "64Mi"
    memory_limit: str = "256Mi"
    # How the agent's NVML sees the pod's GPUs (agent/gpu_scope.py). "claim": it shares the rollout
    # container's DRA claim and sees exactly those; no NVIDIA_VISIBLE_DEVICES. "all":
    # NVIDIA_VISIBLE_DEVICES=all for nodes with the classic device plugin whose runtime accepts it
    # unprivileged (hardened ones refuse it); the agent then verifies only the GPUs a pod process names
    # (shareProcessNamespace).
    gpu_visibility: str = "claim"
    # A native sidecar (an init container with restartPolicy Always; GA in Kubernetes 1.33): the kubelet
    # restarts the agent without ending the pod, and the agent continues from its record. False: a regular
    # container, as on older servers; with the pod's restartPolicy Never its exit then ends the member
    # and the gang restarts. The operator picks it from the server's /version (controller/main.py).
    native_sidecar: bool = False


NATIVE_SIDECAR_SINCE = (1, 33)  # SidecarContainers GA (beta, on by default, from 1.29; alpha in 1.28)


def native_sidecars_supported(git_version: str) -> bool:
    """Does a server of this /version gitVersion (`v1.34.4`, `v1.33.1-eks-...`) run init containers with
    restartPolicy Always as sidecars? From 1.33 without question. 1.29-1.32 do by default, but there the
    SidecarContainers gate can be off, and then the API server drops the field and the agent becomes an
    init container that never exits, so the pod never starts: only GA counts."""
    m = re.match(r"^v?(\d+)\.(\d+)", git_version.strip())
    return m is not None and (int(m.group(1)), int(m.group(2))) >= NATIVE_SIDECAR_SINCE


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


NAMESPACE_ENV = "RLJOB_NAMESPACE"


def topology(job: str, spec: RLJobSpec) -> Topology:
    """The gang's layout. The stable names carry `$(RLJOB_NAMESPACE)`, which the kubelet expands from the
    variable injected before them (a dependent env var), so the pods need no namespace at build time."""
    return Topology(
        job,
        f"$({NAMESPACE_ENV})",
        spec.replicas,
        pods_per_instance=spec.rollout.pods_per_instance,
        trainer_processes_per_pod=spec.trainer.processes_per_pod,
        master_port=spec.trainer.master_port,
    )


def _env_list(values: Mapping[str, str]) -> list[dict[str, Any]]:
    return [_env(k, v) for k, v in values.items()]


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
            "--engine-listen",
            f"127.0.0.1:{AGENT_ENGINE_PORT}",
            "--engine",
            spec.engine.value,
            "--refit-source",
            spec.refit.source.value,
            "--engine-server-url",
            f"http://127.0.0.1:{spec.rollout.port}",
            "--token-file",
            f"{TOKEN_DIR}/{TOKEN_KEY}",
            "--gpu-probe",
            options.gpu_probe,
            "--state-dir",
            STATE_DIR,
        ],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            _env("NVIDIA_DRIVER_CAPABILITIES", "utility"),
            # Every GPU of the node, only where asked: the agent then picks the pod's (agent/gpu_scope.py).
            *([_env("NVIDIA_VISIBLE_DEVICES", "all")] if options.gpu_visibility == "all" else []),
        ],
        "ports": [{"name": "agent", "containerPort": port}],
        "volumeMounts": [
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": STATE_VOLUME, "mountPath": STATE_DIR},
        ],
        # Readiness only tells `kubectl get` the agent answers (the operator reaches it by pod IP); 5 s
        # timeout: every flip on a loaded node is a pod event that each watcher parses whole.
        "readinessProbe": {
            "httpGet": {"path": "/healthz", "port": port},
            "periodSeconds": 5,
            "timeoutSeconds": 5,
        },
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


GANG_PROBE_PERIOD = 2  # seconds


def gang_startup(spec: RLJobSpec) -> dict[str, Any]:
    """The agent's startupProbe as a native sidecar: it passes once the operator reached the agent, which
    it does only after the scheduler placed the whole gang, and until then the kubelet starts neither
    the engine nor the trainer (docs/control-plane.md, "Gangs that do not fit"). It keeps failing for as long
    as the gang may wait to be placed (phaseTimeoutSeconds.initializing; a day without one): after that the
    operator restarts the gang, and a kubelet that kills the agent first would only restart it."""
    waits = spec.phase_timeout_seconds.initializing or 86400
    return {
        "httpGet": {"path": "/probe/gang", "port": spec.agent.port},
        "periodSeconds": GANG_PROBE_PERIOD,
        "failureThreshold": -(-waits // GANG_PROBE_PERIOD) + 30,
    }


def engine_liveness(spec: RLJobSpec) -> dict[str, Any]:
    """The engine binds 127.0.0.1, which a kubelet probe can't reach, so the probe goes through the agent,
    which asks the engine's liveness route (one that answers while paused: Engine.liveness)."""
    return {
        "httpGet": {"path": "/probe/engine", "port": spec.agent.port},
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
    layout = topology(job, spec)
    common_env = [
        {"name": NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        _env("RLJOB_JOB_NAME", job),
        _env("RLJOB_POD_INDEX", str(index)),
        _env("RLJOB_REPLICAS", str(spec.replicas)),
        # Where the pod stands in its engine instance, for every container: one engine command line for
        # every pod, e.g. --nnodes $(RLJOB_NODES_PER_INSTANCE) --node-rank $(RLJOB_NODE_RANK)
        # --dist-init-addr $(RLJOB_INSTANCE_LEADER):5000. The agent takes its role from it.
        *_env_list(layout.instance_env(index)),
    ]
    for container in pod_spec["containers"]:
        own = [_env(CONTAINER_ENV, container["name"])]  # whose GPU process it is (docs/agent.md)
        if container["name"] == spec.trainer.container:
            _with_env(
                container,
                [
                    *common_env,
                    *own,
                    *_env_list(layout.trainer_env(index)),
                    _env("RLJOB_AGENT_URL", f"http://127.0.0.1:{TRAINER_PORT}"),
                    _env("RLJOB_ENGINE", spec.engine.value),  # whose payloads the trainer SDK packs
                    _env("RLJOB_ENGINE_URL", f"http://127.0.0.1:{AGENT_ENGINE_PORT}"),
                    _env("RLJOB_ENGINE_SERVER_URL", f"http://127.0.0.1:{spec.rollout.port}"),
                    _env("RLJOB_REFIT_SOURCE", spec.refit.source.value),
                    *([_env("RLJOB_ITERATIONS", str(iterations))] if iterations else []),
                ],
            )
        elif container["name"] == spec.rollout.container:
            _with_env(container, [*common_env, *own])
            container["livenessProbe"] = engine_liveness(spec)
        else:
            _with_env(container, [*common_env, *own])
    agent = agent_container(spec, options)
    _with_env(
        agent,
        [
            *common_env,
            _env(CONTAINER_ENV, AGENT_CONTAINER),
            _env(TRAINER_CONTAINER_ENV, spec.trainer.container),
        ],
    )
    rollout = next(c for c in pod_spec["containers"] if c["name"] == spec.rollout.container)
    claims = (rollout.get("resources") or {}).get("claims")
    if claims:
        # DRA: containers of a pod can share a ResourceClaim, so NVML in the agent sees the engine's GPUs.
        agent["resources"]["claims"] = copy.deepcopy(claims)
    if spec.refit.source == RefitSource.TENSOR:
        # CUDA IPC: the trainer opens handles into the engine's allocations, which needs one PID namespace
        # (legacy IPC handles cannot be opened from another, NVIDIA/nccl#360) and the same GPUs.
        pod_spec["shareProcessNamespace"] = True
        trainer = next(c for c in pod_spec["containers"] if c["name"] == spec.trainer.container)
        if claims and not (trainer.get("resources") or {}).get("claims"):
            trainer.setdefault("resources", {})["claims"] = copy.deepcopy(claims)
    if options.native_sidecar:
        # Started before the pod's containers (after the template's own init containers), restarted by the
        # kubelet whenever it exits, whatever the pod's restartPolicy; stopped after them.
        agent["restartPolicy"] = "Always"
        agent["startupProbe"] = gang_startup(spec)
        pod_spec.setdefault("initContainers", []).append(agent)
    else:
        pod_spec["containers"].append(agent)
    pod_spec.setdefault("volumes", []).extend(
        [
            {"name": STATE_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
            {"name": TOKEN_VOLUME, "secret": {"secretName": token_secret_name(job), "defaultMode": 0o444}},
        ]
    )
    # A lost member is handled by restarting the gang; a silently restarted engine or trainer would rejoin
    # a lock-step iteration with its memory state gone. Only the agent (a native sidecar) restarts: it
    # recovers its state from its record, or reports StateUnknown.
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


# --- children the API server refuses ------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A child the API server refused as invalid (HTTP 422, or 400 when the body did not decode): the
    job's spec or name can never produce it, so the job fails as InvalidSpec."""

    kind: str  # Pod | Secret | Service
    name: str
    message: str  # the Status's message
    causes: tuple[tuple[str, str], ...] = ()  # (field, message) from status.details.causes

    @classmethod
    def from_status(
        cls, kind: str, name: str, status: dict[str, Any], manifest: Mapping[str, Any] | None = None
    ) -> Refusal:
        """With `manifest` (what was sent), a body that did not decode names its field with the list
        index too (`located_field`)."""
        message = str(status.get("message") or "")
        causes = tuple(
            (str(c.get("field") or ""), str(c.get("message") or ""))
            for c in ((status.get("details") or {}).get("causes")) or []
        )
        found = _DECODE_ERROR.search(message)
        if not causes and found and manifest is not None:
            causes = ((located_field(manifest, found.group(2), found.group(1)), message),)
        return cls(kind, name, message, causes)


# A body that does not decode names the field only in its message (encoding/json's UnmarshalTypeError:
# "json: cannot unmarshal number into Go struct field Container.spec.containers.imagePullPolicy of type
# v1.PullPolicy", kube-apiserver v1.34.4), without list indices.
_DECODE_ERROR = re.compile(
    r"cannot unmarshal (\w+) into Go struct field [A-Za-z0-9_]+\.([A-Za-z0-9_.\[\]]+) of type"
)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "number": (int, float),
    "string": (str,),
    "bool": (bool,),
    "array": (list,),
    "object": (dict,),
}


def located_field(manifest: Mapping[str, Any], dotted: str, json_type: str) -> str:
    """`spec.containers.imagePullPolicy` as `spec.containers[1].imagePullPolicy`: the one place along the
    path whose value is of the JSON type that did not decode; the path as given where none or several is."""
    want = _JSON_TYPES.get(json_type)

    def matches(value: Any) -> bool:
        if want is None or (isinstance(value, bool) and bool not in want):
            return False
        return isinstance(value, want)

    def walk(node: Any, parts: list[str], at: str) -> list[str]:
        if isinstance(node, list) and not (not parts and json_type == "array"):
            return [p for i, item in enumerate(node) for p in walk(item, parts, f"{at}[{i}]")]
        if not parts:
            return [at] if matches(node) else []
        if isinstance(node, Mapping) and parts[0] in node:
            return walk(node[parts[0]], parts[1:], f"{at}.{parts[0]}" if at else parts[0])
        return []

    found = walk(manifest, dotted.split("."), "")
    return found[0] if len(found) == 1 else dotted


def spec_field(kind: str, child_field: str) -> str:
    """The RLJob field a child's field comes from: a pod's labels are the template's, its spec is the
    template's spec; the Secret and Service carry only what the job's name gives them."""
    if kind == "Pod":
        if child_field == "metadata.name":
            return "metadata.name"
        if child_field.startswith(("metadata.", "spec.")):
            return f"spec.template.{child_field}"
        return "spec.template"
    if kind == "Service" and child_field.startswith("spec.ports"):
        return "spec.agent.port"
    return "metadata.name"


def refusal_spec_error(refusal: Refusal) -> str:
    """`field.path: message` for Observation.spec_error, one entry per cause the API server named."""
    where = f"(the API server refused {refusal.kind} {refusal.name})"
    if refusal.causes:
        entries = [f"{spec_field(refusal.kind, f)}: {m}" for f, m in refusal.causes]
        return f"{'; '.join(entries)} {where}"
    found = _DECODE_ERROR.search(refusal.message)
    field = spec_field(refusal.kind, found.group(2) if found else "")
    return f"{field}: {refusal.message} {where}"
