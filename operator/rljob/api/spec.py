"""RLJob spec: what the user asks for. Defaults live here, and the CRD is generated from these models."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, cast

from pydantic import ConfigDict, Field, JsonValue, field_validator, model_validator
from pydantic.alias_generators import to_snake

from rljob.api.base import WireModel


def immutable(what: str) -> dict[str, Any]:
    """CEL transition rule for the CRD: changing this mid-run would break the gang's lock-step."""
    return {"x-kubernetes-validations": [{"rule": "self == oldSelf", "message": f"{what} is immutable"}]}


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, Any]:
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


# Kubernetes DNS-1123 label (container names, pod-name suffixes).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# DNS-1035 label: a Service name (k8s.io/apimachinery/pkg/util/validation/validation.go@v0.34.4).
DNS_1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# A label value (same file): at most 63 characters, alphanumeric at both ends.
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# A label or annotation key: an optional DNS-1123 subdomain prefix and "/", then a name.
QUALIFIED_NAME = (
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"
)

MAX_REPLICAS = 1024
# What the operator injects into every pod (controller/children.py): a template may not use these names.
AGENT_CONTAINER = "rljob-agent"
TOKEN_VOLUME = "rljob-agent-token"
AGENT_TRAINER_PORT = 8472  # the agent's trainer-facing port on 127.0.0.1, beside the engine's
AGENT_ENGINE_PORT = 8473  # the agent's engine-compatible endpoint on 127.0.0.1, for a framework
# Every child is named after the job (controller/children.py): the Service NAME (a DNS-1035 label), the
# Secret NAME-agent-token labelled rljob.io/job=NAME (a label value, at most 63), and the pods
# NAME-<index>, whose hostname is the pod name (a DNS-1123 label, at most 63). The longest pod name is
# NAME-1023, so NAME has 63 - 5 characters.
JOB_NAME_MAX_LENGTH = 63 - len(f"-{MAX_REPLICAS - 1}")
JOB_NAME_LENGTH_MESSAGE = (
    f"must be at most {JOB_NAME_MAX_LENGTH} characters: pods are named NAME-<index> and a pod's hostname "
    f"(its name) is a DNS label of at most 63 characters, for up to {MAX_REPLICAS} replicas"
)
JOB_NAME_FORMAT_MESSAGE = (
    "must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter and ending "
    "with a letter or digit): the job's headless Service is named after it"
)

WeightVersion = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
"""A weight version as the engine serves it (its label of the weights it holds)."""


class EngineKind(StrEnum):
    """The inference engine a job's rollout runs; the agent drives it through its folder of agent/engines/."""

    SGLANG = "sglang"
    VLLM = "vllm"

    @property
    def label(self) -> str:
        """How messages name the engine."""
        return ENGINE_LABELS[self]


ENGINE_LABELS = {EngineKind.SGLANG: "SGLang", EngineKind.VLLM: "vLLM"}
DEFAULT_ENGINE = EngineKind.SGLANG


class ReleaseTag(StrEnum):
    """The engine's memory parts, each released and resumed on its own."""

    KV_CACHE = "kv_cache"
    WEIGHTS = "weights"
    CUDA_GRAPH = "cuda_graph"


class DrainMode(StrEnum):
    """How a drain stops the engine's requests in flight: abort ends them, retract returns them to the
    engine's queue, wait lets the running ones finish (the waiting ones stay queued). A pause that keeps
    requests holding KV is deliberately absent: a release after it kills the engine. An engine that cannot
    drain in a mode refuses it (its guards)."""

    ABORT = "abort"
    RETRACT = "retract"
    WAIT = "wait"


class RefitSource(StrEnum):
    DISK = "disk"  # agent calls update_weights_from_disk with the path the trainer published
    TENSOR = "tensor"  # trainer pushes CUDA-IPC tensors inside a refit window opened by the agent
    DISTRIBUTED = "distributed"  # trainer broadcasts over NCCL inside a refit window


class PodsAfterFinished(StrEnum):
    DELETE = "Delete"  # give the GPUs back as soon as the job ends
    KEEP = "Keep"  # leave the gang serving the final weights (evaluation, debugging)


ALL_TAGS = [ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS, ReleaseTag.CUDA_GRAPH]


