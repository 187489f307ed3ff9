"""The agent's wire protocol: operator -> agent commands and the agent's state report, plus the
trainer-facing messages. The agent's OpenAPI document is generated from these models."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, TypeAdapter, model_validator

from rljob.api.base import WireModel
from rljob.api.spec import (
    DEFAULT_ENGINE,
    DrainMode,
    EngineKind,
    RefitSource,
    ReleaseTag,
    ReleaseVerify,
    WeightVersion,
)
from rljob.api.status import MAX_UNMEASURED, Unmeasured, WeightsChecksum

AGENT_API_VERSION = "v1"
# Set by the operator: every container's own name, and, on the agent, the pod's trainer container. The agent
# reads the first in /proc/<pid>/environ to tell whose process holds GPU memory (agent/gpu_holders.py).
CONTAINER_ENV = "RLJOB_CONTAINER"
TRAINER_CONTAINER_ENV = "RLJOB_TRAINER_CONTAINER"

ParameterHash = Annotated[
    str, Field(min_length=16, max_length=64, pattern=r"^[0-9a-f]{16}(?:[0-9a-f]{48})?$")
]
"""One parameter's hash as the engine's weights checksum writes it (rljob.trainer.engines: its hash): 16 hex
digits of a 64-bit hash, or 64 of a sha256."""
MAX_DIGEST_PARAMETERS = 200_000


class Action(StrEnum):
    DRAIN = "drain"
    RELEASE = "release"
    GRANT = "grant"
    REFIT = "refit"
    RESUME = "resume"


class Stage(StrEnum):
    """Where the agent has brought its pod's inference engine. Linear within an iteration:
    Serving -> Drained -> Released -> Granted -> Trained -> Refitted -> Serving.
    A fresh agent goes Starting -> Ready; only the operator's `resume` (served version verified)
    or `refit` + `resume` opens rollout (Serving): the trainer must never sample from weights the job
    has not committed (e.g. a recreated pod still serving the initial weights)."""

    STARTING = "Starting"  # the engine not answering yet
    READY = "Ready"  # the engine up and its version detected; rollout not opened by the operator yet
    SERVING = "Serving"  # rollout open
    DRAINED = "Drained"  # paused and idle
    RELEASED = "Released"  # memory released and verified on every GPU
    GRANTED = "Granted"  # trainer holds the GPU lease
    TRAINED = "Trained"  # trainer published a version and returned the lease
    REFITTED = "Refitted"  # weights resumed, new version loaded and verified; still paused
    FAILED = "Failed"  # the engine died or a fatal error: the pod must be replaced


class GroupState(StrEnum):
    """The weight-update group a distributed refit window forms (the engine joins the trainer's)."""

    PENDING = "Pending"  # the engine waits in the rendezvous until the trainer (group rank 0) has joined
    READY = "Ready"
    FAILED = "Failed"


class CommandState(StrEnum):
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class _CommandBase(WireModel):
    """Every command carries the epoch: the idempotency key. The same epoch again returns the recorded
    result and does nothing; an older epoch is refused as stale (409)."""

    epoch: int = Field(ge=1)


class DrainCommand(_CommandBase):
    action: Literal[Action.DRAIN] = Action.DRAIN
    mode: DrainMode = DrainMode.ABORT
    timeout_seconds: float = Field(default=120, gt=0, le=3600)


class ReleaseCommand(_CommandBase):
    action: Literal[Action.RELEASE] = Action.RELEASE
    tags: list[ReleaseTag] = Field(min_length=1, max_length=3)
    verify: ReleaseVerify = Field(default_factory=ReleaseVerify)


class GrantCommand(_CommandBase):
    action: Literal[Action.GRANT] = Action.GRANT


class RefitCommand(_CommandBase):
    action: Literal[Action.REFIT] = Action.REFIT
    version: WeightVersion
    path: str | None = Field(default=None, max_length=1024)
    source: RefitSource = RefitSource.DISK
    timeout_seconds: float = Field(default=600, gt=0, le=86400)
    reload: bool = Field(
        default=False,
        description="The trainers gave the lease back without new weights: bring back the committed "
        "`version` the release discarded (the engine's host copy where it keeps one, else a disk load of "
        "`path` or of the checkpoint the engine last loaded that version from); no window opens.",
    )
    committed_checksum: WeightsChecksum | None = Field(
        default=None,
        description="A rejoin or a reload of the committed `version`: the checksum every pod of "
        "`committedLayout` verified when the job committed it. The refit fails unless the engine then holds "
        "the same weights.",
    )
    committed_layout: str | None = Field(default=None, max_length=64, description="Its parallel layout.")


class ResumeCommand(_CommandBase):
    action: Literal[Action.RESUME] = Action.RESUME
    timeout_seconds: float = Field(default=300, gt=0, le=86400)
    version: WeightVersion | None = Field(
        default=None,
        description="To a follower: the version its instance's leader verified, which it reports as served "
        "(a follower has no engine API to read it from). A leader reads the version from its engine.",
    )


Command = Annotated[
    DrainCommand | ReleaseCommand | GrantCommand | RefitCommand | ResumeCommand, Field(discriminator="action")
]
"""`POST /v1/commands` body, discriminated by `action`."""

COMMAND_ADAPTER: TypeAdapter[Command] = TypeAdapter(Command)


class CommandStatus(WireModel):
    epoch: int = Field(ge=0)
    action: Action
    state: CommandState
    error: str | None = Field(default=None, max_length=1024)
    permanent: bool = Field(
        default=False,
        description="The failure would repeat on any retry (e.g. the released tags cannot free what "
        "`verify` asks): the job fails instead of restarting the gang.",
    )
    failure_reason: str | None = Field(
        default=None,
        max_length=64,
        description="A typed reason for the failure where it has one: ReleaseShortfall (permanent), "
        "WeightsMismatch (the refit's weights are not what they must be).",
    )
    started_at: float | None = Field(default=None, description="Agent clock, unix seconds.")
    seconds: float | None = Field(
        default=None, ge=0, description="Time spent executing, engine calls included."
    )
    engine_seconds: float | None = Field(
        default=None,
        ge=0,
        # The previous release's key, read for one release (agents of the previous image).
        validation_alias=AliasChoices("engineSeconds", "engine_seconds", "sglangSeconds"),
        description="Part of `seconds` spent waiting on engine calls and GPU memory probes.",
    )


class Refusal(WireModel):
    """409/400/401 body: why the agent refused instead of forwarding the call to the engine."""

    error: str = Field(max_length=64)
    reason: str = Field(max_length=1024)
    permanent: bool = Field(
        default=False,
        description="No retry and no new gang can change the answer (the version or a launch flag of the "
        "engine, or the spec, forbids the call): the operator fails the job with `error` as its reason, "
        "and `reason` says what to change.",
    )


class WeightsComparison(StrEnum):
    """What the served weights were held against after a refit (docs/agent.md, "Verified weights")."""

    TRAINER = "Trainer"  # the trainer's digest of what it published or pushed
    PREVIOUS = "Previous"  # the weights before the refit: new ones differ from them, a reload equals them
    COMMITTED = "Committed"  # the checksum the job recorded when it committed the version
    REPLICAS = "Replicas"  # the pod's DP replicas hold the same weights


class WeightsCheck(WireModel):
    """The agent's last look at what the engine holds (its checksum of every parameter)."""

    version: str | None = Field(
        default=None, max_length=64, description="The served version it was taken at."
    )
    checksum: WeightsChecksum | None = Field(
        default=None, description="None: the engine gave none (`unverified`)."
    )
    layout: str | None = Field(
        default=None,
        max_length=64,
        description="The engine's parallel layout, e.g. `tp1 pp1`: pods compare "
        "checksums only within one layout.",
    )
    parameters: int = Field(default=0, ge=0, description="Parameters the engine hashed (per GPU, the most).")
    checked: list[WeightsComparison] = Field(
        default_factory=list, max_length=4, description="The comparisons that ran, each of which held."
    )
    unverified: str | None = Field(
        default=None,
        max_length=1024,
        description="What was not compared and why: `weights not verified: <reason>` when no checksum was "
        "taken, else the comparisons left out.",
    )
    mismatch: str | None = Field(
        default=None,
        max_length=1024,
        description="What did not hold (the refit failed WeightsMismatch); a later check does not hold "
        "weights to these.",
    )
    checker_seconds: float | None = Field(
        default=None, ge=0, description="The engine's checksum call's wall time."
    )
    seconds: float | None = Field(
        default=None, ge=0, description="The agent's whole check, the call included."
    )


class LaunchRefusalReason(StrEnum):
    """Why the engine's launch makes the handoff fatal (each is also the job's failure reason)."""

    WEIGHT_CACHE_ACTIVE = "WeightCacheActive"
    RELEASE_FREES_NOTHING = "ReleaseFreesNothing"  # launched without the allocator a release frees through
    LIFECYCLE_ROUTES_DISABLED = "LifecycleRoutesDisabled"  # the engine serves no lifecycle route at all
    TENSOR_TRANSFER_UNCONFIGURED = "TensorTransferUnconfigured"  # a tensor refit the launch cannot take
    INSECURE_ENGINE_EXPOSED = "InsecureEngineExposed"  # it unpickles pushes and listens beyond loopback


class VersionSource(StrEnum):
    """Who labels the weights the engine serves."""

    ENGINE = "Engine"  # the engine carries the label and reports it
    AGENT = "Agent"  # the engine carries none: the agent labels what it loaded


class LaunchRefusal(WireModel):
    """A launch flag of the engine under which releasing or refitting weights is fatal: the job fails
    before any memory is touched, with `message` saying what to change."""

    reason: LaunchRefusalReason
    message: str = Field(max_length=1024)


class EngineInfo(WireModel):
    """The pod's inference engine as its agent sees it."""

    kind: EngineKind = Field(default=DEFAULT_ENGINE, description="Which engine the agent drives.")
    reachable: bool = False
    version: str | None = Field(default=None, max_length=64)
    served_version: str | None = Field(default=None, max_length=64)
    served_version_source: VersionSource = Field(
        default=VersionSource.ENGINE,
        description="Agent: the engine carries no weight version, so servedVersion is the agent's label of "
        "the weights it loaded; that the engine serves after each refit is shown by a generated token, and "
        "what it holds by `weights` where the engine can checksum them.",
    )
    model_path: str | None = Field(default=None, max_length=1024)
    paused: bool = False
    unloaded: str | None = Field(
        default=None,
        max_length=1024,
        description="Why the engine's weights cannot serve until a load completes (a load failed, or the "
        "weights came back from a release without their contents): a resume is refused meanwhile.",
    )
    weights: WeightsCheck | None = Field(
        default=None,
        description="The checksum of the weights the engine holds, taken at start and after every refit, "
        "and what it was held against.",
    )
    launch_refusal: LaunchRefusal | None = Field(
        default=None,
        description="A launch flag of the engine under which the handoff is fatal: the job fails at once.",
    )

    @model_validator(mode="before")
    @classmethod
    def _previous_release(cls, data: object) -> object:
        """An agent of the previous release reports its engine's weight cache mode instead of a refusal."""
        if not isinstance(data, dict) or "weightCacheMode" not in data:
            return data
        data = dict(data)
        mode = str(data.pop("weightCacheMode") or "off")
        if mode != "off" and "launchRefusal" not in data:
            data["launchRefusal"] = {
                "reason": LaunchRefusalReason.WEIGHT_CACHE_ACTIVE.value,
                "message": f"the engine runs with --weight-cache-mode {mode}: weight release and refit are "
                "fatal under a CUDA-IPC weight cache; restart it with --weight-cache-mode off",
            }
        return data


class MemoryReport(WireModel):
    used_before_bytes: int = Field(default=0, ge=0)
    used_after_bytes: int = Field(default=0, ge=0)
    freed_bytes: int = Field(default=0, ge=0, description="Least over the pod's GPUs.")
    gpus: int = Field(default=0, ge=0)
    verified: bool = False


class GpuScope(StrEnum):
    """How the agent knows which GPUs are its pod's (agent/gpu_scope.py)."""

    CONTAINER = "Container"  # its container sees only the pod's GPUs (a shared DRA claim): all of them
    LISTED = "Listed"  # RLJOB_GPU_UUIDS
    PROCESS = "Process"  # named in a pod process's environment (NVIDIA_VISIBLE_DEVICES=all on the agent)
    PROBE = "Probe"  # a probe plugin that sees its pod's GPUs only
    UNKNOWN = "Unknown"  # it cannot tell: release is not verified on GPUs that may be another pod's


class GpuScopeReport(WireModel):
    scope: GpuScope
    devices: list[str] = Field(default_factory=list, max_length=64, description="UUIDs or indices opened.")
    gpus: int | None = Field(default=None, ge=0, description="GPUs the probe verifies.")
    reason: str | None = Field(default=None, max_length=1024, description="Why the scope is Unknown.")


class GpuProcess(WireModel):
    """One process on a GPU of this pod, as NVML lists it (nvmlDeviceGetComputeRunningProcesses and the
    graphics list), and whose it is where the agent can tell."""

    gpu: int = Field(ge=0)
    pid: int = Field(ge=0, description="As NVML reports it: in a container usually the host's pid.")
    used_bytes: int | None = Field(
        default=None, ge=0, description="NVML's usedGpuMemory; unset where NVML cannot tell."
    )
    container: str | None = Field(
        default=None,
        max_length=253,
        description="The pod's container that runs it (its RLJOB_CONTAINER), where the agent can tell.",
    )
    not_attributable: str | None = Field(
        default=None, max_length=256, description="Why the agent cannot tell whose process it is."
    )


class GpuHeadroom(WireModel):
    """One GPU the resume takes memory back on: what it needs (margin excluded) and what is free."""

    gpu: int = Field(ge=0)
    need_bytes: int = Field(ge=0)
    free_bytes: int = Field(ge=0)


class ResumeHeadroom(WireModel):
    """The headroom gate before a resume (agent/headroom.py): a resume is sent only once every GPU of the
    pod has the bytes it takes back free, with a margin. Written by the last gated resume."""

    epoch: int = Field(ge=0, description="The command whose resume this is.")
    tags: list[ReleaseTag] = Field(default_factory=list, max_length=3)
    waiting: bool = Field(default=False, description="The resume waits for GPU memory now.")
    message: str | None = Field(
        default=None,
        max_length=1024,
        description="Who holds the memory, what the resume needs and what is free, on each GPU short of it "
        "(set while waiting, and kept when the wait ended the command).",
    )
    waited_seconds: float = Field(default=0, ge=0, description="How long this resume waited for memory.")
    gpus: list[GpuHeadroom] = Field(default_factory=list, max_length=64)
    holders: list[GpuProcess] = Field(
        default_factory=list, max_length=64, description="NVML's process list on the GPUs short of memory."
    )
    trainer_held: str | None = Field(
        default=None,
        max_length=1024,
        description="The trainer's processes that still hold GPU memory after returning the lease, at this "
        "check: named whether or not the resume had to wait.",
    )


class TrainerReport(WireModel):
    requested: bool = Field(default=False, description="The trainer asked for the GPU and waits.")
    request_epoch: int | None = Field(default=None, description="Agent epoch when the request arrived.")
    lease_held: bool = False
    published_version: WeightVersion | None = None
    published_path: str | None = Field(default=None, max_length=1024)
    published_epoch: int | None = Field(default=None, description="Grant epoch under which it was published.")
    held_seconds: float | None = Field(
        default=None,
        ge=0,
        description="The last lease as this agent timed it: from its grant to the trainer's publish (or "
        "abandon). None while it is held, and when the agent restarted while it was.",
    )
    returned_epoch: int | None = Field(
        default=None,
        description="Grant epoch under which the trainer gave the lease back without new weights (a "
        "framework's release then resume with nothing pushed): the gang serves the committed version again.",
    )
    last_refusal: str | None = Field(
        default=None,
        max_length=1024,
        description="Why the agent refused the trainer's last refused call (its framework endpoint "
        "or the SDK's routes); cleared by the trainer's next accepted handoff call (a lease request or "
        "answer, a publish, a push, a load, a resume, a window closed without an error). The operator puts "
        "it in the RLJob's status message and an Event when the trainer ends.",
    )
    refit_window_version: WeightVersion | None = Field(
        default=None, description="Set while a tensor/distributed refit window is open for this version."
    )
    weights_group: GroupState | None = Field(
        default=None,
        description="The window's weights group: Pending while the engine waits for the trainer to "
        "join (every command is refused Busy meanwhile), then Ready or Failed.",
    )
    error: str | None = Field(
        default=None,
        max_length=1024,
        description="The trainer returned the lease without publishing, and why.",
    )


class RolloutReport(WireModel):
    """Sampled from the engine's load and counters during rollout (docs/profiling.md)."""

    samples: int = Field(default=0, ge=0)
    cache_hit_rate: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="The last sample of the engine's cache hit rate: the hit ratio of its last prefill "
        "batch, not a running ratio. Unset where the engine measures no counters (`unmeasured` says why).",
    )
    generation_tokens_per_second: float | None = Field(
        default=None,
        ge=0,
        description="Mean of the engine's generation throughput over the busy samples. Unset where the "
        "engine measures no counters (`unmeasured` says why).",
    )
    utilization: float | None = Field(
        default=None,
        ge=0,
        description="Not reported: no engine sets its load utilization.",
    )
    # The signals of docs/profiling.md, measured over the rollout window: from the baseline the agent
    # takes as it opens rollout (resume) to its last sample (the drain's first step).
    window_seconds: float | None = Field(
        default=None, ge=0, description="Agent clock from the rollout's baseline to the last sample."
    )
    gpus: int = Field(default=0, ge=0, description="GPUs the agent's probe sees in this pod.")
    gpu_name: str | None = Field(default=None, max_length=128, description="The GPU probe's device name.")
    gpu_busy_fraction: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Time-weighted mean over the window and the pod's GPUs of the fraction of time a kernel "
        "ran (NVML utilization.gpu).",
    )
    prompt_tokens: int | None = Field(
        default=None, ge=0, description="Increase of the engine's prompt token counter over the window."
    )
    cached_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Increase of the engine's cached token counter over the window (every cache tier).",
    )
    generation_tokens: int | None = Field(
        default=None, ge=0, description="Increase of the engine's generation token counter over the window."
    )
    mean_running_requests: float | None = Field(
        default=None, ge=0, description="Time-weighted mean of running requests over the samples."
    )
    mean_waiting_requests: float | None = Field(
        default=None, ge=0, description="Time-weighted mean of queued (waiting) requests over the samples."
    )
    tp_size: int | None = Field(default=None, ge=1, description="The engine's tensor-parallel size.")
    completed_samples: int = Field(
        default=0, ge=0, description="Samples the trainer reported (POST /v1/trainer/rollout) this rollout."
    )
    unmeasured: list[Unmeasured] = Field(
        default_factory=list,
        max_length=MAX_UNMEASURED,
        description="The engine's signals of this report left unset, and why.",
    )


