"""RLJob status: written by one writer (the controller), read by kubectl, the plugin and the operator
itself after a restart — everything the lifecycle needs to resume lives here."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field

from rljob.api.base import WireModel
from rljob.api.spec import ReleaseTag, WeightVersion

MAX_PODS_IN_STATUS = 64
MAX_WEIGHT_HISTORY = 16
MAX_TIMELINE = 24
MAX_ITERATION_HISTORY = 16
MAX_DIAGNOSIS = 5
MAX_MESSAGE = 1024
MAX_UNMEASURED = 8  # at least one entry per Signal

WeightsChecksum = Annotated[str, Field(min_length=64, max_length=64, pattern=r"^[0-9a-f]{64}$")]
"""What a pod's engine holds: sha256 (hex) over the per-GPU checksums of its weights, in (pp, tp) rank
order (agent/weights_check.py)."""


class Phase(StrEnum):
    PENDING = "Pending"
    INITIALIZING = "Initializing"
    ROLLOUT = "Rollout"
    DRAINING = "Draining"
    RELEASING = "Releasing"
    TRAINING = "Training"
    REFITTING = "Refitting"
    RESUMING = "Resuming"
    RECOVERING = "Recovering"
    SUSPENDING = "Suspending"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"

    @property
    def terminal(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


class ConditionType(StrEnum):
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    SUSPENDED = "Suspended"
    COMPLETE = "Complete"
    FAILED = "Failed"
    QUEUED = "Queued"  # only for jobs that name a queue (Kueue): True while it holds the gang back
    SCHEDULED = "Scheduled"  # only once a member was Unschedulable: False until the scheduler places all


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Verdict(StrEnum):
    ROLLOUT_BOUND = "RolloutBound"
    TRAIN_BOUND = "TrainBound"
    BALANCED = "Balanced"


class StatusModel(WireModel):
    """Base of every status model. Unknown fields are ignored, not refused (the spec models stay
    strict, so a typo in a manifest is still an error): status is written by the operator itself, and
    an operator rolled back one version must still read the status a newer one wrote. Helm installs
    the chart's crds/ once and never downgrades them, so the newer fields stay in the schema."""

    model_config = ConfigDict(extra="ignore")


class Condition(StatusModel):
    type: ConditionType
    status: ConditionStatus
    reason: str = Field(default="", max_length=128)
    message: str = Field(default="", max_length=MAX_MESSAGE)
    last_transition_time: str | None = Field(default=None, max_length=64)


class CommittedWeights(StatusModel):
    version: WeightVersion
    path: str | None = Field(default=None, max_length=1024)
    iteration: int = Field(ge=0)
    committed_at: str | None = Field(default=None, max_length=64)
    weights_checksum: WeightsChecksum | None = Field(
        default=None,
        description="What every pod of `weightsLayout` held at this version, verified after its refit; a "
        "rejoin or a reload of this version must hold the same. Unset where the engine gives no checksum.",
    )
    weights_layout: str | None = Field(
        default=None, max_length=64, description="The engine's parallel layout, e.g. `tp1 pp1`."
    )


class PodStatus(StatusModel):
    """One gang member as the agent last reported it."""

    name: str = Field(max_length=253)
    stage: str = Field(default="Unknown", max_length=32)
    engine: str | None = Field(
        default=None,
        max_length=96,
        description="The pod's engine and its version, as its agent reports them.",
    )
    weight_version: str | None = Field(default=None, max_length=64)
    weights_checksum: WeightsChecksum | None = Field(
        default=None, description="The checksum of what the pod's engine holds at weightVersion."
    )
    weights: str | None = Field(
        default=None,
        max_length=MAX_MESSAGE,
        description="How those weights were verified (`verified: trainer digest, previous version, other "
        "pods`), or `weights not verified: <reason>`.",
    )
    released_tags: list[ReleaseTag] = Field(default_factory=list, max_length=3)
    freed_bytes: int = Field(default=0, ge=0)
    last_error: str | None = Field(default=None, max_length=MAX_MESSAGE)
    gpus: str | None = Field(
        default=None,
        max_length=MAX_MESSAGE,
        description="Which GPUs the pod's agent verifies: its scope and devices, or why it cannot tell.",
    )


class Signal(StrEnum):
    """A signal of docs/profiling.md that its source may not measure, named as its IterationReport field
    (tokenCounts: promptTokens, cachedTokens and generationTokens, read from the same counters)."""

    CACHE_HIT_RATE = "cacheHitRate"
    GENERATION_TOKENS_PER_SECOND = "generationTokensPerSecond"
    TOKEN_COUNTS = "tokenCounts"
    GPU_BUSY_FRACTION = "gpuBusyFraction"
    SAMPLES = "samples"


