"""The lifecycle decision: (spec, status, observation) -> Decision. Pure: no I/O, no clock, no kopf.

One switch over the phase. The lock-step phases are rows of LOCK_STEPS, one row each: the command it
sends to every pod, stamped with the epoch, how long it may take, the evidence each pod must show, and
where the job goes once every pod showed it. A stale, duplicated or reordered report can only make the
machine resend the same epoch (a no-op at the agent), never advance: advancing needs a truthful report
of that very epoch. The other phases (Pending, Initializing, Rollout, Recovering, Suspended and the
terminal ones) have one handler each in HANDLERS.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from enum import StrEnum

from rljob.api.agent import (
    Action,
    AgentState,
    Command,
    CommandState,
    CommandStatus,
    DrainCommand,
    GrantCommand,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    Stage,
)
from rljob.api.spec import PhaseTimeouts, PodsAfterFinished, RLJobSpec
from rljob.api.status import (
    MAX_MESSAGE,
    MAX_WEIGHT_HISTORY,
    CommittedWeights,
    ConditionStatus,
    ConditionType,
    Phase,
    PhaseSpan,
    RLJobStatus,
)
from rljob.lifecycle import timeline
from rljob.lifecycle.clock import parse, stamp
from rljob.lifecycle.conditions import refresh_phase_conditions, set_condition
from rljob.lifecycle.model import (
    Admission,
    AgentRefusal,
    Awaited,
    Decision,
    Event,
    EventReason,
    EventType,
    Evidence,
    Observation,
    PodCommand,
    PodObservation,
)
from rljob.lifecycle.profile import record_iteration
from rljob.lifecycle.versions import is_newer


@dataclass
class _Step:
    """Mutable scratch for one decision; frozen into a Decision at the end."""

    job_spec: RLJobSpec | None  # None only when the spec could not be parsed (obs.spec_error says why)
    status: RLJobStatus
    obs: Observation
    commands: list[PodCommand] = field(default_factory=list)
    create: list[int] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    delete_job: bool = False
    awaiting: list[Awaited] = field(default_factory=list)
    next_due: datetime | None = None
    _gang: tuple[tuple[int, int], dict[int, PodObservation]] | None = field(
        default=None, init=False, repr=False
    )

    def passed(self, since: str | None, seconds: float | None, reached: bool = False) -> bool:
        """Whether more than `seconds` passed since `since` (a status stamp; with `reached`, at least
        `seconds`); when not yet, the moment it will is a time this decision depends on
        (Decision.next_due). No limit or no start: never."""
        began = parse(since)
        if seconds is None or began is None:
            return False
        at = began + timedelta(seconds=seconds)
        if self.obs.now > at or (reached and self.obs.now == at):
            return True
        self.next_due = at if self.next_due is None else min(self.next_due, at)
        return False

    @property
    def spec(self) -> RLJobSpec:
        """The parsed spec; every path but the InvalidSpec one has it."""
        assert self.job_spec is not None, "the InvalidSpec path must not read the spec"
        return self.job_spec

    @property
    def now(self) -> str:
        return stamp(self.obs.now)

    def event(self, reason: EventReason, message: str, warning: bool = False) -> None:
        self.events.append(Event(reason, message, EventType.WARNING if warning else EventType.NORMAL))

    # --- the gang ---------------------------------------------------------------------------------

    def gang(self) -> dict[int, PodObservation]:
        """Pods of the current gang generation, by index (status.replicas is the spec's replicas, or the
        last known ones when the spec could not be parsed). Kept while the generation and the replicas
        stay: a decision asks several times, each a pass over every pod. Not to be changed."""
        key = (self.status.restarts, self.status.replicas)
        if self._gang is None or self._gang[0] != key:
            gang = {p.index: p for p in self.obs.pods if p.gang == key[0] and 0 <= p.index < key[1]}
            self._gang = (key, gang)
        return self._gang[1]

    def agent(self, pod: PodObservation) -> AgentState | None:
        return self.obs.agents.get(pod.name)

    def role(self, pod: PodObservation) -> Role:
        return role_of(pod.index, self.spec.rollout.pods_per_instance)

    def leaders(self) -> list[AgentState | None]:
        """The latest report of every instance leader of the gang (None: not reported yet)."""
        return [self.agent(p) for p in self.gang().values() if self.role(p) == Role.LEADER]

    def gang_agents(self) -> list[AgentState]:
        """The latest report of every gang member that has one."""
        return [a for a in (self.agent(p) for p in self.gang().values()) if a is not None]

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

    # --- the queue --------------------------------------------------------------------------------

    def held(self) -> bool:
        """A queue holds the job back: no quota yet, or it takes the quota back. No pod may be created;
        running pods drain and go (at the next rollout: the iteration in flight commits first)."""
        return self.obs.admission in (Admission.PENDING, Admission.EVICTED)

    def queue_reason(self) -> tuple[EventReason, str]:
        evicted = self.obs.admission == Admission.EVICTED
        reason = EventReason.EVICTED if evicted else EventReason.WAITING_FOR_QUOTA
        return reason, self.obs.admission_message or (
            "evicted by its queue" if evicted else "waiting for quota"
        )

    def stop_for_queue(self, release: bool = False) -> bool:
        """Held by the queue: stop (Suspending drains the gang first; with `release`, a serving gang also
        releases its memory before its pods go). True when it did."""
        if not self.held():
            return False
        reason, message = self.queue_reason()
        if self.obs.pods and release:
            self.stop_through_release(reason, message)
        elif self.obs.pods:
            self.enter(Phase.SUSPENDING, reason, message)
        else:  # nothing to drain: straight to Suspended, without a Suspending span in the timeline
            self.enter(Phase.SUSPENDED, reason, message)
        return True

    def stop_through_release(self, reason: EventReason, message: str) -> None:
        """Suspend or preemption of a serving gang: Draining, Releasing (memory freed and verified, so
        whoever gets these GPUs next finds them free even while the pods terminate), then Suspending."""
        self.status.stopping = True
        self.enter(Phase.DRAINING, reason, f"{message}: draining and releasing before the pods go")

    # --- status helpers ---------------------------------------------------------------------------

    def committed(self) -> CommittedWeights:
        if self.status.weight_history:
            return self.status.weight_history[-1]
        return CommittedWeights(
            version=self.spec.weights.initial_version, path=self.spec.weights.initial_path, iteration=0
        )

    def enter(
        self,
        phase: Phase,
        reason: EventReason | None = None,
        message: str | None = None,
        warning: bool | None = None,
    ) -> None:
        """The one place a phase changes: closes the timeline span, bumps the epoch, emits the event.
        The event is a Warning for Failed and Recovering unless `warning` says otherwise."""
        st = self.status
        old = st.phase
        self.close_span()
        st.phase = phase
        if phase in LOCK_STEPS:  # a new lock-step: new idempotency key
            st.epoch += 1
        st.phase_start_time = self.now
        st.reason = (reason or EventReason.PHASE_CHANGED).value
        st.message = (message or f"{old.value} -> {phase.value}")[:MAX_MESSAGE]
        if phase in LOCK_STEPS or phase == Phase.ROLLOUT:
            timeline.open_span(st.timeline, phase, st.iteration, self.now)
        st.pods = timeline.pod_entries((p, self.agent(p)) for p in self.gang().values())
        warn = phase in (Phase.FAILED, Phase.RECOVERING) if warning is None else warning
        self.event(reason or EventReason.PHASE_CHANGED, st.message, warning=warn)

    def close_span(self) -> None:
        """Close the current phase's span with the numbers its row records."""
        st = self.status
        span = timeline.close_span(st.timeline, st.phase, self.obs.now)
        if span is None:
            return
        agents = self.gang_agents()
        row = LOCK_STEPS.get(st.phase)
        if row is not None:
            span.agent_seconds = timeline.slowest_agent_seconds(agents, st.epoch, row.action)
        record = row.record if row is not None else SPAN_RECORDS.get(st.phase)
        if record is not None:
            record(st.timeline, span, st.iteration, agents)

    # --- effects ----------------------------------------------------------------------------------

    def send(self, pod: PodObservation, command: Command) -> None:
        self.commands.append(PodCommand(pod.name, command))

    def delete_all_pods(self) -> bool:
        """Ask every pod not already terminating to go; True once none is left."""
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
            awaiting=tuple(self.awaiting),
            next_due=self.next_due,
        )