STATE_UNKNOWN = "StateUnknown"  # the prefix of `fatal` when a restarted agent cannot tell the engine's state


class RecoveryState(StrEnum):
    """What the agent knows after its own process restarted inside the pod (a native sidecar restarts
    without ending the pod). Its record (written before every non-idempotent engine call) is checked
    against what the engine reports."""

    FRESH = "Fresh"  # first start in this pod: nothing to recover
    RECOVERING = "Recovering"  # restarted; checking the record against the engine (commands wait: Busy)
    RECOVERED = "Recovered"  # the recorded state holds; the agent continues where it was
    UNSURE = "Unsure"  # a non-idempotent call's outcome is unknown: stage Failed, fatal StateUnknown


class RecoveryReport(WireModel):
    state: RecoveryState = RecoveryState.FRESH
    restarts: int = Field(default=0, ge=0, description="Times the agent process restarted in this pod.")
    detail: str | None = Field(
        default=None, max_length=1024, description="What the last recovery found, or why it is unsure."
    )


class AgentState(WireModel):
    """`GET /v1/state`: the agent's current state; the operator gets it as ChannelFrame states."""

    revision: int = Field(ge=0)
    boot_id: str = Field(max_length=64, description="Changes when the agent process restarts.")
    stage: Stage
    node_rank: int = Field(
        default=0,
        ge=0,
        description="The pod's node rank in its engine instance (RLJOB_NODE_RANK). 0 leads its instance and "
        "calls the engine; a follower (> 0) only checks its own GPUs and the engine's liveness.",
    )
    epoch: int = Field(default=0, ge=0, description="Last accepted command epoch.")
    last_command: CommandStatus | None = None
    released_tags: list[ReleaseTag] = Field(default_factory=list, max_length=3)
    memory: MemoryReport = Field(default_factory=MemoryReport)
    gpus: GpuScopeReport | None = Field(
        default=None, description="Which GPUs release verification looks at; None until the probe ran."
    )
    engine: EngineInfo = Field(
        default_factory=EngineInfo,
        # The previous release's key, read for one release (agents of the previous image, their records).
        validation_alias=AliasChoices("engine", "sglang"),
    )
    trainer: TrainerReport = Field(default_factory=TrainerReport)
    rollout: RolloutReport = Field(default_factory=RolloutReport)
    fatal: str | None = Field(
        default=None, max_length=1024, description="Set when the engine died or state is lost."
    )
    recovery: RecoveryReport = Field(default_factory=RecoveryReport)
    headroom: ResumeHeadroom | None = Field(
        default=None, description="The headroom gate of the last resume: whether it waits for GPU memory."
    )


