"""The lifecycle decision: (spec, status, observation) -> Decision. Pure: no I/O, no clock, no kopf.

One switch over the phase. Each lock-step phase sends one command per pod, stamped with the epoch,
and advances only when every pod's agent reports that epoch's command Succeeded. A stale, duplicated
or reordered report can only make the machine resend the same epoch (a no-op at the agent), never
advance: advancing needs a truthful report of that very epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rljob.api.agent import (
    Action,
    AgentState,
    Command,
    CommandState,
    DrainCommand,
    GrantCommand,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    Stage,
)
from rljob.api.spec import PodsAfterFinished, RLJobSpec
from rljob.api.status import (
    MAX_PODS_IN_STATUS,
    MAX_TIMELINE,
    MAX_WEIGHT_HISTORY,
    CommittedWeights,
    ConditionType,
    Phase,
    PhaseSpan,
    PodStatus,
    RLJobStatus,
)
from rljob.lifecycle.clock import parse, seconds_between, stamp
from rljob.lifecycle.conditions import refresh_phase_conditions, set_condition
from rljob.lifecycle.model import (
    Decision,
    Event,
    EventReason,
    EventType,
    Observation,
    PodCommand,
    PodObservation,
)
from rljob.lifecycle.profile import iteration_report, profile
from rljob.lifecycle.versions import is_newer

# Which command each lock-step phase sends.
PHASE_ACTION: dict[Phase, Action] = {
    Phase.DRAINING: Action.DRAIN,
    Phase.RELEASING: Action.RELEASE,
    Phase.TRAINING: Action.GRANT,
    Phase.REFITTING: Action.REFIT,
    Phase.RESUMING: Action.RESUME,
    Phase.SUSPENDING: Action.DRAIN,
}


@dataclass
class _Step:
    """Mutable scratch for one decision; frozen into a Decision at the end."""

    spec: RLJobSpec
    status: RLJobStatus
    obs: Observation
    commands: list[PodCommand] = field(default_factory=list)
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False

    @property
    def now(self) -> str:
        return stamp(self.obs.now)

    def event(self, reason: EventReason, message: str, warning: bool = False) -> None:
        self.events.append(Event(reason, message, EventType.WARNING if warning else EventType.NORMAL))

    # --- the gang ---------------------------------------------------------------------------------

    def gang(self) -> dict[int, PodObservation]:
        """Pods of the current gang generation, by index."""
        return {
            p.index: p
            for p in self.obs.pods
            if p.gang == self.status.restarts and 0 <= p.index < self.spec.replicas
        }

    def agent(self, pod: PodObservation) -> AgentState | None:
        return self.obs.agents.get(pod.name)

    def lost_member(self) -> str | None:
        """Why the gang is broken, or None. A gang member that lost its process state can't rejoin a
        lock-step iteration: its SGLang memory or trainer state is gone."""
        gang = self.gang()
        for index in range(self.spec.replicas):
            pod = gang.get(index)
            if pod is None:
                return f"pod #{index} of the gang is missing"
            if pod.deleting:
                return f"pod {pod.name} is being deleted"
            if pod.phase in ("Failed", "Succeeded"):
                return f"pod {pod.name} is {pod.phase}"
            if pod.broken:
                return f"pod {pod.name}: {pod.broken}"
            agent = self.agent(pod)
            if agent is not None and (agent.fatal or agent.stage == Stage.FAILED):
                return f"pod {pod.name}: {agent.fatal or 'agent reports Failed'}"
        return None

    # --- status helpers ---------------------------------------------------------------------------

    def committed(self) -> CommittedWeights:
        if self.status.weight_history:
            return self.status.weight_history[-1]
        return CommittedWeights(
            version=self.spec.weights.initial_version, path=self.spec.weights.initial_path, iteration=0
        )

    def enter(self, phase: Phase, reason: EventReason | None = None, message: str | None = None) -> None:
        """The one place a phase changes: closes the timeline span, bumps the epoch, emits the event."""
        st = self.status
        old = st.phase
        self.close_span()
        st.phase = phase
        if phase in PHASE_ACTION:  # a new lock-step: new idempotency key
            st.epoch += 1
        st.phase_start_time = self.now
        st.reason = (reason or EventReason.PHASE_CHANGED).value
        st.message = message or f"{old.value} -> {phase.value}"
        if phase in PHASE_ACTION or phase == Phase.ROLLOUT:
            st.timeline.append(PhaseSpan(phase=phase, iteration=st.iteration, start_time=self.now))
            del st.timeline[:-MAX_TIMELINE]
        self._refresh_pods()
        warn = phase in (Phase.FAILED, Phase.RECOVERING)
        self.event(reason or EventReason.PHASE_CHANGED, st.message, warning=warn)

    def close_span(self) -> None:
        st = self.status
        if not st.timeline or st.timeline[-1].seconds is not None:
            return
        span = st.timeline[-1]
        if span.phase != st.phase:
            return
        span.seconds = round(seconds_between(span.start_time, self.obs.now), 6)
        agents = [a for a in (self.agent(p) for p in self.gang().values()) if a is not None]
        action = PHASE_ACTION.get(st.phase)
        if action is not None:
            own = [
                a.last_command.seconds
                for a in agents
                if a.last_command is not None
                and a.last_command.epoch == st.epoch
                and a.last_command.action == action
                and a.last_command.seconds is not None
            ]
            span.agent_seconds = round(max(own), 6) if own else None
        if st.phase == Phase.RELEASING:
            span.freed_bytes = sum(a.memory.freed_bytes for a in agents)
        if st.phase in (Phase.ROLLOUT, Phase.DRAINING):
            # The agent takes its last rollout sample as the drain starts: read the numbers at the end of
            # Draining too, and keep them on this iteration's Rollout span.
            rollout = next(
                (
                    s
                    for s in reversed(st.timeline)
                    if s.phase == Phase.ROLLOUT and s.iteration == st.iteration
                ),
                None,
            )
            rates = [a.rollout.cache_hit_rate for a in agents if a.rollout.cache_hit_rate is not None]
            tps = [
                a.rollout.generation_tokens_per_second
                for a in agents
                if a.rollout.generation_tokens_per_second is not None
            ]
            if rollout is not None and rates:
                rollout.cache_hit_rate = round(sum(rates) / len(rates), 6)
            if rollout is not None and tps:
                rollout.tokens_per_second = round(sum(tps), 3)

    def _refresh_pods(self) -> None:
        """Per-pod entries are refreshed at phase changes only: status writes per iteration stay
        constant whatever the number of pods."""
        entries = []
        for _, pod in sorted(self.gang().items())[:MAX_PODS_IN_STATUS]:
            agent = self.agent(pod)
            entry = PodStatus(name=pod.name, stage="Unreachable" if agent is None else agent.stage.value)
            if agent is not None:
                entry.weight_version = agent.sglang.served_version
                entry.released_tags = list(agent.released_tags)
                entry.freed_bytes = agent.memory.freed_bytes
                failed = agent.last_command and agent.last_command.state == CommandState.FAILED
                entry.last_error = agent.fatal or (
                    agent.last_command.error if failed and agent.last_command else None
                )
            if pod.broken:
                entry.last_error = pod.broken
            entries.append(entry)
        self.status.pods = entries

    # --- effects ----------------------------------------------------------------------------------

    def send(self, pod: PodObservation, command: Command) -> None:
        self.commands.append(PodCommand(pod.name, command))

    def delete_all_pods(self) -> bool:
        """Ask for every pod to go; True once none is left."""
        for pod in self.obs.pods:
            if not pod.deleting:
                self.delete.append(pod.name)
        return not self.obs.pods

    def freeze(self) -> Decision:
        return Decision(
            status=self.status,
            commands=tuple(self.commands),
            create_pods=tuple(self.create),
            delete_pods=tuple(dict.fromkeys(self.delete)),
            events=tuple(self.events),
            delete_job=self.delete_job,
        )


def decide(spec: RLJobSpec, status: RLJobStatus, obs: Observation) -> Decision:
    step = _Step(spec=spec, status=status.model_copy(deep=True), obs=obs)
    st = step.status
    if st.start_time is None:
        st.start_time = step.now
        st.phase_start_time = step.now
    if obs.generation is not None:
        st.observed_generation = obs.generation
    st.replicas = spec.replicas
    st.ready_replicas = sum(1 for p in step.gang().values() if p.running and p.ready)
    st.ready = f"{st.ready_replicas}/{spec.replicas}"

    if st.phase.terminal:
        _finished(step)
    elif _deadline_exceeded(step):
        pass
    else:
        for pod in obs.pods:  # leftovers of an earlier gang never rejoin
            if pod.gang != st.restarts or pod.index >= spec.replicas:
                step.delete.append(pod.name)
        entered = (st.phase, st.epoch)
        HANDLERS[st.phase](step)
        if (st.phase, st.epoch) != entered and st.phase in PHASE_ACTION:
            _drive(step)  # a new lock-step phase sends its commands in the same decision
    refresh_phase_conditions(st, step.now)
    return step.freeze()


# --- phase handlers ----------------------------------------------------------------------------------


def _pending(step: _Step) -> None:
    if step.spec.suspend:
        step.enter(Phase.SUSPENDING, EventReason.SUSPENDED, "suspend requested before start")
        return
    if _timed_out(step, step.spec.phase_timeout_seconds.initializing):
        return
    gang = step.gang()
    broken = [p for p in gang.values() if p.broken or p.phase in ("Failed", "Succeeded")]
    if broken:
        _recover(step, f"pod {broken[0].name}: {broken[0].broken or broken[0].phase}")
        return
    missing = [i for i in range(step.spec.replicas) if i not in gang]
    if missing:
        step.create.extend(missing)
        step.event(EventReason.PODS_CREATED, f"creating {len(missing)} pod(s) of gang {step.status.restarts}")
        return
    if all(p.running for p in gang.values()):
        step.enter(Phase.INITIALIZING)


def _initializing(step: _Step) -> None:
    if step.spec.suspend:
        step.enter(Phase.SUSPENDING, EventReason.SUSPENDED, "suspend requested")
        return
    lost = step.lost_member()
    if lost:
        _recover(step, lost)
        return
    if _timed_out(step, step.spec.phase_timeout_seconds.initializing):
        return
    agents = [step.agent(p) for p in step.gang().values()]
    if any(a is None or not a.sglang.reachable or a.stage == Stage.STARTING for a in agents):
        return
    ready = [a for a in agents if a is not None]
    cached = [a for a in ready if a.sglang.weight_cache_mode not in ("", "off")]
    if cached:
        # Refused before any memory is touched: every weight release, resume and refit would kill SGLang.
        _fail(
            step,
            EventReason.WEIGHT_CACHE_ACTIVE,
            f"SGLang runs with --weight-cache-mode {cached[0].sglang.weight_cache_mode}: weight release and "
            "refit are fatal under a CUDA-IPC weight cache; restart SGLang with --weight-cache-mode off",
        )
        return
    if any(a.stage != Stage.READY for a in ready):
        return
    committed = step.committed()
    st = step.status
    st.iteration = max(st.iteration, 1)
    st.target_weights = committed
    if all(a.sglang.served_version == committed.version for a in ready):
        # Already serving the committed weights: verify and open rollout.
        step.enter(Phase.RESUMING, EventReason.PHASE_CHANGED, f"every pod serves {committed.version}")
        return
    if committed.path is None and step.spec.refit.source.value == "disk":
        served = sorted({str(a.sglang.served_version) for a in ready})
        _fail(
            step,
            EventReason.INITIAL_VERSION_MISMATCH,
            f"pods serve weight version {', '.join(served)} but the job is at {committed.version} and has "
            "no path to load it from (set spec.weights.initialPath, or launch SGLang with --weight-version)",
        )
        return
    # Rejoin: a fresh gang loads the last committed weights before rollout opens.
    step.enter(Phase.REFITTING, EventReason.PHASE_CHANGED, f"loading committed weights {committed.version}")


def _rollout(step: _Step) -> None:
    lost = step.lost_member()
    if lost:
        _recover(step, lost)
        return
    if step.spec.suspend:
        step.enter(Phase.SUSPENDING, EventReason.SUSPENDED, "suspend requested during rollout")
        return
    if _timed_out(step, step.spec.phase_timeout_seconds.rollout):
        return
    epoch = step.status.epoch
    for pod in step.gang().values():
        agent = step.agent(pod)
        # A request counts only from a report that already saw this rollout's resume: an older report
        # may carry the previous iteration's request (the agent clears it at grant).
        if agent is None or not agent.trainer.requested or agent.epoch != epoch:
            return
    step.enter(Phase.DRAINING, EventReason.PHASE_CHANGED, "every trainer asked for the GPU")


def _lock_step(step: _Step) -> None:
    """Draining, Releasing, Training, Refitting, Resuming: one command per pod, wait for all."""
    st = step.status
    lost = step.lost_member()
    if lost:
        _recover(step, lost)
        return
    timeouts = step.spec.phase_timeout_seconds
    limit = {
        Phase.DRAINING: timeouts.draining,
        Phase.RELEASING: timeouts.releasing,
        Phase.TRAINING: timeouts.training,
        Phase.REFITTING: timeouts.refitting,
        Phase.RESUMING: timeouts.resuming,
    }[st.phase]
    if _timed_out(step, limit):
        return
    done = _drive(step)
    if done is None:
        return
    if st.phase == Phase.DRAINING:
        step.enter(Phase.RELEASING)
    elif st.phase == Phase.RELEASING:
        step.enter(Phase.TRAINING, EventReason.PHASE_CHANGED, "memory freed and verified on every pod")
    elif st.phase == Phase.TRAINING:
        _trained(step, done)
    elif st.phase == Phase.REFITTING:
        step.enter(Phase.RESUMING)
    elif st.phase == Phase.RESUMING:
        _resumed(step)


def _drive(step: _Step) -> list[AgentState] | None:
    """Send this phase's command to every pod that hasn't accepted this epoch; return the agents' states
    when every pod finished it (and, in Training, published), None while waiting."""
    st = step.status
    action = PHASE_ACTION[st.phase]
    finished: list[AgentState] = []
    waiting = False
    for pod in sorted(step.gang().values(), key=lambda p: p.index):
        agent = step.agent(pod)
        if agent is None or not pod.running:
            waiting = True
            continue
        cmd = agent.last_command
        if agent.epoch < st.epoch or cmd is None or cmd.epoch < st.epoch:
            step.send(pod, _command(step, pod, agent))
            waiting = True
            continue
        if cmd.epoch > st.epoch or cmd.action != action:
            # The agent is ahead of our status: our status was rolled back. Never guess: restart the gang.
            _recover(
                step, f"pod {pod.name} reports epoch {cmd.epoch} ({cmd.action.value}), job is at {st.epoch}"
            )
            return None
        if cmd.state == CommandState.RUNNING:
            waiting = True
        elif cmd.state == CommandState.FAILED:
            if st.phase == Phase.SUSPENDING:  # the pods are going away anyway
                finished.append(agent)
                continue
            step.event(
                EventReason.COMMAND_FAILED, f"{pod.name}: {action.value}@{st.epoch}: {cmd.error}", True
            )
            _recover(step, f"{action.value} failed on {pod.name}: {cmd.error}")
            return None
        elif not _step_complete(step, agent):
            waiting = True
        else:
            finished.append(agent)
    return None if waiting else finished


def _step_complete(step: _Step, agent: AgentState) -> bool:
    """Beyond 'the command succeeded': the evidence each phase needs from the agent."""
    st = step.status
    if st.phase == Phase.RELEASING:
        return agent.memory.verified  # invariant 3: no lease before freed memory is verified
    if st.phase == Phase.TRAINING:
        return agent.trainer.published_epoch == st.epoch and agent.trainer.published_version is not None
    target = st.target_weights.version if st.target_weights else None
    if st.phase == Phase.REFITTING:
        return agent.sglang.served_version == target
    if st.phase == Phase.RESUMING:  # invariant 4: rollout reopens only on the verified version
        return agent.stage == Stage.SERVING and agent.sglang.served_version == target
    return True


def _command(step: _Step, pod: PodObservation, agent: AgentState) -> Command:
    spec, st = step.spec, step.status
    epoch = st.epoch
    phase = st.phase
    if phase in (Phase.DRAINING, Phase.SUSPENDING):
        return DrainCommand(
            epoch=epoch, mode=spec.rollout.drain.mode, timeout_seconds=spec.rollout.drain.timeout_seconds
        )
    if phase == Phase.RELEASING:
        return ReleaseCommand(epoch=epoch, tags=list(spec.release.tags), verify=spec.release.verify)
    if phase == Phase.TRAINING:
        return GrantCommand(epoch=epoch)
    if phase == Phase.REFITTING:
        target = st.target_weights
        assert target is not None
        # After training each pod loads what its own trainer published; a rejoin loads the committed path.
        rejoin = target.version == step.committed().version
        path = target.path if rejoin else (agent.trainer.published_path or target.path)
        return RefitCommand(
            epoch=epoch,
            version=target.version,
            path=path,
            source=spec.refit.source,
            timeout_seconds=spec.refit.timeout_seconds,
        )
    return ResumeCommand(epoch=epoch, timeout_seconds=float(spec.phase_timeout_seconds.resuming or 300))


def _trained(step: _Step, agents: list[AgentState]) -> None:
    versions = sorted({str(a.trainer.published_version) for a in agents})
    if len(versions) != 1:
        _fail(
            step, EventReason.TRAINER_VERSION_MISMATCH, f"trainers published different versions: {versions}"
        )
        return
    version = versions[0]
    history = [w.version for w in step.status.weight_history] + [step.committed().version]
    if not is_newer(version, history):
        _fail(
            step,
            EventReason.VERSION_NOT_NEWER,
            f"trainers published version {version}, not newer than committed {step.committed().version}",
        )
        return
    step.status.target_weights = CommittedWeights(
        version=version, path=agents[0].trainer.published_path, iteration=step.status.iteration
    )
    step.enter(Phase.REFITTING, EventReason.PHASE_CHANGED, f"every trainer published {version}")


def _resumed(step: _Step) -> None:
    st = step.status
    target = st.target_weights
    assert target is not None
    rejoin = target.version == step.committed().version
    _commit(step, target)
    st.target_weights = None
    if rejoin:
        step.enter(
            Phase.ROLLOUT,
            EventReason.PHASE_CHANGED,
            f"rollout of iteration {st.iteration} open at {target.version}",
        )
        return
    step.close_span()  # fold the Resuming span into this iteration's report
    report = iteration_report(st.iteration, st.timeline)
    st.last_iteration = report
    st.profile = profile(report) or st.profile
    set_condition(
        st,
        ConditionType.DEGRADED,
        False,
        "IterationCompleted",
        f"iteration {st.iteration} completed",
        step.now,
    )
    if step.spec.iterations is not None and st.iteration >= step.spec.iterations:
        st.completion_time = step.now
        step.enter(
            Phase.SUCCEEDED,
            EventReason.COMPLETED,
            f"{st.iteration} iterations done, serving weights {target.version}",
        )
        return
    st.iteration += 1
    step.enter(
        Phase.ROLLOUT,
        EventReason.PHASE_CHANGED,
        f"rollout of iteration {st.iteration} open at {target.version}",
    )


def _commit(step: _Step, weights: CommittedWeights) -> None:
    """Invariant 6: weightVersion is written only here, after every pod served it, and never repeats."""
    st = step.status
    if st.weight_version == weights.version:
        return
    entry = weights.model_copy(update={"committed_at": step.now})
    st.weight_version = weights.version
    st.weight_history = ([*st.weight_history, entry])[-MAX_WEIGHT_HISTORY:]
    step.event(EventReason.WEIGHTS_COMMITTED, f"weights {weights.version} served and verified on every pod")


def _suspending(step: _Step) -> None:
    st = step.status
    timed_out = (limit := step.spec.phase_timeout_seconds.draining) is not None and seconds_between(
        st.phase_start_time, step.obs.now
    ) > limit
    if step.lost_member() is None and not timed_out and step.gang() and _drive(step) is None:
        return  # drain first, so in-flight requests end cleanly before their pods go
    if step.delete_all_pods():
        step.enter(Phase.SUSPENDED, EventReason.SUSPENDED, f"suspended at weights {st.weight_version}")
    elif not step.events or step.events[-1].reason != EventReason.PODS_DELETED:
        step.event(EventReason.PODS_DELETED, "deleting the gang to suspend")


def _suspended(step: _Step) -> None:
    if step.delete_all_pods() and not step.spec.suspend:
        step.enter(
            Phase.PENDING, EventReason.RESUMED, f"resuming at committed weights {step.committed().version}"
        )


def _recovering(step: _Step) -> None:
    if step.delete_all_pods():
        step.enter(Phase.PENDING, EventReason.PHASE_CHANGED, f"recreating gang {step.status.restarts}")


def _recover(step: _Step, why: str) -> None:
    """A member is lost: the whole gang restarts at the committed weights. Partial rejoin would pair a
    fresh trainer rank with survivors mid-step, which no collective can take."""
    st = step.status
    step.event(EventReason.GANG_MEMBER_LOST, why, warning=True)
    set_condition(st, ConditionType.DEGRADED, True, EventReason.GANG_MEMBER_LOST.value, why, step.now)
    if st.restarts >= step.spec.backoff_limit:
        _fail(
            step,
            EventReason.BACKOFF_LIMIT_EXCEEDED,
            f"{why}; backoffLimit {step.spec.backoff_limit} reached after {st.restarts} restart(s)",
        )
        return
    st.restarts += 1
    st.target_weights = None
    step.enter(Phase.RECOVERING, EventReason.GANG_MEMBER_LOST, why)
    step.delete_all_pods()


def _fail(step: _Step, reason: EventReason, message: str) -> None:
    st = step.status
    st.completion_time = step.now
    step.enter(Phase.FAILED, reason, message)
    _finished(step)


def _timed_out(step: _Step, limit: int | None) -> bool:
    st = step.status
    if limit is None or seconds_between(st.phase_start_time, step.obs.now) <= limit:
        return False
    why = f"phase {st.phase.value} exceeded {limit}s"
    step.event(EventReason.PHASE_TIMEOUT, why, warning=True)
    set_condition(st, ConditionType.DEGRADED, True, EventReason.PHASE_TIMEOUT.value, why, step.now)
    _recover(step, why)
    return True


def _deadline_exceeded(step: _Step) -> bool:
    limit = step.spec.active_deadline_seconds
    if limit is None or seconds_between(step.status.start_time, step.obs.now) <= limit:
        return False
    _fail(step, EventReason.DEADLINE_EXCEEDED, f"activeDeadlineSeconds {limit} exceeded")
    return True


def _finished(step: _Step) -> None:
    """Terminal phases are sticky; only cleanup and TTL happen here."""
    st = step.status
    failed = st.phase == Phase.FAILED
    if failed or step.spec.pods_after_finished == PodsAfterFinished.DELETE:
        step.delete_all_pods()
    ttl = step.spec.ttl_seconds_after_finished
    done = parse(st.completion_time)
    if ttl is not None and done is not None and (step.obs.now - done).total_seconds() >= ttl:
        step.delete_job = True


HANDLERS: dict[Phase, Callable[[_Step], None]] = {
    Phase.PENDING: _pending,
    Phase.INITIALIZING: _initializing,
    Phase.ROLLOUT: _rollout,
    Phase.DRAINING: _lock_step,
    Phase.RELEASING: _lock_step,
    Phase.TRAINING: _lock_step,
    Phase.REFITTING: _lock_step,
    Phase.RESUMING: _lock_step,
    Phase.RECOVERING: _recovering,
    Phase.SUSPENDING: _suspending,
    Phase.SUSPENDED: _suspended,
}
