"""The scratch of one decision: the inputs, the status being written, the effects gathered so far, and
the questions every phase asks of them (the gang, the queue, the committed weights). Frozen into a
Decision at the end."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

from rljob.api.agent import Action, AgentState, Command, Stage
from rljob.api.spec import RLJobSpec
from rljob.api.status import MAX_MESSAGE, CommittedWeights, Phase, RLJobStatus
from rljob.lifecycle import timeline
from rljob.lifecycle.clock import parse, stamp
from rljob.lifecycle.finishing import trainer_finished, unclean_finish, with_refusal
from rljob.lifecycle.model import (
    Admission,
    Awaited,
    Decision,
    Event,
    EventReason,
    EventType,
    Observation,
    PodCommand,
    PodObservation,
)
from rljob.lifecycle.roles import Role, role_of
from rljob.lifecycle.timeline import SpanRecord


class LockStepRow(Protocol):
    """What a phase change reads of a lock-step phase's row (lock_steps.LockStep)."""

    @property
    def action(self) -> Action: ...

    @property
    def record(self) -> SpanRecord | None: ...


# Spans of phases outside the lock-step rows that keep numbers when they close.
SPAN_RECORDS: dict[Phase, SpanRecord] = {Phase.ROLLOUT: timeline.record_rollout_sample}


@dataclass
class Step:
    """Mutable scratch for one decision; frozen into a Decision at the end."""

    job_spec: RLJobSpec | None  # None only when the spec could not be parsed (obs.spec_error says why)
    status: RLJobStatus
    obs: Observation
    rows: Mapping[Phase, LockStepRow]  # the lock-step phases' rows (lock_steps.LOCK_STEPS)
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
        """Pods of the current gang generation, by index (status.replicas: the spec's, or the last known
        ones when the spec could not be parsed). Cached per (generation, replicas): never change it."""
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

    def named_leaders(self) -> list[tuple[str, AgentState | None]]:
        """(pod name, latest report) of every instance leader, by index."""
        gang = sorted(self.gang().items())
        return [(p.name, self.agent(p)) for _, p in gang if self.role(p) == Role.LEADER]

    def engine_name(self) -> str:
        """How messages name the gang's engine: the job's (its agents drive no other, _launch_refused)."""
        return self.spec.engine.label

    def gang_agents(self) -> list[AgentState]:
        """The latest report of every gang member that has one."""
        return [a for a in (self.agent(p) for p in self.gang().values()) if a is not None]

    def lost_member(self) -> str | None:
        """Why the gang is broken, or None. A gang member that lost its process state can't rejoin a
        lock-step iteration: its engine's memory or trainer state is gone."""
        gang = self.gang()
        for index in range(self.spec.replicas):
            pod = gang.get(index)
            if pod is None:
                return f"pod #{index} of the gang is missing"
            if pod.deleting:
                return f"pod {pod.name} is being deleted"
            if pod.phase in ("Failed", "Succeeded"):
                return f"pod {pod.name} is {pod.phase}"
            agent = self.agent(pod)
            trainer = self.spec.trainer.container
            if pod.broken:
                return with_refusal(f"pod {pod.name}: {pod.broken}", pod, agent, trainer)
            st = self.status
            unclean = unclean_finish(pod, agent, trainer, st.phase, st.epoch, st.stopping)
            if unclean:
                return with_refusal(f"pod {pod.name}: {unclean}", pod, agent, trainer)
            if agent is not None and (agent.fatal or agent.stage == Stage.FAILED):
                return f"pod {pod.name}: {agent.fatal or 'agent reports Failed'}"
        return None

    def finished_trainers(self) -> list[PodObservation]:
        """The gang's pods whose trainer container exited 0 (finishing.py), by index."""
        trainer = self.spec.trainer.container
        return [p for _, p in sorted(self.gang().items()) if trainer_finished(p, trainer)]

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

    def target_version(self) -> str | None:
        return self.status.target_weights.version if self.status.target_weights else None

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
        if phase in self.rows:  # a new lock-step: new idempotency key
            st.epoch += 1
        st.phase_start_time = self.now
        st.reason = (reason or EventReason.PHASE_CHANGED).value
        st.message = (message or f"{old.value} -> {phase.value}")[:MAX_MESSAGE]
        if phase in self.rows or phase == Phase.ROLLOUT:
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
        row = self.rows.get(st.phase)
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