@dataclass(frozen=True)
class EngineRule:
    """What a job may not ask of an engine, whatever its version: refused at admission. `cel` (for the API
    server) and `holds` (for the models) state the same rule; both hold where the field is left to the
    engine's default. What only some versions refuse is not known before the engine runs: its agent refuses
    that when it starts, and the job fails at once with what to change."""

    field: str  # the spec field the refusal names, as a CEL fieldPath (".release.tags")
    cel: str
    holds: Callable[[RLJobSpec], bool]
    why: str  # completes "engine <name> ..."


@dataclass(frozen=True)
class EngineTraits:
    """What depends on the engine a job runs: the defaults of the fields that name it, and its rules."""

    port: int  # rollout.port's default: where the engine's HTTP server listens
    release_tags: tuple[ReleaseTag, ...]  # release.tags' default: every part the engine can release
    initial_version: str  # weights.initialVersion's default: the label the engine's launch weights carry
    drain_modes: frozenset[DrainMode] = frozenset(DrainMode)  # the drains it has
    no_drain: str = ""  # why it has no other
    rules: tuple[EngineRule, ...] = ()

    def all_rules(self, kind: EngineKind) -> list[tuple[str, str, str, Callable[[RLJobSpec], bool]]]:
        """(fieldPath, CEL, message, holds) of every rule, the drain's included."""
        rules = list(self.rules)
        if self.drain_modes != frozenset(DrainMode):
            modes = sorted(m.value for m in self.drain_modes)
            rules.append(
                EngineRule(
                    ".rollout.drain.mode",
                    f"self.rollout.drain.mode in {modes}",
                    lambda spec: spec.rollout.drain.mode in self.drain_modes,
                    f"{self.no_drain}: set rollout.drain.mode to {' or '.join(modes)}",
                )
            )
        return [(r.field, r.cel, f"engine {kind.value} {r.why}", r.holds) for r in rules]


RELEASE_NO_CUDA_GRAPH = EngineRule(
    ".release.tags",
    "!has(self.release.tags) || !('cuda_graph' in self.release.tags)",
    lambda spec: ReleaseTag.CUDA_GRAPH not in spec.release.tags,
    "cannot release cuda_graph: its CUDA graphs stay on the GPU through a sleep (or, where the launch "
    "offloads them, go with every sleep); release [kv_cache, weights] (the default) or [kv_cache]",
)
RELEASE_WEIGHTS_WITH_KV = EngineRule(
    ".release.tags",
    "!has(self.release.tags) || !('weights' in self.release.tags) || 'kv_cache' in self.release.tags",
    lambda spec: ReleaseTag.WEIGHTS not in spec.release.tags or ReleaseTag.KV_CACHE in spec.release.tags,
    "releases its weights only together with its KV cache (a sleep frees both; no call frees the weights "
    "alone): add kv_cache to release.tags",
)
ONE_POD_PER_INSTANCE = EngineRule(
    ".rollout.podsPerInstance",
    "self.rollout.podsPerInstance == 1",
    lambda spec: spec.rollout.pods_per_instance == 1,
    "cannot span an instance over several pods: the agent drives one-pod instances of it only (its "
    "multi-node launches, through Ray or headless nodes, are not supported); set rollout.podsPerInstance "
    "to 1",
)

ENGINE_TRAITS: Mapping[EngineKind, EngineTraits] = {
    EngineKind.SGLANG: EngineTraits(
        port=30000,
        release_tags=tuple(ALL_TAGS),
        initial_version="0",  # the examples launch it with --weight-version 0
        drain_modes=frozenset({DrainMode.ABORT, DrainMode.RETRACT}),
        no_drain="has no drain that lets running requests finish (its pause keeps them in place, holding "
        "KV cache a release would then free under them)",
    ),
    EngineKind.VLLM: EngineTraits(
        port=8000,
        release_tags=(ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS),
        initial_version="default",  # no launch flag sets it: what it (or its agent, before 0.27) labels
        rules=(RELEASE_NO_CUDA_GRAPH, RELEASE_WEIGHTS_WITH_KV, ONE_POD_PER_INSTANCE),
    ),
}
# Spec fields whose default is the engine's (ENGINE_TRAITS): the models fill them in, the CRD has no static
# default for them, and CEL reads them through engine_default().
ENGINE_DEFAULTED = (
    ("rollout", "container"),
    ("rollout", "port"),
    ("release", "tags"),
    ("weights", "initialVersion"),
)


def engine_defaults(kind: EngineKind) -> dict[tuple[str, str], Any]:
    """The value of each ENGINE_DEFAULTED field for a job that leaves it to the engine `kind`."""
    traits = ENGINE_TRAITS[kind]
    return {
        ("rollout", "container"): kind.value,  # the container's name: the engine's
        ("rollout", "port"): traits.port,
        ("release", "tags"): [t.value for t in traits.release_tags],
        ("weights", "initialVersion"): traits.initial_version,
    }


