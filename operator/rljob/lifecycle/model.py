"""Inputs and outputs of the lifecycle machine: what was observed, and what to do about it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from rljob.api.agent import Action, AgentState, Command, LaunchRefusalReason
from rljob.api.status import RLJobStatus
from rljob.lifecycle.evidence import Evidence


@dataclass(frozen=True)
class PodObservation:
    """One pod of the job as the API server reports it."""

    index: int
    name: str
    gang: int  # the gang generation label the pod was created with (status.restarts at that time)
    phase: str = "Pending"  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool = False
    deleting: bool = False
    broken: str | None = None  # a container failed or restarted: the member lost its state
    completed: tuple[str, ...] = ()  # containers that exited 0 (the trainer's: it finished; step.py)
    unschedulable: str | None = None  # the scheduler's words when it found no node for the pod

    @property
    def running(self) -> bool:
        return self.phase == "Running" and not self.deleting and self.broken is None


class Admission(StrEnum):
    """What a queue (Kueue) says about the quota of the whole gang."""

    NOT_QUEUED = "NotQueued"  # the job names no queue: nothing holds it back
    PENDING = "Pending"  # queued without quota: no pod of it may exist
    ADMITTED = "Admitted"  # the quota of every pod is reserved: the gang may run
    EVICTED = "Evicted"  # the quota is being taken back (preemption, a stopped queue): stop, then queue again


@dataclass(frozen=True)
class AgentRefusal:
    """An agent's answer to a command it did not take (api/agent.py Refusal)."""

    pod: str
    reason: str  # what the agent said, as shown to people
    error: str | None = None  # its typed name, e.g. RetractUnsupported
    permanent: bool = False  # no retry and no new gang can change it: the job fails


@dataclass(frozen=True)
class Observation:
    """Everything the machine may look at. `agents` maps pod name -> the latest state that pod's agent
    reported (None: unreachable so far). Time is an input: the machine never reads a clock."""

    now: datetime
    pods: tuple[PodObservation, ...] = ()
    agents: Mapping[str, AgentState | None] = field(default_factory=dict)
    generation: int | None = None  # metadata.generation of the RLJob
    # "field.path: message" of a spec the models refuse or a child the API server refused: the job fails.
    spec_error: str | None = None
    # The queue's word on the gang's quota; the message goes to status.message and the Queued condition.
    admission: Admission = Admission.NOT_QUEUED
    admission_message: str = ""
    # Refused since the last decision: one CommandRefused Warning each; a permanent one fails the job.
    refusals: tuple[AgentRefusal, ...] = ()


class EventType(StrEnum):
    NORMAL = "Normal"
    WARNING = "Warning"