# Which committed states the channel sends the operator (agent/reports.py applies it): facts, not conclusions.
NOT_SENT_ALONE = frozenset({"revision", "rollout"})
"""AgentState fields whose change alone is not sent (rollout samples: read once the drain finished)."""
SENT_WHILE_RUNNING = frozenset({"boot_id", "fatal", "trainer", "recovery", "headroom"})
"""While `last_command` is Running, a state is sent only when one of these changed or the stage became
Failed. Invariant: no evidence the operator checks reads another field of a report whose command runs."""


class CommandReply(WireModel):
    """On the channel (`GET /v1/channel`): the agent's answer to one command frame, the one
    `POST /v1/commands` would give: 202 accepted, 200 the same epoch and action again (a no-op), else
    refused with why. `epoch` and `action` name the command; both are absent when the frame was not one."""

    epoch: int | None = Field(default=None, ge=0)
    action: Action | None = None
    status: int = Field(ge=100, le=599, description="The HTTP status POST /v1/commands would answer.")
    command: CommandStatus | None = Field(default=None, description="Set when the command was accepted.")
    refusal: Refusal | None = Field(default=None, description="Set when it was refused.")


class ChannelFrame(WireModel):
    """`GET /v1/channel`, a WebSocket: every frame from the agent is one of these, exactly one field set.
    The operator sends Command frames (the POST /v1/commands body) on it and gets a CommandReply each; the
    agent sends the states the operator acts on (agent/reports.py) as they commit: the agent's one report
    transport, one connection per pod."""

    state: AgentState | None = None
    reply: CommandReply | None = None