# --- the lock-step phases: one row each ---------------------------------------------------------------

SpanRecord = Callable[[list[PhaseSpan], PhaseSpan, int, Sequence[AgentState]], None]
"""Numbers a phase's span keeps when it closes: (timeline, closed span, iteration, gang agents)."""


class Role(StrEnum):
    """A pod's part in its SGLang instance (spec.rollout.podsPerInstance pods each). Only node rank 0 runs
    SGLang's HTTP server (C-NODE in docs/sglang-conformance.md: the other nodes serve /ping, /health and
    /health_generate only and get release, resume and refit through the TP broadcast from node 0)."""

    LEADER = "leader"  # node rank 0: its agent makes the instance's SGLang calls
    FOLLOWER = "follower"  # node rank > 0: its agent never calls SGLang's lifecycle routes, checks its GPUs


def role_of(index: int, pods_per_instance: int) -> Role:
    return Role.LEADER if index % pods_per_instance == 0 else Role.FOLLOWER


@dataclass(frozen=True)
class LockStep:
    """One lock-step phase: every pod gets `command(step, pod, agent, role)` stamped with the phase's
    epoch; the phase is done when every pod's agent reports that epoch's `action` Succeeded and `done(step,
    agent)` holds; then `then(step, agents)` moves the job on. With `after_leader`, a follower gets its
    command only once its instance's leader finished the same epoch with the row's evidence: the leader's
    SGLang call is what acts on the follower's ranks, and the follower then checks its own GPUs.

    A lost member, a phase running past `deadline` or a failed command restarts the gang (a permanent
    failure fails the job), unless `best_effort`: the pods are going away anyway, so a lost member or the
    deadline ends the phase early and a failed command counts as done. A stopping gang (status.stopping)
    that meets any of these goes straight to Suspending."""

    action: Action
    deadline: Callable[[PhaseTimeouts], int | None]
    command: Callable[[_Step, AgentState, Role], Command]
    done: Callable[[_Step, AgentState], bool]
    then: Callable[[_Step, list[AgentState]], None]
    record: SpanRecord | None = None
    best_effort: bool = False
    after_leader: bool = False
    already_done: Callable[[_Step], bool] | None = None  # then() at once: nothing left to send
    # What a pod whose command succeeded still waits for, when `done` is one report's evidence the
    # conductor can check report by report (Decision.awaiting); otherwise each such report is decided.
    awaits: Evidence = Evidence.COMMAND
    # What the command depends on besides the step and the pod's role: a decision builds one command per
    # role and value, not one per pod (at 512 pods building them was most of a decision's time).
    varies: Callable[[AgentState], str | None] = lambda agent: None