class UnmeasuredReason(StrEnum):
    """Why a signal is absent (docs/profiling.md, "Not measured")."""

    METRICS_DISABLED = "MetricsDisabled"  # the engine measures no counters (a launch flag it lacks)
    METRICS_UNANSWERED = "MetricsUnanswered"  # the engine's counters answered no read of the rollout
    NOT_REPORTED = "NotReported"  # its source (an agent, the GPU probe, the trainer) reported none


class Unmeasured(StatusModel):
    """A signal left unset, never 0, and why: no lever is ranked from it (lifecycle/levers.py)."""

    signal: Signal
    reason: UnmeasuredReason
    message: str = Field(default="", max_length=256, description="What was missing, for kubectl.")


class RolloutTotals(StatusModel):
    """One rollout, summed over the gang's agents (docs/profiling.md defines each number). Kept on the
    Rollout span until the iteration's report is made from it."""

    pods: int = Field(default=0, ge=0, description="Agents that sampled the rollout.")
    gpus: int = Field(default=0, ge=0)
    gpu_name: str | None = Field(default=None, max_length=128)
    tp_size: int | None = Field(default=None, ge=1)
    window_seconds: float | None = Field(default=None, ge=0, description="Longest agent window.")
    gpu_busy_fraction: float | None = Field(default=None, ge=0, le=1, description="GPU-weighted mean.")
    prompt_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)
    generation_tokens: int | None = Field(default=None, ge=0)
    generation_tokens_per_second: float | None = Field(
        default=None, ge=0, description="Sum over pods of generation tokens / window."
    )
    mean_running_requests: float | None = Field(default=None, ge=0, description="Sum over pods.")
    mean_waiting_requests: float | None = Field(default=None, ge=0, description="Sum over pods.")
    samples: int | None = Field(default=None, ge=0, description="Completed samples the trainers reported.")
    unmeasured: list[Unmeasured] = Field(
        default_factory=list,
        max_length=MAX_UNMEASURED,
        description="The signals no agent measured, with the first agent's reason.",
    )


class PhaseSpan(StatusModel):
    """One phase of one iteration: the timeline `kubectl rljob status` prints."""

    phase: Phase
    iteration: int = Field(ge=0)
    start_time: str = Field(max_length=64)
    seconds: float | None = Field(default=None, ge=0)
    agent_seconds: float | None = Field(
        default=None, ge=0, description="Slowest pod's time inside the agent (engine calls included)."
    )
    freed_bytes: int | None = Field(default=None, ge=0, description="Releasing: sum over pods.")
    trainer_seconds: float | None = Field(
        default=None,
        ge=0,
        description="Training: the slowest pod's trainer held the GPU this long, as its agent timed it (the "
        "grant to the publish); the rest of the span is what the control plane cost.",
    )
    cache_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Rollout: prefix-cache hit rate, token-weighted over the gang (the mean of the last "
        "prefill batches' rates where the engine's counters did not answer); unset where the engine "
        "measures no counters.",
    )
    tokens_per_second: float | None = Field(default=None, ge=0, description="Rollout: sum over pods.")
    rollout: RolloutTotals | None = Field(default=None, description="Rollout: what the agents measured.")


class PhaseSeconds(StatusModel):
    rollout: float = 0.0
    draining: float = 0.0
    releasing: float = 0.0
    training: float = 0.0
    refitting: float = 0.0
    resuming: float = 0.0


class IterationReport(StatusModel):
    """Where the wall-clock of the last completed iteration went."""

    iteration: int = Field(ge=0)
    seconds: PhaseSeconds = Field(default_factory=PhaseSeconds)
    control_overhead_seconds: float = Field(
        default=0.0,
        description="The iteration's Draining, Releasing, Refitting and Resuming only, summed: each phase's "
        "wall time minus the slowest pod's time inside its agent (engine calls included), at least 0. "
        "Training and Rollout are left out: Training's control cost is its span's seconds minus "
        "trainerSeconds (status.timeline).",
    )
    freed_bytes: int = Field(default=0, ge=0, description="Sum over pods.")
    cache_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Prefix-cache hit rate over the whole rollout: cached / prompt tokens (the engine's "
        "counters); the last prefill batches' rate where the counters did not answer; unset (see "
        "unmeasured) where the engine measures no counters.",
    )
    generation_tokens_per_second: float | None = Field(default=None, ge=0, description="Sum over pods.")
    # The signals of docs/profiling.md (lifecycle/signals.py computes them); None where not measured.
    wall_seconds: float | None = Field(default=None, ge=0, description="The iteration's phases, summed.")
    rollout_share: float | None = Field(default=None, ge=0, le=1, description="Rollout / (rollout + train).")
    gpus: int | None = Field(default=None, ge=0)
    gpu_busy_fraction: float | None = Field(
        default=None, ge=0, le=1, description="During rollout: fraction of time a kernel ran (NVML)."
    )
    mean_running_requests: float | None = Field(default=None, ge=0)
    mean_waiting_requests: float | None = Field(default=None, ge=0)
    prompt_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)
    generation_tokens: int | None = Field(default=None, ge=0)
    samples: int | None = Field(default=None, ge=0, description="Completed samples the trainers reported.")
    tokens_per_second_per_gpu: float | None = Field(default=None, ge=0)
    decode_roofline_tokens_per_second: float | None = Field(
        default=None,
        ge=0,
        description="Memory-bandwidth bound on generation tokens/s at the measured batch: running requests "
        "x bandwidth / weight bytes per GPU.",
    )
    roofline_fraction: float | None = Field(default=None, ge=0, description="Tokens/s / decode roofline.")
    gpu_seconds: float | None = Field(default=None, ge=0, description="Iteration wall x GPUs.")
    gpu_seconds_per_sample: float | None = Field(default=None, ge=0, description="The cost per rollout.")
    tokens_per_gpu_second: float | None = Field(default=None, ge=0)
    unmeasured: list[Unmeasured] = Field(
        default_factory=list,
        max_length=MAX_UNMEASURED,
        description="Every signal left unset and why; a signal derived from one of them is unset too.",
    )