def by_engine(path: tuple[str, str]) -> str:
    """An ENGINE_DEFAULTED field's default per engine, for its description."""

    def text(value: Any) -> str:
        return ", ".join(value) if isinstance(value, list) else str(value)

    return "; ".join(f"{k.value}: {text(engine_defaults(k)[path])}" for k in EngineKind)


def _cel_literal(value: Any) -> str:
    if isinstance(value, str):
        return f"'{value}'"
    if isinstance(value, list):
        return "[" + ", ".join(_cel_literal(v) for v in value) + "]"
    return str(value)


def engine_default(path: tuple[str, str]) -> str:
    """CEL for an ENGINE_DEFAULTED field: its value where set, else the job's engine's default."""
    expr = _cel_literal(engine_defaults(DEFAULT_ENGINE)[path])
    for kind in EngineKind:
        if kind != DEFAULT_ENGINE:
            expr = f"(self.engine == '{kind.value}' ? {_cel_literal(engine_defaults(kind)[path])} : {expr})"
    dotted = "self." + ".".join(path)
    return f"(has({dotted}) ? {dotted} : {expr})"


def _names_rule(what: str, reserved: str) -> dict[str, Any]:
    return {
        "x-kubernetes-validations": [
            cel(
                f"self.all(x, x.name != '{reserved}')",
                f"{what} name {reserved} is reserved: the operator injects it into every pod",
            )
        ],
        # Names are unique within a pod; the API server refuses duplicates at admission.
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
    }


def _check_names(reserved: str, what: str, names: list[str]) -> None:
    if reserved in names:
        raise ValueError(f"{what} name {reserved} is reserved: the operator injects it into every pod")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{what} names must be unique: {', '.join(duplicates)}")


class Container(WireModel):
    """Only the name is modelled; every other container field is passed through untouched."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=DNS_LABEL, max_length=63)


class Volume(WireModel):
    """Only the name is modelled (it must not collide with the agent's token volume)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=DNS_LABEL, max_length=63)


class PodSpec(WireModel):
    model_config = ConfigDict(extra="allow")
    containers: list[Container] = Field(
        min_length=1, max_length=16, json_schema_extra=_names_rule("container", AGENT_CONTAINER)
    )
    volumes: list[Volume] | None = Field(
        default=None, max_length=256, json_schema_extra=_names_rule("volume", TOKEN_VOLUME)
    )

    @field_validator("containers")
    @classmethod
    def _container_names(cls, containers: list[Container]) -> list[Container]:
        _check_names(AGENT_CONTAINER, "container", [c.name for c in containers])
        return containers

    @field_validator("volumes")
    @classmethod
    def _volume_names(cls, volumes: list[Volume] | None) -> list[Volume] | None:
        _check_names(TOKEN_VOLUME, "volume", [v.name for v in volumes or []])
        return volumes


LabelKey = Annotated[str, Field(max_length=317, pattern=QUALIFIED_NAME)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]
AnnotationValue = Annotated[str, Field(max_length=256 * 1024)]  # the API server's limit on them all


class TemplateMetadata(WireModel):
    """The pods' labels and annotations; other fields pass through. The API server checks every value
    (a string; a label value's syntax); keys it cannot check by schema: the operator fails the job as
    InvalidSpec on a bad key."""

    model_config = ConfigDict(extra="allow")
    labels: dict[LabelKey, LabelValue] | None = None
    annotations: dict[LabelKey, AnnotationValue] | None = None


class PodTemplate(WireModel):
    """A PodTemplateSpec; the operator injects the agent sidecar, token, env and probes."""

    model_config = ConfigDict(extra="forbid")
    metadata: TemplateMetadata | None = None
    spec: PodSpec


class Drain(WireModel):
    mode: DrainMode = DrainMode.ABORT
    timeout_seconds: int = Field(default=120, ge=1, le=3600)


class Rollout(WireModel):
    container: str = Field(
        default=DEFAULT_ENGINE.value,
        pattern=DNS_LABEL,
        max_length=63,
        description="The engine's container. Unset: the one named as the engine (spec.engine).",
    )
    port: int = Field(
        default=ENGINE_TRAITS[DEFAULT_ENGINE].port,
        ge=1,
        le=65535,
        description="Where the engine's HTTP server listens on the pod's loopback. Unset: the engine's "
        f"default port ({by_engine(('rollout', 'port'))}).",
    )
    drain: Drain = Field(default_factory=Drain)
    pods_per_instance: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description="Pods one engine instance spans (its node count). Pod i is node rank i % "
        "podsPerInstance of instance i // podsPerInstance; only node rank 0 serves the engine's HTTP API. "
        "replicas must be a multiple of it.",
    )