# The command builders. A follower's agent reads each command by its own role (docs/agent.md, "Leader and
# followers"): a drain takes its GPUs' before-sample, a release verifies its GPUs against it, a refit and a
# resume record what the leader's SGLang call did (and a resume checks that the memory came back).


def _drain(step: _Step, agent: AgentState, role: Role) -> Command:
    drain = step.spec.rollout.drain
    return DrainCommand(epoch=step.status.epoch, mode=drain.mode, timeout_seconds=drain.timeout_seconds)


def _release(step: _Step, agent: AgentState, role: Role) -> Command:
    release = step.spec.release
    return ReleaseCommand(epoch=step.status.epoch, tags=list(release.tags), verify=release.verify)


def _grant(step: _Step, agent: AgentState, role: Role) -> Command:
    return GrantCommand(epoch=step.status.epoch)


def _refit(step: _Step, agent: AgentState, role: Role) -> Command:
    target = step.status.target_weights
    assert target is not None
    # After training each pod loads what its own trainer published; a rejoin loads the committed path.
    rejoin = target.version == step.committed().version
    path = target.path if rejoin else (agent.trainer.published_path or target.path)
    return RefitCommand(
        epoch=step.status.epoch,
        version=target.version,
        path=path,
        source=step.spec.refit.source,
        timeout_seconds=step.spec.refit.timeout_seconds,
    )


def _resume(step: _Step, agent: AgentState, role: Role) -> Command:
    timeout = float(step.spec.phase_timeout_seconds.resuming or 300)
    # A follower has no SGLang API to read the served version from: it reports what its leader verified.
    version = _target_version(step) if role == Role.FOLLOWER else None
    return ResumeCommand(epoch=step.status.epoch, timeout_seconds=timeout, version=version)


def _command_succeeded(step: _Step, agent: AgentState) -> bool:
    """No evidence needed beyond the command's Succeeded state."""
    return True


def _memory_verified(step: _Step, agent: AgentState) -> bool:
    return agent.memory.verified  # invariant 3: no lease before freed memory is verified


def _published(step: _Step, agent: AgentState) -> bool:
    trainer = agent.trainer
    return trainer.published_epoch == step.status.epoch and trainer.published_version is not None


def _target_version(step: _Step) -> str | None:
    return step.status.target_weights.version if step.status.target_weights else None


def _serves_target(step: _Step, agent: AgentState) -> bool:
    return agent.sglang.served_version == _target_version(step)


def _serving_target(step: _Step, agent: AgentState) -> bool:
    # invariant 4: rollout reopens only on the verified version
    return agent.stage == Stage.SERVING and agent.sglang.served_version == _target_version(step)


def _advance_to(phase: Phase, message: str | None = None) -> Callable[[_Step, list[AgentState]], None]:
    def then(step: _Step, agents: list[AgentState]) -> None:
        step.enter(phase, EventReason.PHASE_CHANGED, message)

    return then


def _refit_published_version(step: _Step, agents: list[AgentState]) -> None:
    """Training done: every trainer published; refit that version, or fail if they disagree or it does
    not move forward (invariant 6)."""
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


def _commit_and_open_rollout(step: _Step, agents: list[AgentState]) -> None:
    """Resuming done: commit the target weights, then open the next iteration's rollout (or the same
    iteration's, after a rejoin), or finish when spec.iterations are done."""
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
    record_iteration(st, step.spec.profile)  # report, history, verdict, diagnosis
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


def _train_or_stop(step: _Step, agents: list[AgentState]) -> None:
    """Released: the trainers get the GPUs, or, when the gang is stopping, Suspending deletes it."""
    if step.status.stopping:
        step.enter(Phase.SUSPENDING, EventReason.PHASE_CHANGED, "memory freed and verified on every pod")
    else:
        step.enter(Phase.TRAINING, EventReason.PHASE_CHANGED, "memory freed and verified on every pod")


def _delete_gang_then_suspend(step: _Step, agents: list[AgentState]) -> None:
    """Suspending drained (or gave up draining): delete the gang; Suspended once no pod is left."""
    asked = [p for p in step.obs.pods if not p.deleting]
    if step.delete_all_pods():
        step.status.stopping = False
        at = f"suspended at weights {step.status.weight_version}"
        if step.held() and not step.spec.suspend:
            reason, message = step.queue_reason()
            step.enter(Phase.SUSPENDED, reason, f"{at}; {message}")
        else:
            step.enter(Phase.SUSPENDED, EventReason.SUSPENDED, at)
    elif asked:  # pods already terminating were announced when they were asked to go
        step.event(EventReason.PODS_DELETED, "deleting the gang to suspend")


