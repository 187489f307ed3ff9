"""The lifecycle decision: (spec, status, observation) -> Decision. Pure: no I/O, no clock, no kopf.

One switch over the phase: a lock-step phase runs its row of LOCK_STEPS (lock_steps.py, run by
collect.py); every other phase (Pending, Initializing, Rollout, Recovering, Suspended) has one handler
here in HANDLERS, and the terminal ones run _finished."""

from __future__ import annotations

from collections.abc import Callable

from rljob.api.agent import Action, AgentState, Stage
from rljob.api.spec import RLJobSpec
from rljob.api.status import MAX_MESSAGE, CommittedWeights, ConditionStatus, ConditionType, Phase, RLJobStatus
from rljob.lifecycle import weights
from rljob.lifecycle.collect import run_lock_step, send_and_collect
from rljob.lifecycle.conditions import refresh_phase_conditions, set_condition
from rljob.lifecycle.endings import (
    clean_up_finished,
    continue_if_iterations_raised,
    fail,
    fail_if_deadline_exceeded,
    fail_on_invalid_spec,
    fail_on_permanent_refusal,
    recover,
    restart_gang_if_timed_out,
    succeed_if_trainers_finished,
)
from rljob.lifecycle.evidence import Evidence
from rljob.lifecycle.lock_steps import LOCK_STEPS
from rljob.lifecycle.model import (
    LAUNCH_REFUSALS,
    Admission,
    Awaited,
    Decision,
    EventReason,
    Observation,
    PodObservation,
)
from rljob.lifecycle.step import Step

__all__ = ["HANDLERS", "decide"]


def decide(spec: RLJobSpec | None, status: RLJobStatus, obs: Observation) -> Decision:
    """The next status and effects. `spec` is None when the spec could not be parsed; obs.spec_error
    then says why (and may be set with a spec, when the API server refused a child object). The input
    status is never changed."""
    # Shallow: decide replaces every list it changes but the timeline, copied here (spans: close_span).
    st = status.model_copy()
    st.timeline = list(status.timeline)
    step = Step(job_spec=spec, status=st, obs=obs, rows=LOCK_STEPS)
    _stamp_inputs(step)
    _decide_phase(step)
    _report_refusals_and_conditions(step)
    return step.freeze()


def _stamp_inputs(step: Step) -> None:
    st, spec, obs = step.status, step.job_spec, step.obs
    if st.start_time is None:
        st.start_time = step.now
        st.phase_start_time = step.now
    if obs.generation is not None:
        st.observed_generation = obs.generation
    if spec is not None:
        st.replicas = spec.replicas
        st.ready_replicas = sum(1 for p in step.gang().values() if p.running and p.ready)
        st.ready = f"{st.ready_replicas}/{spec.replicas}"


def _decide_phase(step: Step) -> None:
    st, obs = step.status, step.obs
    permanent = [r for r in obs.refusals if r.permanent]
    if step.job_spec is None or obs.spec_error is not None:
        fail_on_invalid_spec(step, obs.spec_error or "spec: refused by the models")
    elif st.phase.terminal:
        _finished(step)
    elif fail_if_deadline_exceeded(step):
        pass
    elif permanent:
        fail_on_permanent_refusal(step, permanent[0])
    else:
        _run_phase(step)


def _run_phase(step: Step) -> None:
    st = step.status
    for pod in step.obs.pods:  # leftovers of an earlier gang never rejoin
        if pod.gang != st.restarts or pod.index >= step.spec.replicas:
            step.delete.append(pod.name)
    entered = (st.phase, st.epoch)
    row = LOCK_STEPS.get(st.phase)
    if row is not None:
        run_lock_step(step, row)
    else:
        HANDLERS[st.phase](step)
    row = LOCK_STEPS.get(st.phase)
    if (st.phase, st.epoch) == entered or row is None:
        return
    if row.already_done is not None and row.already_done(step):
        row.then(step, [])
    else:
        send_and_collect(step, row)  # a new lock-step phase sends its commands in the same decision


def _report_refusals_and_conditions(step: Step) -> None:
    st, obs = step.status, step.obs
    for refusal in obs.refusals:
        if not refusal.permanent:  # a permanent one is the Failed event's reason
            step.event(EventReason.COMMAND_REFUSED, f"{refusal.pod}: {refusal.reason}", warning=True)
    refresh_phase_conditions(st, step.now)
    if obs.admission != Admission.NOT_QUEUED and not st.phase.terminal:
        reason, message = (
            step.queue_reason() if step.held() else (EventReason.ADMITTED, obs.admission_message)
        )
        set_condition(st, ConditionType.QUEUED, step.held(), reason.value, message, step.now)


# --- the phases outside LOCK_STEPS ---------------------------------------------------------------------


def _suspended_or_queued(step: Step, message: str) -> bool:
    """Before the gang runs: a suspend goes to Suspending, a queue holding the job back stops it."""
    if step.spec.suspend:
        step.enter(Phase.SUSPENDING, EventReason.SUSPENDED, message)
        return True
    return step.stop_for_queue()