class ReleaseVerify(WireModel):
    """Per-GPU evidence required before the trainer gets the GPU (release returns when rank 0 is done;
    other ranks may still be freeing memory)."""

    min_freed_bytes: int = Field(default=0, ge=0, le=2**50)
    min_freed_fraction: float = Field(
        default=0.5, ge=0.0, le=1.0, description="Fraction of the GPU memory used before release."
    )
    timeout_seconds: int = Field(default=60, ge=1, le=3600)


class Release(WireModel):
    tags: list[ReleaseTag] = Field(
        default_factory=lambda: list(ENGINE_TRAITS[DEFAULT_ENGINE].release_tags),
        min_length=1,
        max_length=3,
        description="The engine's memory parts each release frees. Unset: every part the engine can release "
        f"({by_engine(('release', 'tags'))}).",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    verify: ReleaseVerify = Field(default_factory=ReleaseVerify)

    @field_validator("tags")
    @classmethod
    def _unique(cls, tags: list[ReleaseTag]) -> list[ReleaseTag]:
        if len(set(tags)) != len(tags):
            raise ValueError("tags must be unique: releasing a tag twice kills the engine")
        return tags


class Trainer(WireModel):
    container: str = Field(default="trainer", pattern=DNS_LABEL, max_length=63)
    processes_per_pod: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Trainer processes per pod (torchrun --nproc-per-node). With 1, the operator also sets "
        "WORLD_SIZE, RANK and LOCAL_RANK; with more, torchrun sets them from the PET_* variables.",
    )
    master_port: int = Field(
        default=29500,
        ge=1,
        le=65535,
        description="Port of the trainer world's rendezvous (MASTER_PORT) on pod 0.",
    )


class Refit(WireModel):
    source: RefitSource = RefitSource.DISK
    timeout_seconds: int = Field(default=600, ge=1, le=86400)


class Weights(WireModel):
    initial_version: WeightVersion = Field(
        default=ENGINE_TRAITS[DEFAULT_ENGINE].initial_version,
        description="The version the engine's launch weights are labelled with. Unset: the engine's "
        f"({by_engine(('weights', 'initialVersion'))}).",
    )
    initial_path: str | None = Field(
        default=None, max_length=1024, description="Model path the engine starts from; used to rejoin."
    )


class PhaseTimeouts(WireModel):
    """Seconds a phase may last before the job is Degraded and the gang restarted. Unset: no limit.
    Rollout and Training run user code of unknown length, so they have no default."""

    initializing: int | None = Field(default=900, ge=1, le=86400)
    rollout: int | None = Field(default=None, ge=1, le=604800)
    draining: int | None = Field(default=300, ge=1, le=86400)
    releasing: int | None = Field(default=300, ge=1, le=86400)
    training: int | None = Field(default=None, ge=1, le=604800)
    refitting: int | None = Field(default=900, ge=1, le=86400)
    resuming: int | None = Field(default=300, ge=1, le=86400)


class Agent(WireModel):
    port: int = Field(default=8471, ge=1, le=65535)


class ProfileHints(WireModel):
    """What the rollout profile cannot measure: the decode roofline's inputs (docs/profiling.md)."""

    model_bytes: int | None = Field(
        default=None,
        ge=1,
        le=2**50,
        description="Bytes of the model's weights (all GPUs together): each decode step reads modelBytes / "
        "the engine's tensor-parallel size on every GPU. Unset: no decode roofline.",
    )
    memory_bandwidth_bytes_per_second: int | None = Field(
        default=None,
        ge=1,
        le=10**15,
        description="One GPU's memory bandwidth. Unset: looked up by the GPU's name (H200, H100, A100...).",
    )