LOCK_STEPS: dict[Phase, LockStep] = {
    Phase.DRAINING: LockStep(
        action=Action.DRAIN,
        deadline=lambda t: t.draining,
        command=_drain,
        done=_command_succeeded,
        then=_advance_to(Phase.RELEASING),
        record=timeline.record_rollout_sample,
    ),
    Phase.RELEASING: LockStep(
        action=Action.RELEASE,
        deadline=lambda t: t.releasing,
        command=_release,
        done=_memory_verified,
        then=_train_or_stop,
        record=timeline.record_freed_bytes,
        after_leader=True,
    ),
    Phase.TRAINING: LockStep(
        action=Action.GRANT,
        deadline=lambda t: t.training,
        command=_grant,
        done=_published,
        then=_refit_published_version,
        record=timeline.record_trainer_seconds,
        awaits=Evidence.PUBLISHED,
    ),
    Phase.REFITTING: LockStep(
        action=Action.REFIT,
        deadline=lambda t: t.refitting,
        command=_refit,
        varies=lambda agent: agent.trainer.published_path,
        done=_serves_target,
        then=_advance_to(Phase.RESUMING),
        after_leader=True,
    ),
    Phase.RESUMING: LockStep(
        action=Action.RESUME,
        deadline=lambda t: t.resuming,
        command=_resume,
        done=_serving_target,
        then=_commit_and_open_rollout,
        after_leader=True,
    ),
    Phase.SUSPENDING: LockStep(
        action=Action.DRAIN,  # drain first, so in-flight requests end cleanly before their pods go
        deadline=lambda t: t.draining,
        command=_drain,
        done=_command_succeeded,
        then=_delete_gang_then_suspend,
        best_effort=True,
        already_done=lambda step: step.status.stopping,  # drained and released on the way here
    ),
}

# Spans of phases outside LOCK_STEPS that keep numbers when they close.
SPAN_RECORDS: dict[Phase, SpanRecord] = {Phase.ROLLOUT: timeline.record_rollout_sample}


def _lock_step(step: _Step, row: LockStep) -> None:
    if row.already_done is not None and row.already_done(step):
        row.then(step, [])
        return
    lost = step.lost_member()
    limit = row.deadline(step.spec.phase_timeout_seconds)
    if step.status.stopping and row.best_effort is False:
        if lost is not None or _past(step, limit):
            _stop_without_finishing(step, lost or f"{step.status.phase.value} past its deadline")
            return
    elif row.best_effort:  # the pods go anyway
        if lost is not None or _past(step, limit):
            row.then(step, [])
            return
    elif lost is not None:
        _recover(step, lost)
        return
    elif _restart_gang_if_timed_out(step, limit):
        return
    done = _send_and_collect(step, row)
    if done is not None:
        row.then(step, done)


def _stop_without_finishing(step: _Step, why: str) -> None:
    """A stopping gang whose drain or release cannot finish goes straight to Suspending: the next phase's
    command would be illegal on a pod that did not finish this one (a release of a server still serving,
    invariant 1), and the pods go anyway."""
    step.enter(Phase.SUSPENDING, EventReason.PHASE_CHANGED, f"stopping without finishing: {why}")


def _send_and_collect(step: _Step, row: LockStep) -> list[AgentState] | None:
    """Send the row's command to every pod that hasn't accepted this epoch; return the agents' states
    once every pod finished it with the row's evidence, None while waiting (or when a pod's report
    restarted the gang or failed the job)."""
    st = step.status
    finished: list[AgentState] = []
    waiting = False
    running: list[Awaited] = []  # pods that run this epoch's command, or are sent it
    waiting_otherwise = False  # on a report, a send, a leader or evidence: see Decision.awaiting
    step.awaiting = []
    leaders_done: set[int] = set()  # indices of leaders that finished this epoch with the row's evidence
    built: dict[tuple[Role, str | None], Command] = {}  # by role and LockStep.varies
    per = step.spec.rollout.pods_per_instance
    for pod in sorted(step.gang().values(), key=lambda p: p.index):  # a leader before its followers
        agent = step.agent(pod)
        if agent is None or not pod.running:
            waiting = waiting_otherwise = True
            continue
        role = step.role(pod)
        cmd = agent.last_command
        # What a decision would wait on for this pod alone: past the checks below, its command is this
        # epoch's `row.action`.
        awaited = Awaited(pod.name, agent.boot_id, st.epoch, row.action, row.awaits)
        if agent.epoch < st.epoch or cmd is None or cmd.epoch < st.epoch:
            waiting = True
            if role == Role.FOLLOWER and row.after_leader and pod.index - pod.index % per not in leaders_done:
                waiting_otherwise = True
                continue  # its leader's SGLang call has not acted on its ranks yet
            key = (role, row.varies(agent))
            command = built.get(key)
            if command is None:
                command = built[key] = row.command(step, agent, role)
            step.send(pod, command)
            running.append(awaited)  # once it is accepted
            continue
        if cmd.epoch > st.epoch or cmd.action != row.action:
            # The agent is ahead of our status: our status was rolled back. Never guess: restart the gang.
            _recover(
                step, f"pod {pod.name} reports epoch {cmd.epoch} ({cmd.action.value}), job is at {st.epoch}"
            )
            return None
        if cmd.state == CommandState.RUNNING:
            waiting = True
            running.append(awaited)
        elif cmd.state == CommandState.FAILED:
            if row.best_effort:
                finished.append(agent)
                continue
            if st.stopping:
                _stop_without_finishing(step, f"{cmd.action.value} failed on {pod.name}: {cmd.error}")
                return None
            _fail_or_recover_after_command_failure(step, pod, cmd)
            return None
        elif not row.done(step, agent):
            waiting = True
            if row.awaits == Evidence.COMMAND:
                waiting_otherwise = True
            else:
                running.append(awaited)
        else:
            finished.append(agent)
            if role == Role.LEADER:
                leaders_done.add(pod.index)
    if waiting and not waiting_otherwise:
        step.awaiting = running
    return None if waiting else finished