class EventReason(StrEnum):
    """Typed reasons for Kubernetes Events (and the status `reason` field)."""

    PHASE_CHANGED = "PhaseChanged"
    PODS_CREATED = "PodsCreated"
    PODS_DELETED = "PodsDeleted"
    GANG_MEMBER_LOST = "GangMemberLost"
    COMMAND_FAILED = "CommandFailed"
    COMMAND_REFUSED = "CommandRefused"
    PHASE_TIMEOUT = "PhaseTimeout"
    BACKOFF_LIMIT_EXCEEDED = "BackoffLimitExceeded"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    WEIGHT_CACHE_ACTIVE = "WeightCacheActive"
    RELEASE_FREES_NOTHING = "ReleaseFreesNothing"
    LIFECYCLE_ROUTES_DISABLED = "LifecycleRoutesDisabled"
    TENSOR_TRANSFER_UNCONFIGURED = "TensorTransferUnconfigured"
    INSECURE_ENGINE_EXPOSED = "InsecureEngineExposed"
    # Permanent refusals of an agent (its engine's guards): the engine's version or launch flags forbid it.
    RETRACT_UNSUPPORTED = "RetractUnsupported"
    MEMORY_SAVER_DISABLED = "MemorySaverDisabled"
    DATA_PARALLEL_ATTENTION_UNSUPPORTED = "DataParallelAttentionUnsupported"
    DATA_PARALLEL_UNSUPPORTED = "DataParallelUnsupported"
    DRAIN_MODE_UNSUPPORTED = "DrainModeUnsupported"
    RELEASE_TAG_UNSUPPORTED = "ReleaseTagUnsupported"
    DISTRIBUTED_REFIT_UNSUPPORTED = "DistributedRefitUnsupported"
    INITIAL_VERSION_MISMATCH = "InitialVersionMismatch"
    TRAINER_VERSION_MISMATCH = "TrainerVersionMismatch"
    VERSION_NOT_NEWER = "VersionNotNewer"
    WEIGHTS_COMMITTED = "WeightsCommitted"
    SUSPENDED = "Suspended"
    RESUMED = "Resumed"
    COMPLETED = "Completed"
    ITERATIONS_RAISED = "IterationsRaised"  # spec.iterations raised after Succeeded: the job continues
    INVALID_SPEC = "InvalidSpec"
    RELEASE_SHORTFALL = "ReleaseShortfall"  # the released tags can never free what release.verify asks
    WAITING_FOR_QUOTA = "WaitingForQuota"  # queued: no pod until the queue admits the whole gang
    EVICTED = "Evicted"  # the queue takes the quota back: the gang drains and goes, the job queues again
    ADMITTED = "Admitted"  # the queue admitted the whole gang
    UNSCHEDULABLE = "Unschedulable"  # the scheduler cannot place a member: the placed ones wait, unstarted
    GANG_PLACED = "GangPlaced"  # the scheduler placed every member after one had been Unschedulable
    TRAINERS_FINISHED = "TrainersFinished"  # every trainer container exited 0: the job is done
    TRAINER_FINISHED_EARLY = "TrainerFinishedEarly"  # a trainer exited 0 while another wants an iteration
    NO_NEW_WEIGHTS = "NoNewWeights"  # the trainers returned the lease without weights: committed again
    NO_ITERATION_COMMITTED = "NoIterationCommitted"  # every trainer exited 0 before any iteration committed
    LEASES_WITHOUT_WEIGHTS = "LeasesWithoutWeights"  # leases in a row came back without weights (a Warning)
    LEASES_WITHOUT_WEIGHTS_EXCEEDED = "LeasesWithoutWeightsExceeded"  # past spec.maxLeasesWithoutWeights
    RESUME_WAITING_FOR_MEMORY = "ResumeWaitingForMemory"  # a resume's GPU memory is held by another process
    TRAINER_HOLDS_GPU_MEMORY = "TrainerHoldsGpuMemory"  # a trainer kept GPU memory after returning its lease
    WEIGHTS_MISMATCH = "WeightsMismatch"  # a pod holds other weights than it must (lifecycle/weights.py)
    WEIGHTS_NOT_VERIFIED = "WeightsNotVerified"  # a pod's engine gave no checksum of its weights


# The event reason of each launch refusal an engine reports (AgentState.engine.launchRefusal).
LAUNCH_REFUSALS: Mapping[LaunchRefusalReason, EventReason] = {
    LaunchRefusalReason.WEIGHT_CACHE_ACTIVE: EventReason.WEIGHT_CACHE_ACTIVE,
    LaunchRefusalReason.RELEASE_FREES_NOTHING: EventReason.RELEASE_FREES_NOTHING,
    LaunchRefusalReason.LIFECYCLE_ROUTES_DISABLED: EventReason.LIFECYCLE_ROUTES_DISABLED,
    LaunchRefusalReason.TENSOR_TRANSFER_UNCONFIGURED: EventReason.TENSOR_TRANSFER_UNCONFIGURED,
    LaunchRefusalReason.INSECURE_ENGINE_EXPOSED: EventReason.INSECURE_ENGINE_EXPOSED,
}


@dataclass(frozen=True)
class Event:
    reason: EventReason
    message: str
    type: EventType = EventType.NORMAL


@dataclass(frozen=True)
class PodCommand:
    pod: str
    command: Command


@dataclass(frozen=True)
class Awaited:
    """A pod a decision waits on for one thing only: its report showing `evidence` for `epoch` (the
    epoch's command is `action`); `evidence` is checkable per report (Evidence.awaited_as)."""

    pod: str
    boot_id: str
    epoch: int
    action: Action
    evidence: Evidence = Evidence.COMMAND_SUCCEEDED
    memory_wait: str | None = None  # what its resume waited for in the report decided (memory_waits.py)


@dataclass(frozen=True)
class Decision:
    """The next status plus the effects to carry out, in this order: write status, then act.
    Writing first means a restarted operator re-derives the same epoch, and a repeated epoch is a
    no-op at the agent."""

    status: RLJobStatus
    commands: tuple[PodCommand, ...] = ()
    create_pods: tuple[int, ...] = ()  # indices of the current gang to create
    delete_pods: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    delete_job: bool = False  # ttlSecondsAfterFinished elapsed
    # Set only when every pod the decision waits on waits for one piece of evidence (Awaited.evidence) and
    # nothing else is pending: until the last shows it, a report of one that did decides nothing new
    # (awaiting.awaited_report).
    awaiting: tuple[Awaited, ...] = ()
    # The first moment time alone changes this decision (a deadline or TTL not yet passed); None: never.
    next_due: datetime | None = None
