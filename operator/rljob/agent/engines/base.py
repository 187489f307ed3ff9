"""What the agent's core knows of an engine, whichever it is: the verbs of the handoff (stop new work,
prove it idle, release memory, resume it by part, load weights from disk, from tensors or over NCCL, label
them, flush the prefix cache, continue serving, read what it serves, its load, its counters and its
weights), the launch facts it reports, and the errors its calls raise.

Every verb is bounded: by its `timeout` or the command's Deadline. A hang raises TimeoutError, a dead engine
EngineUnreachable, an answer that says no EngineError; a verb whose failure has an engine-specific meaning
for the command raises CommandFailed itself (agent/errors.py). The policy around the verbs (their order,
the waits, release verification, the headroom gate, leases, the record, weights verification) is the
core's (agent/operations.py), once for every engine. An engine lives in its folder, agent/engines/<name>/,
and is built through the registry (agent/engines/__init__.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from rljob.api.agent import (
    AgentState,
    DistributedPush,
    DrainCommand,
    InitWeightsGroup,
    LaunchRefusal,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    TensorPush,
)
from rljob.api.spec import DrainMode, EngineKind, RefitSource, ReleaseTag

if TYPE_CHECKING:
    from aiohttp import web

    from rljob.agent.deadline import Deadline
    from rljob.agent.lease import LeaseDesk
    from rljob.agent.refit_window import RefitWindows
    from rljob.agent.state import StateStore
    from rljob.agent.weights_look import Look


class EngineUnreachable(Exception):
    """Connection refused, reset or dropped: the engine is not up yet, or it died."""


class EngineError(Exception):
    """The engine answered, with an error: an error status, or a success flag that says it failed."""

    def __init__(self, operation: str, status: int, message: str) -> None:
        super().__init__(f"{operation}: HTTP {status}: {message}")
        self.operation, self.status, self.message = operation, status, message


class EngineUnsupported(Exception):
    """The engine runs a version the agent cannot drive: the pod must be replaced with another."""


class EngineFacts(Protocol):
    """What the engine's launch and version say, read once at start; they cannot change while it runs."""

    @property
    def kind(self) -> EngineKind: ...

    @property
    def version(self) -> str: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def reports_version(self) -> bool:
        """The engine carries a label of the weights it serves and reports it (Engine.served); where it
        does not, the agent's label is the served version and a generated token after each refit, with the
        weights' checksum where the engine takes one, stands for the engine's word."""
        ...

    @property
    def weights_survive_release(self) -> bool:
        """Released weights come back as they were (a host copy), not as garbage a load must overwrite."""
        ...

    @property
    def tag_bytes(self) -> tuple[tuple[str, int], ...]:
        """Per GPU, the bytes each memory part takes as the engine reports them (the headroom gate's split
        of one release between the resumes that follow it); a part it does not report is absent."""
        ...

    @property
    def quantization(self) -> str | None:
        """The engine's quantization of the weights: its checksums are then of dequantized weights."""
        ...

    @property
    def launch_refusal(self) -> LaunchRefusal | None:
        """A launch flag that makes the handoff fatal: the job fails before any memory is touched."""
        ...

    @property
    def keep_weights_hint(self) -> str:
        """What to change so that released weights survive: how to launch the engine with a host copy."""
        ...


@dataclass(frozen=True)
class Served:
    """What the engine says it serves."""

    version: str | None  # the weights' label; None where the engine carries none
    model_path: str | None


@dataclass(frozen=True)
class Discovery:
    """What the engine reported once it answered at start."""

    facts: EngineFacts
    served: Served
    architectures: tuple[str, ...]  # the model's, where the engine says (the SDK's digest reads them)


@dataclass(frozen=True)
class LoadSample:
    """The engine's load over its DP ranks (counts summed, the cache hit rate averaged); None where it does
    not report the figure."""

    running: float | None = None
    waiting: float | None = None
    cache_hit_rate: float | None = None  # of its last prefill batch, not a running ratio
    gen_throughput: float | None = None


class Counter(StrEnum):
    """The engine's cumulative token counters the rollout report reads (named as RolloutReport's fields)."""

    PROMPT_TOKENS = "prompt_tokens"
    CACHED_TOKENS = "cached_tokens"
    GENERATION_TOKENS = "generation_tokens"


class EngineGuards(Protocol):
    """What the engine's version and launch forbid: pure functions of the agent's state and the engine's
    facts, each raising Refused (agent/errors.py; `forbidden_by_launch` where no retry can change it). A
    refusal means nothing was sent. The core's own refusals (the stage order, its record) come first."""

    def leader_ready(self, state: AgentState, facts: EngineFacts) -> None:
        """Whatever the command: refused while the engine can take no command at all."""
        ...

    def drain(self, cmd: DrainCommand, state: AgentState, facts: EngineFacts) -> None: ...

    def release(self, cmd: ReleaseCommand, state: AgentState, facts: EngineFacts) -> None: ...

    def refit(self, cmd: RefitCommand, state: AgentState, facts: EngineFacts) -> None: ...

    def resume(self, cmd: ResumeCommand, state: AgentState, facts: EngineFacts) -> None: ...

    def tensor_push(self, push: TensorPush, facts: EngineFacts | None = None) -> int:
        """A tensor push the engine would die on or misread; the bytes it carries."""
        ...

    def weights_group(self, facts: EngineFacts | None) -> None:
        """A weights group the engine cannot join."""
        ...

    def distributed_push(self, push: DistributedPush, formed: set[str], facts: EngineFacts | None) -> None:
        """A broadcast the engine would die on; `formed`: the groups it joined through this agent."""
        ...