def _pending(step: Step) -> None:
    if _suspended_or_queued(step, "suspend requested before start"):
        return
    if restart_gang_if_timed_out(step, step.spec.phase_timeout_seconds.initializing):
        return
    gang = step.gang()
    broken = _broken_member(gang)
    if broken:
        recover(step, broken)
        return
    missing = [i for i in range(step.spec.replicas) if i not in gang]
    if missing:
        step.create.extend(missing)
        step.event(EventReason.PODS_CREATED, f"creating {len(missing)} pod(s) of gang {step.status.restarts}")
        return
    _note_placement(step, gang)
    if all(p.running for p in gang.values()):
        step.enter(Phase.INITIALIZING)


def _broken_member(gang: dict[int, PodObservation]) -> str | None:
    broken = [p for p in gang.values() if p.broken or p.phase in ("Failed", "Succeeded")]
    return f"pod {broken[0].name}: {broken[0].broken or broken[0].phase}" if broken else None


def _note_placement(step: Step, gang: dict[int, PodObservation]) -> None:
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


def _initializing(step: Step) -> None:
    if _suspended_or_queued(step, "suspend requested"):
        return
    lost = step.lost_member()
    if lost:
        recover(step, lost)
        return
    if restart_gang_if_timed_out(step, step.spec.phase_timeout_seconds.initializing):
        return
    agents = [step.agent(p) for p in step.gang().values()]
    if not _engines_up(agents) or _launch_refused(step):
        return
    if all(a is not None and a.stage == Stage.READY for a in agents):
        _open_at_committed_weights(step)


def _engines_up(agents: list[AgentState | None]) -> bool:
    """Every agent reported and reaches its engine, past Starting."""
    return all(a is not None and a.engine.reachable and a.stage != Stage.STARTING for a in agents)


def _launch_refused(step: Step) -> bool:
    """A pod's agent drives another engine than the job's or runs as another node rank than its pod's, or
    its engine runs with a launch flag that makes the handoff fatal: the job failed, before any memory is
    touched. True when it did."""
    for pod in step.gang().values():
        agent = step.agent(pod)
        if agent is not None and agent.engine.kind != step.spec.engine:
            fail(
                step,
                EventReason.INVALID_SPEC,
                f"pod {pod.name}'s agent drives {agent.engine.kind.label}, but the job's spec.engine is "
                f"{step.spec.engine.value} (does the agent image predate it?)",
            )
            return True
        expected = pod.index % step.spec.rollout.pods_per_instance
        if agent is not None and agent.node_rank != expected:
            fail(
                step,
                EventReason.INVALID_SPEC,
                f"pod {pod.name}'s agent runs as {agent.engine.kind.label} node rank {agent.node_rank}, but "
                "the pod is node "
                f"rank {expected} of its instance (is RLJOB_NODE_RANK set in the template?)",
            )
            return True
    # Launch facts are the leaders' (they run the engine's API); the engine says what it refuses.
    refused = [a.engine.launch_refusal for a in step.leaders() if a is not None and a.engine.launch_refusal]
    if refused and refused[0] is not None:
        fail(step, LAUNCH_REFUSALS[refused[0].reason], refused[0].message)
        return True
    return False


def _open_at_committed_weights(step: Step) -> None:
    """Every pod Ready: open rollout if every leader serves the committed weights, by label and by content
    (the checksum its agent took at launch, held against the committed one and the other pods'), else load
    them first."""
    committed = step.committed()
    st = step.status
    st.iteration = max(st.iteration, 1)
    st.target_weights = committed
    leaders = [a for a in step.leaders() if a is not None]
    labelled = all(a.engine.served_version == committed.version for a in leaders)
    wrong = _not_the_committed_weights(step, committed) if labelled else None
    if labelled and wrong is None:
        held = weights.agreed(weights.held_at(step.named_leaders(), committed.version))
        if held is not None and committed.weights_checksum is None:  # recorded when the commit is
            st.target_weights = committed.model_copy(
                update={"weights_checksum": held[0], "weights_layout": held[1]}
            )
        step.enter(Phase.RESUMING, EventReason.PHASE_CHANGED, f"every pod serves {committed.version}")
        return
    if committed.path is None and step.spec.refit.source.value == "disk":
        if wrong is not None:
            fail(
                step,
                EventReason.WEIGHTS_MISMATCH,
                f"{wrong}, and the job has no path to load them from (set spec.weights.initialPath)",
            )
            return
        served = sorted({str(a.engine.served_version) for a in leaders})
        fail(
            step,
            EventReason.INITIAL_VERSION_MISMATCH,
            f"pods serve weight version {', '.join(served)} but the job is at {committed.version} and has "
            "no path to load it from (set spec.weights.initialPath, or launch "
            f"{leaders[0].engine.kind.label} labelled {committed.version})",
        )
        return
    # Rejoin: a fresh gang loads the last committed weights before rollout opens.
    why = f" ({wrong})" if wrong is not None else ""
    step.enter(
        Phase.REFITTING, EventReason.PHASE_CHANGED, f"loading committed weights {committed.version}{why}"
    )