class Profile(StatusModel):
    rollout_share: float = Field(ge=0, le=1, description="Rollout / (rollout + training) wall time.")
    rollout_percent: int = Field(ge=0, le=100, description="rolloutShare as a percentage, for kubectl.")
    verdict: Verdict


class LeverName(StrEnum):
    """What to change (docs/profiling.md, the lever table in lifecycle/levers.py)."""

    TRAINER = "Trainer"
    ROLLOUT_CONCURRENCY = "RolloutConcurrency"
    RUNNING_REQUEST_LIMIT = "RunningRequestLimit"
    ROLLOUT_CAPACITY = "RolloutCapacity"
    RUNTIME_SPEED = "RuntimeSpeed"
    PROMPT_STRUCTURE = "PromptStructure"
    WEIGHT_HANDOFF = "WeightHandoff"
    CONTROL_OVERHEAD = "ControlOverhead"
    MEASUREMENT = "Measurement"


class Lever(StatusModel):
    """One entry of the diagnosis: a lever, why (what to change), and the measured numbers behind it."""

    lever: LeverName
    reason: str = Field(max_length=256)
    evidence: str = Field(default="", max_length=256)
    share: float | None = Field(
        default=None, ge=0, le=1, description="Part of the iteration's wall time it bears on (the rank)."
    )


class RLJobStatus(StatusModel):
    phase: Phase = Phase.PENDING
    reason: str | None = Field(default=None, max_length=128)
    message: str | None = Field(default=None, max_length=MAX_MESSAGE)
    iteration: int = Field(
        default=0, ge=0, description="Current iteration (1-based); 0 before the first rollout."
    )
    epoch: int = Field(default=0, ge=0, description="Lifecycle step counter; stamps every agent command.")
    phase_start_time: str | None = Field(default=None, max_length=64)
    weight_version: WeightVersion | None = Field(default=None, description="Served and verified on all pods.")
    target_weights: CommittedWeights | None = Field(
        default=None, description="Weights being refitted; committed to weightVersion after verification."
    )
    stopping: bool = Field(
        default=False,
        description="A suspend or a preemption taken at rollout: the gang drains and releases its GPU memory "
        "(Draining, Releasing) before Suspending deletes its pods.",
    )
    weight_history: list[CommittedWeights] = Field(default_factory=list, max_length=MAX_WEIGHT_HISTORY)
    replicas: int = Field(default=0, ge=0)
    ready_replicas: int = Field(default=0, ge=0)
    ready: str = Field(default="0/0", max_length=32, description="readyReplicas/replicas, for kubectl.")
    pods: list[PodStatus] = Field(default_factory=list, max_length=MAX_PODS_IN_STATUS)
    timeline: list[PhaseSpan] = Field(default_factory=list, max_length=MAX_TIMELINE)
    last_iteration: IterationReport | None = None
    iteration_history: list[IterationReport] = Field(
        default_factory=list,
        max_length=MAX_ITERATION_HISTORY,
        description="The newest completed iterations' reports, oldest first (`kubectl rljob profile`).",
    )
    profile: Profile | None = None
    diagnosis: list[Lever] = Field(
        default_factory=list,
        max_length=MAX_DIAGNOSIS,
        description="Levers, ranked by the share of the last iteration they bear on, with the reasons.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=8,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(default=None, ge=0)
    restarts: int = Field(default=0, ge=0)
    leases_without_weights: int = Field(
        default=0,
        ge=0,
        description="Leases in a row the trainers gave back without new weights (the gang served the "
        "committed version again); 0 again once an iteration commits. Past spec.maxLeasesWithoutWeights "
        "the job fails.",
    )
    start_time: str | None = Field(default=None, max_length=64)
    completion_time: str | None = Field(default=None, max_length=64)

    def condition(self, type_: ConditionType) -> Condition | None:
        """Conditions are looked up by type, never by position."""
        return next((c for c in self.conditions if c.type == type_), None)