REPLICAS_MULTIPLE_MESSAGE = (
    "replicas must be a multiple of rollout.podsPerInstance: every engine instance spans that many pods"
)
TENSOR_ACROSS_PODS_MESSAGE = (
    "refit.source tensor needs rollout.podsPerInstance 1: CUDA IPC handles cannot be opened on another "
    "node (use disk or distributed)"
)
MASTER_PORT_MESSAGE = (
    f"trainer.masterPort must differ from agent.port, rollout.port, {AGENT_TRAINER_PORT} and "
    f"{AGENT_ENGINE_PORT} (the agent's trainer and engine ports): they share the pod's network"
)
ENGINE_PORT_MESSAGE = f"rollout.port {AGENT_ENGINE_PORT} is the agent's engine port in the same pod"
SHARE_PROCESS_NAMESPACE_MESSAGE = (
    "template.spec.shareProcessNamespace must not be false with refit.source tensor: CUDA IPC handles "
    "cannot be opened from another PID namespace"
)

ROLLOUT_CONTAINER = engine_default(("rollout", "container"))
ROLLOUT_PORT = engine_default(("rollout", "port"))


def engine_rules() -> list[dict[str, Any]]:
    """Every engine's rules (ENGINE_TRAITS) as CEL on the spec, each applying to its engine's jobs only."""
    return [
        cel(f"self.engine != '{kind.value}' || ({rule})", message, field)
        for kind, traits in ENGINE_TRAITS.items()
        for field, rule, message, _ in traits.all_rules(kind)
    ]


# Cross-field rules, enforced by the API server (CEL) and by RLJobSpec's validator alike.
SPEC_RULES = [
    cel(
        f"{ROLLOUT_CONTAINER} != self.trainer.container",
        "rollout.container and trainer.container must name different containers",
        ".trainer.container",
    ),
    cel(
        f"self.template.spec.containers.exists(c, c.name == {ROLLOUT_CONTAINER})",
        "rollout.container must name a container of template.spec.containers",
        ".rollout.container",
    ),
    cel(
        "self.template.spec.containers.exists(c, c.name == self.trainer.container)",
        "trainer.container must name a container of template.spec.containers",
        ".trainer.container",
    ),
    cel(
        f"{ROLLOUT_PORT} != {AGENT_TRAINER_PORT}",
        f"rollout.port {AGENT_TRAINER_PORT} is the agent's trainer port in the same pod",
        ".rollout.port",
    ),
    cel(f"{ROLLOUT_PORT} != {AGENT_ENGINE_PORT}", ENGINE_PORT_MESSAGE, ".rollout.port"),
    cel(
        "self.replicas % self.rollout.podsPerInstance == 0",
        REPLICAS_MULTIPLE_MESSAGE,
        ".rollout.podsPerInstance",
    ),
    cel(
        "self.refit.source != 'tensor' || self.rollout.podsPerInstance == 1",
        TENSOR_ACROSS_PODS_MESSAGE,
        ".refit.source",
    ),
    cel(
        "!(self.trainer.masterPort in "
        f"[self.agent.port, {ROLLOUT_PORT}, {AGENT_TRAINER_PORT}, {AGENT_ENGINE_PORT}])",
        MASTER_PORT_MESSAGE,
        ".trainer.masterPort",
    ),
    cel(
        "!has(oldSelf.iterations) || (has(self.iterations) && self.iterations >= oldSelf.iterations)",
        "iterations may be raised, never lowered or unset once set",
        ".iterations",
    ),
    *engine_rules(),
]