class AwaitedReport(StrEnum):
    """What an awaited pod's latest report says (Decision.awaiting)."""

    RUNNING = "Running"  # it runs the command, or its agent took it and has not reported it yet
    SUCCEEDED = "Succeeded"
    DECIDE = "Decide"  # anything else: a decision must look at it


def awaited_report(awaited: Awaited, agent: AgentState | None, accepted: bool) -> AwaitedReport:
    """`accepted`: the pod's agent took the awaited command (the operator knows; the report may lag)."""
    if agent is None or agent.boot_id != awaited.boot_id or agent.fatal or agent.stage == Stage.FAILED:
        return AwaitedReport.DECIDE
    if awaited.evidence == Evidence.REQUESTED:  # _rollout: the resume is behind it, only the trainer moves
        if agent.epoch != awaited.epoch:
            return AwaitedReport.DECIDE
        return AwaitedReport.SUCCEEDED if agent.trainer.requested else AwaitedReport.RUNNING
    cmd = agent.last_command
    if agent.epoch < awaited.epoch or cmd is None or cmd.epoch < awaited.epoch:  # not reported taking it
        return AwaitedReport.RUNNING if accepted else AwaitedReport.DECIDE
    if (agent.epoch, cmd.epoch, cmd.action) != (awaited.epoch, awaited.epoch, awaited.action):
        return AwaitedReport.DECIDE
    if cmd.state == CommandState.RUNNING:
        return AwaitedReport.RUNNING
    if cmd.state != CommandState.SUCCEEDED:
        return AwaitedReport.DECIDE
    if awaited.evidence == Evidence.PUBLISHED:  # _published, for the awaited grant's epoch
        trainer = agent.trainer
        published = trainer.published_epoch == awaited.epoch and trainer.published_version is not None
        return AwaitedReport.SUCCEEDED if published else AwaitedReport.RUNNING
    return AwaitedReport.SUCCEEDED


def decides_nothing_new(
    awaiting: Sequence[Awaited],
    changed: Collection[str],
    agents: Mapping[str, AgentState | None],
    accepted: Collection[str],
) -> bool:
    """After a decision that waits only on `awaiting` (Decision.awaiting): True when the reports of the
    pods in `changed` since then would make the same decision, i.e. each is an awaited pod's report that
    its command succeeded, and an awaited pod still runs it (its report says so, or it does not show the
    command yet and the pod is in `accepted`). The decision then waits on, sends nothing new and changes
    no status field, and the conductor skips it (at 512 pods a decision per report costs a decision per
    pod per phase). Anything else is decided: a failed command, another epoch or boot, a Failed stage or
    `fatal`, the last awaited pod finishing, a report of a pod not awaited, a command not yet accepted
    (it is sent again). The conductor keeps the same answer report by report (controller/conductor.py,
    AwaitedPods)."""
    awaited = {a.pod for a in awaiting}
    if not awaited or not awaited.issuperset(changed):
        return False
    reports = [awaited_report(a, agents.get(a.pod), a.pod in accepted) for a in awaiting]
    return AwaitedReport.DECIDE not in reports and AwaitedReport.RUNNING in reports


def _fail_or_recover_after_command_failure(step: _Step, pod: PodObservation, cmd: CommandStatus) -> None:
    """A failure the agent marks permanent would repeat in any gang: the job fails with the agent's
    reason, without a restart. Any other failure restarts the gang."""
    where = f"{cmd.action.value}@{cmd.epoch}"
    if cmd.permanent:
        known = {r.value: r for r in EventReason}
        reason = known.get(cmd.failure_reason or "", EventReason.COMMAND_FAILED)
        _fail(step, reason, cmd.error or f"{where} failed permanently on {pod.name}")
        return
    step.event(EventReason.COMMAND_FAILED, f"{pod.name}: {where}: {cmd.error}", True)
    _recover(step, f"{cmd.action.value} failed on {pod.name}: {cmd.error}")


