"""RLJob spec: what the user asks for. Defaults live here, and the CRD is generated from these models."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, cast

from pydantic import ConfigDict, Field, JsonValue, field_validator, model_validator

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

WeightVersion = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")]
"""A weight version as SGLang serves it (`/model_info` -> weight_version)."""


class ReleaseTag(StrEnum):
    """SGLang memory regions (`srt/constants.py`)."""

    KV_CACHE = "kv_cache"
    WEIGHTS = "weights"
    CUDA_GRAPH = "cuda_graph"


class DrainMode(StrEnum):
    """`pause_generation` modes the agent will use. `in_place` is deliberately absent: it keeps
    requests holding KV, and a release after it kills SGLang."""

    ABORT = "abort"
    RETRACT = "retract"


class RefitSource(StrEnum):
    DISK = "disk"  # agent calls update_weights_from_disk with the path the trainer published
    TENSOR = "tensor"  # trainer pushes CUDA-IPC tensors inside a refit window opened by the agent
    DISTRIBUTED = "distributed"  # trainer broadcasts over NCCL inside a refit window


class PodsAfterFinished(StrEnum):
    DELETE = "Delete"  # give the GPUs back as soon as the job ends
    KEEP = "Keep"  # leave the gang serving the final weights (evaluation, debugging)


class Container(WireModel):
    """Only the name is modelled; every other container field is passed through untouched."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(pattern=DNS_LABEL, max_length=63)


class PodSpec(WireModel):
    model_config = ConfigDict(extra="allow")
    containers: list[Container] = Field(min_length=1, max_length=16)


class PodTemplate(WireModel):
    """A PodTemplateSpec; the operator injects the agent sidecar, token, env and probes."""

    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] | None = None
    spec: PodSpec


class Drain(WireModel):
    mode: DrainMode = DrainMode.ABORT
    timeout_seconds: int = Field(default=120, ge=1, le=3600)


class Rollout(WireModel):
    container: str = Field(default="sglang", pattern=DNS_LABEL, max_length=63)
    port: int = Field(default=30000, ge=1, le=65535)
    drain: Drain = Field(default_factory=Drain)


class ReleaseVerify(WireModel):
    """Per-GPU evidence required before the trainer gets the GPU (release returns when rank 0 is done;
    other ranks may still be freeing memory)."""

    min_freed_bytes: int = Field(default=0, ge=0, le=2**50)
    min_freed_fraction: float = Field(
        default=0.5, ge=0.0, le=1.0, description="Fraction of the GPU memory used before release."
    )
    timeout_seconds: int = Field(default=60, ge=1, le=3600)


ALL_TAGS = [ReleaseTag.KV_CACHE, ReleaseTag.WEIGHTS, ReleaseTag.CUDA_GRAPH]


class Release(WireModel):
    tags: list[ReleaseTag] = Field(
        default_factory=lambda: list(ALL_TAGS),
        min_length=1,
        max_length=3,
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    verify: ReleaseVerify = Field(default_factory=ReleaseVerify)

    @field_validator("tags")
    @classmethod
    def _unique(cls, tags: list[ReleaseTag]) -> list[ReleaseTag]:
        if len(set(tags)) != len(tags):
            raise ValueError("tags must be unique: releasing a tag twice kills SGLang")
        return tags


class Trainer(WireModel):
    container: str = Field(default="trainer", pattern=DNS_LABEL, max_length=63)


class Refit(WireModel):
    source: RefitSource = RefitSource.DISK
    timeout_seconds: int = Field(default=600, ge=1, le=86400)


class Weights(WireModel):
    initial_version: WeightVersion = "0"
    initial_path: str | None = Field(
        default=None, max_length=1024, description="Model path SGLang starts from; used to rejoin."
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


# Cross-field rules, enforced by the API server (CEL) and by RLJobSpec's validator alike.
SPEC_RULES = [
    cel(
        "self.rollout.container != self.trainer.container",
        "rollout.container and trainer.container must name different containers",
        ".trainer.container",
    ),
    cel(
        "self.template.spec.containers.exists(c, c.name == self.rollout.container)",
        "rollout.container must name a container of template.spec.containers",
        ".rollout.container",
    ),
    cel(
        "self.template.spec.containers.exists(c, c.name == self.trainer.container)",
        "trainer.container must name a container of template.spec.containers",
        ".trainer.container",
    ),
    cel(
        "!has(oldSelf.iterations) || (has(self.iterations) && self.iterations >= oldSelf.iterations)",
        "iterations may be raised, never lowered or unset once set",
        ".iterations",
    ),
]


class RLJobSpec(WireModel):
    model_config = ConfigDict(
        json_schema_extra={"x-kubernetes-validations": cast(list[JsonValue], SPEC_RULES)}
    )

    replicas: int = Field(
        default=1, ge=1, le=1024, description="GPU pods in the gang.", json_schema_extra=immutable("replicas")
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
    phase_timeout_seconds: PhaseTimeouts = Field(default_factory=PhaseTimeouts)
    active_deadline_seconds: int | None = Field(default=None, ge=1, le=31_536_000)
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0, le=31_536_000)
    pods_after_finished: PodsAfterFinished = PodsAfterFinished.DELETE

    @model_validator(mode="after")
    def _containers_exist(self) -> RLJobSpec:
        names = [c.name for c in self.template.spec.containers]
        if self.rollout.container == self.trainer.container:
            raise ValueError("rollout.container and trainer.container must name different containers")
        for role, name in (("rollout", self.rollout.container), ("trainer", self.trainer.container)):
            if name not in names:
                raise ValueError(f"{role}.container {name!r} is not a container of template.spec.containers")
        return self