# --- trainer side (loopback, wrapped by rljob.trainer) ---------------------------------------------


class WeightsDigest(WireModel):
    """The trainer's digest of the weights it published or pushed (rljob.trainer.engines): per parameter of
    the engine, the hash the engine's checksum gives for it once loaded; or why the trainer gives none."""

    parameters: dict[str, ParameterHash] = Field(default_factory=dict, max_length=MAX_DIGEST_PARAMETERS)
    unavailable: str | None = Field(
        default=None,
        max_length=1024,
        description="Why there is no digest (e.g. an architecture the SDK "
        "does not know how the engine fuses): the status says the weights were not verified against the "
        "trainer.",
    )


class PublishRequest(WireModel):
    """`POST /v1/trainer/publish`: the trainer finished its step and returns the lease."""

    version: WeightVersion
    path: str | None = Field(default=None, max_length=1024)
    digest: WeightsDigest | None = Field(
        default=None,
        description="The checkpoint's digest: the refit holds what the engine loaded against it.",
    )


class RolloutSamples(WireModel):
    """`POST /v1/trainer/rollout`: the trainer generated `samples` completed samples in this rollout
    (added to the current rollout report; send it before asking for the GPU)."""

    samples: int = Field(ge=0, le=1_000_000_000)


class TensorPush(WireModel):
    """`POST /v1/trainer/refit/tensor`: one bucket, forwarded to the engine inside the refit window, in the
    engine's form (the refit window's `engine` says which): `serializedNamedTensors` (one payload per TP
    rank) or `updateInfo` (one object: names, dtypes, shapes and IPC handles of a packed buffer)."""

    serialized_named_tensors: list[str] = Field(default_factory=list, max_length=64)
    load_format: str | None = Field(default=None, max_length=64)
    update_info: dict[str, Any] | None = Field(
        default=None,
        description="The engine's weight-transfer update for this bucket, where it takes one object instead "
        "of serialized tensors.",
    )
    last: bool = Field(
        default=False, description="The final push of the window: it carries the weight_version."
    )

    @model_validator(mode="after")
    def _one_form(self) -> TensorPush:
        if bool(self.serialized_named_tensors) == (self.update_info is not None):
            raise ValueError("give serializedNamedTensors (at least one) or updateInfo, not both")
        return self