def _commit(step: _Step, weights: CommittedWeights) -> None:
    """Invariant 6: weightVersion is written only here, after every pod served it, and never repeats."""
    st = step.status
    if st.weight_version == weights.version:
        return
    entry = weights.model_copy(update={"committed_at": step.now})
    st.weight_version = weights.version
    st.weight_history = ([*st.weight_history, entry])[-MAX_WEIGHT_HISTORY:]
    step.event(EventReason.WEIGHTS_COMMITTED, f"weights {weights.version} served and verified on every pod")


# --- the other phases --------------------------------------------------------------------------------


def _pending(step: _Step) -> None:
    if step.spec.suspend:
        step.enter(Phase.SUSPENDING, EventReason.SUSPENDED, "suspend requested before start")
        return
    if step.stop_for_queue():
        return
    if _restart_gang_if_timed_out(step, step.spec.phase_timeout_seconds.initializing):
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
    _note_placement(step, gang)
    if all(p.running for p in gang.values()):
        step.enter(Phase.INITIALIZING)


def _note_placement(step: _Step, gang: dict[int, PodObservation]) -> None:
    """A member the scheduler cannot place is said, with the scheduler's words: condition Scheduled False,
    reason Unschedulable, one Warning event. The placed members wait unstarted (their agents' startup
    probe passes only once the operator watches them, which it does once the gang is placed whole), until
    a node frees up or phaseTimeoutSeconds.initializing restarts the gang (docs/lifecycle.md)."""
    st = step.status
    stuck = sorted((p for p in gang.values() if p.unschedulable), key=lambda p: p.index)
    before = st.condition(ConditionType.SCHEDULED)
    if stuck:
        first = stuck[0]
        count = f"{len(stuck)} of {step.spec.replicas} pods cannot be placed"
        message = f"{count}; {first.name}: {first.unschedulable}"
        if before is None or before.status != ConditionStatus.FALSE:
            step.event(EventReason.UNSCHEDULABLE, message, warning=True)
        set_condition(st, ConditionType.SCHEDULED, False, EventReason.UNSCHEDULABLE.value, message, step.now)
        st.reason, st.message = EventReason.UNSCHEDULABLE, message
    elif before is not None and before.status == ConditionStatus.FALSE:
        message = f"the scheduler placed all {step.spec.replicas} pods"
        set_condition(st, ConditionType.SCHEDULED, True, EventReason.GANG_PLACED.value, message, step.now)
        st.reason, st.message = EventReason.GANG_PLACED, message
        step.event(EventReason.GANG_PLACED, message)


def _initializing(step: _Step) -> None:
    if step.spec.suspend:
        step.enter(Phase.SUSPENDING, EventReason.SUSPENDED, "suspend requested")
        return
    if step.stop_for_queue():
        return
    lost = step.lost_member()
    if lost:
        _recover(step, lost)
        return
    if _restart_gang_if_timed_out(step, step.spec.phase_timeout_seconds.initializing):
        return
    gang = step.gang()
    agents = [step.agent(p) for p in gang.values()]
    if any(a is None or not a.sglang.reachable or a.stage == Stage.STARTING for a in agents):
        return
    for pod in gang.values():
        agent = step.agent(pod)
        expected = pod.index % step.spec.rollout.pods_per_instance
        if agent is not None and agent.node_rank != expected:
            _fail(
                step,
                EventReason.INVALID_SPEC,
                f"pod {pod.name}'s agent runs as SGLang node rank {agent.node_rank}, but the pod is node "
                f"rank {expected} of its instance (is RLJOB_NODE_RANK set in the template?)",
            )
            return
    ready = [a for a in agents if a is not None]
    # Only leaders run SGLang's HTTP API: the launch facts and the served version are theirs.
    leaders = [a for a in step.leaders() if a is not None]
    cached = [a for a in leaders if a.sglang.weight_cache_mode not in ("", "off")]
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
    if all(a.sglang.served_version == committed.version for a in leaders):
        # Already serving the committed weights: verify and open rollout.
        step.enter(Phase.RESUMING, EventReason.PHASE_CHANGED, f"every pod serves {committed.version}")
        return
    if committed.path is None and step.spec.refit.source.value == "disk":
        served = sorted({str(a.sglang.served_version) for a in leaders})
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
        step.stop_through_release(EventReason.SUSPENDED, "suspend requested during rollout")
        return
    if step.stop_for_queue(release=True):
        return
    if _restart_gang_if_timed_out(step, step.spec.phase_timeout_seconds.rollout):
        return
    epoch = step.status.epoch
    asking: list[Awaited] = []  # pods whose trainers have yet to ask (Decision.awaiting)
    for pod in step.gang().values():
        agent = step.agent(pod)
        # A request counts only from a report that already saw this rollout's resume: an older report
        # may carry the previous iteration's request (the agent clears it at grant).
        if agent is None or agent.epoch != epoch:
            return
        if not agent.trainer.requested:
            asking.append(Awaited(pod.name, agent.boot_id, epoch, Action.RESUME, Evidence.REQUESTED))
    if asking:
        step.awaiting = asking
        return
    step.enter(Phase.DRAINING, EventReason.PHASE_CHANGED, "every trainer asked for the GPU")