class RLJobSpec(WireModel):
    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": cast(list[JsonValue], SPEC_RULES)}
    )

    engine: EngineKind = Field(
        default=DEFAULT_ENGINE,
        description="The inference engine the rollout container runs; it sets the defaults of "
        "rollout.container, rollout.port and release.tags, and what the job may ask of the engine.",
        json_schema_extra=immutable("engine"),
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_REPLICAS,
        description="GPU pods in the gang.",
        json_schema_extra=immutable("replicas"),
    )
    template: PodTemplate = Field(json_schema_extra=immutable("template"))
    rollout: Rollout = Field(default_factory=Rollout, json_schema_extra=immutable("rollout"))
    release: Release = Field(default_factory=Release, json_schema_extra=immutable("release"))
    trainer: Trainer = Field(default_factory=Trainer, json_schema_extra=immutable("trainer"))
    refit: Refit = Field(default_factory=Refit, json_schema_extra=immutable("refit"))
    weights: Weights = Field(default_factory=Weights, json_schema_extra=immutable("weights"))
    agent: Agent = Field(default_factory=Agent, json_schema_extra=immutable("agent"))
    iterations: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Stop after N; unset: run until deleted."
    )
    suspend: bool = False
    backoff_limit: int = Field(default=3, ge=0, le=1000)
    max_leases_without_weights: int = Field(
        default=3,
        ge=0,
        le=1000,
        description="Leases in a row the trainers may give back without new weights (a framework's release "
        "then resume with nothing pushed, e.g. AReaL's start-up offload and onload: the gang serves the "
        "committed version again); one more fails the job (LeasesWithoutWeightsExceeded). From 2 in a row "
        "the job says so: condition Degraded, reason LeasesWithoutWeights, and a Warning event.",
    )
    phase_timeout_seconds: PhaseTimeouts = Field(default_factory=PhaseTimeouts)
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31_536_000)
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31_536_000)
    pods_after_finished: PodsAfterFinished = PodsAfterFinished.DELETE
    profile: ProfileHints = Field(default_factory=ProfileHints)

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data: Any) -> Any:
        """Fill in what the job leaves to its engine (ENGINE_DEFAULTED), as the CEL reads it."""
        if not isinstance(data, dict):
            return data
        try:
            kind = EngineKind(data.get("engine", DEFAULT_ENGINE))
        except ValueError:
            return data  # the engine field's own error says why
        data = dict(data)
        for (part, name), value in engine_defaults(kind).items():
            given = data.get(part)
            if isinstance(given, WireModel):  # a model built in Python: what it was given, as a dict
                given = given.model_dump(by_alias=True, exclude_unset=True)
            if given is None:
                data[part] = {name: value}
            elif isinstance(given, dict) and name not in given and to_snake(name) not in given:
                data[part] = {**given, name: value}
        return data

    @model_validator(mode="after")
    def _engine_rules(self) -> RLJobSpec:
        """What the engine can never do (ENGINE_TRAITS), each message naming its field as the CEL does."""
        for field_name, _, message, holds in ENGINE_TRAITS[self.engine].all_rules(self.engine):
            if not holds(self):
                raise ValueError(f"{field_name[1:]}: {message}")
        return self

    @model_validator(mode="after")
    def _containers_exist(self) -> RLJobSpec:
        names = [c.name for c in self.template.spec.containers]
        if self.rollout.container == self.trainer.container:
            raise ValueError("rollout.container and trainer.container must name different containers")
        for role, name in (("rollout", self.rollout.container), ("trainer", self.trainer.container)):
            if name not in names:
                raise ValueError(f"{role}.container {name!r} is not a container of template.spec.containers")
        if self.rollout.port == AGENT_TRAINER_PORT:
            raise ValueError(f"rollout.port {AGENT_TRAINER_PORT} is the agent's trainer port in the same pod")
        if self.rollout.port == AGENT_ENGINE_PORT:
            raise ValueError(ENGINE_PORT_MESSAGE)
        # Each message names its field, as the CEL rule's fieldPath does.
        if self.replicas % self.rollout.pods_per_instance:
            raise ValueError(f"rollout.podsPerInstance: {REPLICAS_MULTIPLE_MESSAGE}")
        tensor = self.refit.source == RefitSource.TENSOR
        if tensor and self.rollout.pods_per_instance != 1:
            raise ValueError(f"refit.source: {TENSOR_ACROSS_PODS_MESSAGE}")
        agent_ports = (self.agent.port, AGENT_TRAINER_PORT, AGENT_ENGINE_PORT)
        if self.trainer.master_port in (self.rollout.port, *agent_ports):
            raise ValueError(f"trainer.masterPort: {MASTER_PORT_MESSAGE}")
        if tensor and (self.template.spec.model_extra or {}).get("shareProcessNamespace") is False:
            raise ValueError(f"template.spec.shareProcessNamespace: {SHARE_PROCESS_NAMESPACE_MESSAGE}")
        return self


# Rules on the whole RLJob: CEL at the root may read metadata.name (and generateName). The name is
# checked before it names any child.
NAME_RULES = [
    cel(f"size(self.metadata.name) <= {JOB_NAME_MAX_LENGTH}", JOB_NAME_LENGTH_MESSAGE, ".metadata.name"),
    cel(f"self.metadata.name.matches('{DNS_1035_LABEL}')", JOB_NAME_FORMAT_MESSAGE, ".metadata.name"),
]


class JobMetadata(WireModel):
    """What the operator reads of the RLJob's metadata: the name every child is named after."""

    model_config = ConfigDict(extra="allow")
    name: str

    @field_validator("name")
    @classmethod
    def _child_safe(cls, name: str) -> str:
        if len(name) > JOB_NAME_MAX_LENGTH:
            raise ValueError(JOB_NAME_LENGTH_MESSAGE)
        if not re.match(DNS_1035_LABEL, name):
            raise ValueError(JOB_NAME_FORMAT_MESSAGE)
        return name