class DistributedPush(WireModel):
    """`POST /v1/trainer/refit/distributed`: metadata of one NCCL broadcast the trainer is about to send."""

    names: list[str] = Field(min_length=1, max_length=100_000)
    dtypes: list[str] = Field(min_length=1, max_length=100_000)
    shapes: list[list[int]] = Field(min_length=1, max_length=100_000)
    group_name: str = Field(default="weight_update_group", max_length=128)
    last: bool = Field(
        default=False, description="The final push of the window: it carries the weight_version."
    )


class AbandonRequest(WireModel):
    """`POST /v1/trainer/abandon`: the trainer returns the lease without publishing (its step failed)."""

    reason: str = Field(min_length=1, max_length=1024)


class LeaseStatus(WireModel):
    """`GET /v1/trainer/lease?wait=<s>`: long-polls until the operator granted the GPU."""

    granted: bool
    epoch: int | None = Field(default=None, description="Grant epoch; publish records it as published_epoch.")


class RefitWindow(WireModel):
    """`GET /v1/trainer/refit?wait=<s>`: long-polls until a tensor/distributed refit window is open."""

    open: bool
    version: WeightVersion | None = None
    source: RefitSource | None = None
    pushes: int = Field(default=0, ge=0)
    group: GroupState | None = Field(
        default=None,
        description="State of the window's weight-update group, once the trainer asked for one; "
        "`?wait=` also waits while it is Pending.",
    )
    group_error: str | None = Field(default=None, max_length=1024, description="Why the group failed.")
    architectures: list[str] | None = Field(
        default=None,
        max_length=8,
        description="The engine's model architectures, where it says: how the SDK's digest maps the pushed "
        "tensors to the engine's parameters.",
    )
    engine: EngineKind | None = Field(
        default=None,
        description="The engine the pushes go to: which form the SDK packs them in and whose checksum its "
        "digest reproduces.",
    )