def _suspended(step: _Step) -> None:
    gone = step.delete_all_pods()
    st = step.status
    if step.spec.suspend:
        return
    if step.held():
        # Waiting in the queue: status says what the queue says now, without an event per change of words.
        reason, message = step.queue_reason()
        st.reason, st.message = reason.value, message[:MAX_MESSAGE]
        return
    if not gone:
        return
    resume = f"resuming at committed weights {step.committed().version}"
    if st.reason in (EventReason.WAITING_FOR_QUOTA, EventReason.EVICTED):
        step.enter(Phase.PENDING, EventReason.ADMITTED, f"{step.obs.admission_message}: {resume}")
    else:
        step.enter(Phase.PENDING, EventReason.RESUMED, resume)


def _recovering(step: _Step) -> None:
    if step.delete_all_pods():
        step.enter(Phase.PENDING, EventReason.PHASE_CHANGED, f"recreating gang {step.status.restarts}")


def _finished(step: _Step) -> None:
    """Terminal phases are sticky, with one exception: spec.iterations raised after Succeeded continues
    the job (see _continue_if_iterations_raised). Otherwise only cleanup and TTL happen here."""
    if _continue_if_iterations_raised(step):
        return
    _clean_up_finished(step)


# Every phase is a row of LOCK_STEPS or has a handler here; the terminal ones are _finished's (decide
# runs it before the deadline and leftover checks, which a finished job skips).
HANDLERS: dict[Phase, Callable[[_Step], None]] = {
    Phase.PENDING: _pending,
    Phase.INITIALIZING: _initializing,
    Phase.ROLLOUT: _rollout,
    Phase.RECOVERING: _recovering,
    Phase.SUSPENDED: _suspended,
}


# --- the decision --------------------------------------------------------------------------------------


def decide(spec: RLJobSpec | None, status: RLJobStatus, obs: Observation) -> Decision:
    """The next status and effects. `spec` is None when the spec could not be parsed; obs.spec_error
    then says why (and may be set with a spec, when the API server refused a child object). The input
    status is never changed."""
    # A shallow copy: every list decide changes is replaced, not changed in place, except the timeline,
    # copied here; its spans are copied before they are written (timeline.close_span). A deep copy was
    # most of decide's cost at 64 pods.
    st = status.model_copy()
    st.timeline = list(status.timeline)
    step = _Step(job_spec=spec, status=st, obs=obs)
    if st.start_time is None:
        st.start_time = step.now
        st.phase_start_time = step.now
    if obs.generation is not None:
        st.observed_generation = obs.generation
    if spec is not None:
        st.replicas = spec.replicas
        st.ready_replicas = sum(1 for p in step.gang().values() if p.running and p.ready)
        st.ready = f"{st.ready_replicas}/{spec.replicas}"

    permanent = [r for r in obs.refusals if r.permanent]
    if spec is None or obs.spec_error is not None:
        _fail_on_invalid_spec(step, obs.spec_error or "spec: refused by the models")
    elif st.phase.terminal:
        _finished(step)
    elif _fail_if_deadline_exceeded(step):
        pass
    elif permanent:
        _fail_on_permanent_refusal(step, permanent[0])
    else:
        for pod in obs.pods:  # leftovers of an earlier gang never rejoin
            if pod.gang != st.restarts or pod.index >= spec.replicas:
                step.delete.append(pod.name)
        entered = (st.phase, st.epoch)
        row = LOCK_STEPS.get(st.phase)
        if row is not None:
            _lock_step(step, row)
        else:
            HANDLERS[st.phase](step)
        row = LOCK_STEPS.get(st.phase)
        if (st.phase, st.epoch) != entered and row is not None:
            if row.already_done is not None and row.already_done(step):
                row.then(step, [])
            else:
                _send_and_collect(step, row)  # a new lock-step phase sends its commands in the same decision
    for refusal in obs.refusals:
        if not refusal.permanent:  # a permanent one is the Failed event's reason
            step.event(EventReason.COMMAND_REFUSED, f"{refusal.pod}: {refusal.reason}", warning=True)
    refresh_phase_conditions(st, step.now)
    if obs.admission != Admission.NOT_QUEUED and not st.phase.terminal:
        reason, message = (
            step.queue_reason() if step.held() else (EventReason.ADMITTED, obs.admission_message)
        )
        set_condition(st, ConditionType.QUEUED, step.held(), reason.value, message, step.now)
    return step.freeze()


# --- helpers that end or restart the job ---------------------------------------------------------------


def _recover(step: _Step, why: str) -> None:
    """A member is lost: the whole gang restarts at the committed weights. Partial rejoin would pair a
    fresh trainer rank with survivors mid-step, which no collective can take."""
    st = step.status
    set_condition(st, ConditionType.DEGRADED, True, EventReason.GANG_MEMBER_LOST.value, why, step.now)
    if st.restarts >= step.spec.backoff_limit:
        step.event(EventReason.GANG_MEMBER_LOST, why, warning=True)
        _fail(
            step,
            EventReason.BACKOFF_LIMIT_EXCEEDED,
            f"{why}; backoffLimit {step.spec.backoff_limit} reached after {st.restarts} restart(s)",
        )
        return
    st.restarts += 1
    st.target_weights = None
    st.stopping = False  # a fresh gang: a suspend still asked for is taken again from its own phases
    step.enter(Phase.RECOVERING, EventReason.GANG_MEMBER_LOST, why)  # the one GangMemberLost event
    step.delete_all_pods()