def _not_the_committed_weights(step: Step, committed: CommittedWeights) -> str | None:
    """Leaders labelled with the committed version whose weights are not its, by their launch checksum."""
    held = weights.held_at(step.named_leaders(), committed.version)
    wrong = weights.differs_from_committed(held, committed)
    if wrong:
        pods = ", ".join(h.pod for h in wrong[:4])
        return (
            f"{pods} serve{'s' if len(wrong) == 1 else ''} weights labelled {committed.version} that are not "
            f"its (checksum {wrong[0].checksum[:16]}, committed {str(committed.weights_checksum)[:16]})"
        )
    return weights.disagreement(held, committed.version)


def _rollout(step: Step) -> None:
    lost = step.lost_member()
    if lost:
        recover(step, lost)
        return
    if step.spec.suspend:
        step.stop_through_release(EventReason.SUSPENDED, "suspend requested during rollout")
        return
    if step.stop_for_queue(release=True):
        return
    if restart_gang_if_timed_out(step, step.spec.phase_timeout_seconds.rollout):
        return
    if step.finished_trainers():
        _some_trainers_finished(step)
        return
    epoch = step.status.epoch
    asking: list[Awaited] = []  # pods whose trainers have yet to ask (Decision.awaiting)
    for pod in step.gang().values():
        agent = step.agent(pod)
        if agent is None or agent.epoch != epoch:  # a report from before this rollout's resume
            return
        if not Evidence.TRAINER_REQUESTED.shown_by(agent, epoch, step.target_version()):
            asking.append(Awaited(pod.name, agent.boot_id, epoch, Action.RESUME, Evidence.TRAINER_REQUESTED))
    if asking:
        if step.passed(step.status.phase_start_time, NOTICE_SECONDS):
            # A long Rollout decides on every report, so that status can say for whom it waits.
            if len(asking) < len(step.gang()):
                step.status.message = _waiting_for(step, sorted(a.pod for a in asking))
            return
        step.awaiting = asking
        return
    step.enter(Phase.DRAINING, EventReason.PHASE_CHANGED, "every trainer asked for the GPU")


def _some_trainers_finished(step: Step) -> None:
    """A trainer finished in Rollout: the job succeeds once every trainer did; a trainer that asks for the
    GPU meanwhile wants an iteration the finished ones will never train, so the job fails."""
    st = step.status
    if succeed_if_trainers_finished(step, ran=st.iteration - 1):
        return
    finished = [p.name for p in step.finished_trainers()]
    done = set(finished)
    pending = [p for _, p in sorted(step.gang().items()) if p.name not in done]
    asked = [p.name for p in pending if (a := step.agent(p)) is not None and a.trainer.requested]
    if asked:
        fail(
            step,
            EventReason.TRAINER_FINISHED_EARLY,
            f"the trainers of {_names(finished)} finished while those of {_names(asked)} asked for the GPU "
            f"for iteration {st.iteration}: an iteration needs every pod's trainer (they finish together, "
            "after the same iteration)",
        )
        return
    total = len(step.gang())
    message = (
        f"{len(finished)} of {total} trainers finished after {st.iteration - 1} iterations; waiting for the "
        f"trainers of {_names([p.name for p in pending])} to finish"
    )
    st.message = message[:MAX_MESSAGE]


def _names(pods: list[str]) -> str:
    more = f" and {len(pods) - 8} more" if len(pods) > 8 else ""
    return ", ".join(pods[:8]) + more


NOTICE_SECONDS = 30.0  # a Rollout this old, some of whose trainers asked, names the others in status


def _waiting_for(step: Step, pods: list[str]) -> str:
    total, shown = len(step.gang()), ", ".join(pods[:8])
    more = f" and {len(pods) - 8} more" if len(pods) > 8 else ""
    asked = total - len(pods)
    message = f"{asked} of {total} trainers asked for the GPU; waiting for the trainers of {shown}{more}"
    return message[:MAX_MESSAGE]


def _suspended(step: Step) -> None:
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


def _recovering(step: Step) -> None:
    if step.delete_all_pods():
        step.enter(Phase.PENDING, EventReason.PHASE_CHANGED, f"recreating gang {step.status.restarts}")


def _finished(step: Step) -> None:
    """Terminal phases are sticky, with one exception: spec.iterations raised after Succeeded continues
    the job (see continue_if_iterations_raised). Otherwise only cleanup and TTL happen here."""
    if continue_if_iterations_raised(step):
        return
    clean_up_finished(step)


# Every phase is a row of LOCK_STEPS, has a handler here, or is terminal (decide runs _finished).
HANDLERS: dict[Phase, Callable[[Step], None]] = {
    Phase.PENDING: _pending,
    Phase.INITIALIZING: _initializing,
    Phase.ROLLOUT: _rollout,
    Phase.RECOVERING: _recovering,
    Phase.SUSPENDED: _suspended,
}