class InitWeightsGroup(WireModel):
    """`POST /v1/trainer/refit/group`: the engine joins the trainer's weights group inside a distributed
    window. The agent answers 202 at once and the engine's call runs in the background: it
    returns only after the trainer (group rank 0, hosting the rendezvous store at master_address:
    master_port) has joined, so the trainer calls its own init_process_group next and then waits for
    `group: Ready` on `GET /v1/trainer/refit?wait=`."""

    master_address: str = Field(min_length=1, max_length=256)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0, le=1_000_000)
    world_size: int = Field(ge=1, le=1_000_000)
    group_name: str = Field(default="weight_update_group", max_length=128)
    backend: str = Field(default="nccl", max_length=32)


class RefitClose(WireModel):
    """`POST /v1/trainer/refit/close`: the trainer is done pushing (or failed, with `error`)."""

    error: str | None = Field(default=None, max_length=1024)
    digest: WeightsDigest | None = Field(
        default=None,
        description="The window's pushes' digest: the refit holds what the engine holds against it.",
    )


class PushResult(WireModel):
    pushes: int = Field(ge=0, description="Pushes forwarded to the engine in this window so far.")
    message: str = Field(default="", max_length=4096)


class AgentHealth(WireModel):
    """`GET /healthz`: the agent process answers (the engine's health is in AgentState)."""

    ok: bool
    stage: Stage
    boot_id: str = Field(max_length=64)