def _fail(step: _Step, reason: EventReason, message: str) -> None:
    st = step.status
    st.completion_time = step.now
    step.enter(Phase.FAILED, reason, message)
    _clean_up_finished(step)


def _fail_on_permanent_refusal(step: _Step, refusal: AgentRefusal) -> None:
    """An agent refused a command that no retry and no new gang can change (its SGLang's version or launch
    flags forbid it): the job fails now, with the agent's reason and what to change, and no restart."""
    known = {r.value: r for r in EventReason}
    reason = known.get(refusal.error or "", EventReason.COMMAND_REFUSED)
    _fail(step, reason, f"{refusal.pod}: {refusal.reason}")


def _fail_on_invalid_spec(step: _Step, error: str) -> None:
    """A spec the models refuse, or a child object the API server refused: nothing can make the job run,
    so it fails (reason InvalidSpec, the message naming the field) and its pods go. A job already
    finished stays as it is: terminal phases are sticky, so a repeated round posts no second event."""
    if step.status.phase.terminal:
        _clean_up_finished(step)
        return
    _fail(step, EventReason.INVALID_SPEC, error)


def _past(step: _Step, limit: int | None) -> bool:
    return step.passed(step.status.phase_start_time, limit)


def _restart_gang_if_timed_out(step: _Step, limit: int | None) -> bool:
    """True when the phase ran past `limit`: the job is Degraded and the gang restarted."""
    st = step.status
    if not _past(step, limit):
        return False
    why = f"phase {st.phase.value} exceeded {limit}s"
    step.event(EventReason.PHASE_TIMEOUT, why, warning=True)
    set_condition(st, ConditionType.DEGRADED, True, EventReason.PHASE_TIMEOUT.value, why, step.now)
    _recover(step, why)
    return True


def _fail_if_deadline_exceeded(step: _Step) -> bool:
    """True when activeDeadlineSeconds passed since the start: the job failed."""
    limit = step.spec.active_deadline_seconds
    if not step.passed(step.status.start_time, limit):
        return False
    _fail(step, EventReason.DEADLINE_EXCEEDED, f"activeDeadlineSeconds {limit} exceeded")
    return True


def _continue_if_iterations_raised(step: _Step) -> bool:
    """spec.iterations raised above the iterations a Succeeded job did: the job continues from its
    committed weights rather than ignoring the edit. True when it does.

    - The gang was kept (podsAfterFinished: Keep) and every member still runs with its agent Serving
      the committed version: rollout of the next iteration opens on those pods at once.
    - Otherwise (the pods were deleted, or one of them stopped): the remaining pods go and a fresh gang
      is created; it loads the committed weights exactly as a gang recreated after a lost member does
      (Initializing -> Refitting -> Resuming -> Rollout), without counting a restart against
      backoffLimit: nothing failed.

    Condition Complete turns False again; the reason IterationsRaised and the message say so. A Failed
    job stays Failed."""
    st, spec = step.status, step.spec
    if st.phase != Phase.SUCCEEDED or spec.iterations is None or spec.iterations <= st.iteration:
        return False
    committed = step.committed()
    st.completion_time = None
    st.target_weights = None
    st.iteration += 1
    why = f"iterations raised to {spec.iterations}: continuing with iteration {st.iteration}"
    serving = [
        a
        for a in step.gang_agents()
        if a.stage == Stage.SERVING and a.sglang.served_version == committed.version
    ]
    kept = (
        spec.pods_after_finished == PodsAfterFinished.KEEP
        and step.lost_member() is None
        and len(serving) == spec.replicas
    )
    if kept:
        step.enter(
            Phase.ROLLOUT, EventReason.ITERATIONS_RAISED, f"{why} on the kept pods at {committed.version}"
        )
    elif step.obs.pods:
        step.enter(
            Phase.RECOVERING,
            EventReason.ITERATIONS_RAISED,
            f"{why}: recreating the gang at committed weights {committed.version}",
            warning=False,
        )
        step.delete_all_pods()
    else:
        step.enter(
            Phase.PENDING,
            EventReason.ITERATIONS_RAISED,
            f"{why}: creating a gang at committed weights {committed.version}",
        )
    return True


def _clean_up_finished(step: _Step) -> None:
    """A finished job's pods go (unless podsAfterFinished: Keep after Succeeded), and the job itself
    once ttlSecondsAfterFinished passed. Without a parsed spec: the pods of a Failed job go, no TTL."""
    st, spec = step.status, step.job_spec
    failed = st.phase == Phase.FAILED
    if failed or (spec is not None and spec.pods_after_finished == PodsAfterFinished.DELETE):
        step.delete_all_pods()
    ttl = spec.ttl_seconds_after_finished if spec is not None else None
    if step.passed(st.completion_time, ttl, reached=True):
        step.delete_job = True