class Engine(Protocol):
    """One engine process in the pod, driven by the agent's core through the handoff's verbs."""

    @property
    def kind(self) -> EngineKind: ...

    @property
    def name(self) -> str:
        """How messages name the engine."""
        ...

    @property
    def facts(self) -> EngineFacts | None:
        """Set once `discover` answered."""
        ...

    @property
    def resume_order(self) -> tuple[ReleaseTag, ...]:
        """The memory parts in the order they come back: a refit resumes all but the last, the resume the
        last."""
        ...

    @property
    def guards(self) -> EngineGuards: ...

    @property
    def failed_load_poisons(self) -> bool:
        """A load that fails leaves weights the engine cannot serve until a load completes (the core then
        refuses a resume: EngineInfo.unloaded)."""
        ...

    @property
    def metrics_off(self) -> str:
        """Why the load's rates are no measurement when `read_counters` says the engine measures none."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    # --- presence ------------------------------------------------------------------------------------

    async def discover(self, timeout: float) -> Discovery:
        """The launch facts and what it serves. EngineUnreachable or TimeoutError: not up yet; EngineError,
        KeyError or ValueError: up, but not identified yet; EngineUnsupported: a version it cannot drive."""
        ...

    async def liveness(self, timeout: float = 5.0) -> int:
        """The HTTP status of its liveness route (any answer: alive, paused included)."""
        ...

    @property
    def needs_hang_check(self) -> bool:
        """The engine's HTTP server may outlive a dead engine: `hang_check` tells."""
        ...

    async def hang_check(self) -> str | None:
        """Why the engine is dead although its HTTP server answers, or None."""
        ...

    def call_name(self, call: str) -> str:
        """How the engine names a non-idempotent call of the record (agent/record.py Intent.call)."""
        ...

    # --- stop new work --------------------------------------------------------------------------------

    async def stop_new_work(self, mode: DrainMode, dl: Deadline) -> None:
        """Stop new work: the requests in flight end as `mode` says (abort, or retract to its queue)."""
        ...

    async def prove_idle(self, dl: Deadline, what: str, paused_by: DrainMode | None) -> None:
        """Returns once the engine is idle by what its release asserts (CommandFailed at the deadline)."""
        ...

    # --- release and resume by part -------------------------------------------------------------------

    async def release(self, parts: Sequence[ReleaseTag], timeout: float) -> None: ...

    async def resume(self, parts: Sequence[ReleaseTag], timeout: float) -> None: ...

    # --- load weights ---------------------------------------------------------------------------------

    async def load_from_disk(self, path: str, version: str, timeout: float) -> bool:
        """Load `path` as `version`; True when the load carried the version label with it."""
        ...

    async def open_weight_update(self, dl: Deadline) -> None:
        """Before a window's pushes, where the engine brackets them."""
        ...

    async def close_weight_update(self, timeout: float) -> None:
        """After a window's pushes (its error or timeout fails the refit)."""
        ...

    async def push_tensors(self, push: TensorPush, version: str | None, timeout: float) -> str:
        """One bucket of the trainer's tensors; `version` on the final push. The engine's message."""
        ...

    async def join_weights_group(self, group: InitWeightsGroup, timeout: float) -> str:
        """Join the trainer's weight-update group: answers once every rank joined."""
        ...

    async def push_distributed(self, push: DistributedPush, version: str | None, timeout: float) -> str:
        """One broadcast of the trainer's tensors over the group; `version` on the final push."""
        ...

    async def label_weights(self, version: str, timeout: float, *, carried: bool) -> None:
        """Make the engine serve its weights as `version`; `carried`: the load or final push carried it."""
        ...

    # --- flush and continue ---------------------------------------------------------------------------

    async def flush_prefix_cache(self, dl: Deadline, paused_by: DrainMode | None) -> None:
        """Until the prefix cache is flushed (its entries are of the old weights), or CommandFailed."""
        ...

    async def continue_serving(self, dl: Deadline, on_continued: Callable[[], None]) -> Served:
        """Serve again, and prove it: a token generated. `on_continued` runs once the engine took the
        call; returns what it serves. The last resume may already have made it serve again (an engine that
        schedules once nothing is released): then only the proof is left."""
        ...

    # --- read what it serves --------------------------------------------------------------------------

    async def served(self, timeout: float) -> Served: ...

    async def read_load(self, timeout: float = 5.0) -> LoadSample: ...

    async def read_counters(self, timeout: float = 5.0) -> dict[Counter, float] | None:
        """The cumulative token counters; None when the engine measures none (`metrics_off` says why)."""
        ...

    async def read_weights(self, weights_released: bool, timeout: float) -> Look:
        """A checksum of every parameter it holds, timed; or why none can be taken. EngineUnreachable
        propagates (the engine is gone)."""
        ...

    # --- plumbing -------------------------------------------------------------------------------------

    async def get_json(self, operation: str, path: str, timeout: float = 5.0) -> Any:
        """A GET on the engine's port for a plugin of the agent (a GPU probe that reads through it)."""
        ...

    def framework_endpoint(
        self, store: StateStore, lease: LeaseDesk, windows: RefitWindows, refit_source: RefitSource | None
    ) -> web.Application:
        """The endpoint a framework is pointed at instead of the engine (on the pod's loopback): its
        lifecycle calls become the RLJob handoff, the rest passes through to the engine."""
        ...
