"""How a job ends, stops or restarts its gang: failing it, recovering a lost member, deadlines, and what
a finished job does. Every function here changes the phase through Step.enter."""

from __future__ import annotations

from rljob.api.agent import CommandStatus, Stage
from rljob.api.spec import PodsAfterFinished
from rljob.api.status import ConditionType, Phase
from rljob.lifecycle.conditions import set_condition
from rljob.lifecycle.model import AgentRefusal, EventReason, PodObservation
from rljob.lifecycle.step import Step


def recover(step: Step, why: str, reason: EventReason = EventReason.GANG_MEMBER_LOST) -> None:
    """A member is lost (or its weights are not what they must be: `reason`): the whole gang restarts at the
    committed weights. Partial rejoin would pair a fresh trainer rank with survivors mid-step, which no
    collective can take."""
    st = step.status
    set_condition(st, ConditionType.DEGRADED, True, reason.value, why, step.now)
    if st.restarts >= step.spec.backoff_limit:
        step.event(reason, why, warning=True)
        fail(
            step,
            EventReason.BACKOFF_LIMIT_EXCEEDED,
            f"{why}; backoffLimit {step.spec.backoff_limit} reached after {st.restarts} restart(s)",
        )
        return
    st.restarts += 1
    st.target_weights = None
    st.stopping = False  # a fresh gang: a suspend still asked for is taken again from its own phases
    step.enter(Phase.RECOVERING, reason, why)  # the one GangMemberLost (or `reason`) event
    step.delete_all_pods()


def fail(step: Step, reason: EventReason, message: str) -> None:
    st = step.status
    st.completion_time = step.now
    step.enter(Phase.FAILED, reason, message)
    clean_up_finished(step)


def succeed_if_trainers_finished(step: Step, ran: int) -> bool:
    """Every trainer of the gang finished (exited 0; finishing.py) once `ran` iterations were committed:
    the job succeeded, also before spec.iterations, and says how many ran; with none committed it failed
    (NoIterationCommitted). True when it ended either way."""
    st, spec = step.status, step.spec
    if len(step.finished_trainers()) < spec.replicas:
        return False
    st.iteration = ran
    of = f" of {spec.iterations}" if spec.iterations is not None else ""
    if ran == 0:
        _fail_without_iterations(step, of)
        return True
    st.completion_time = step.now
    message = (
        f"every trainer finished after {ran}{of} iteration{'' if ran == 1 else 's'}, "
        f"serving weights {step.committed().version}"
    )
    step.enter(Phase.SUCCEEDED, EventReason.TRAINERS_FINISHED, message)
    return True


def _fail_without_iterations(step: Step, of: str) -> None:
    """Every trainer exited 0 and no iteration committed: nothing was trained, and a pipeline that waits
    for Complete must not take the initial weights for trained ones."""
    empty = step.status.leases_without_weights
    what = (
        f"after {empty} lease{'' if empty == 1 else 's'} given back without new weights"
        if empty
        else "without publishing weights"
    )
    fail(
        step,
        EventReason.NO_ITERATION_COMMITTED,
        f"every trainer exited 0 {what}: 0{of} iterations committed, the pods serve the initial weights "
        f"{step.committed().version}; check the trainer's command and its step count (a framework that "
        "ends at once: no data, 0 steps configured, or not pointed at $RLJOB_ENGINE_URL)",
    )


def fail_on_permanent_refusal(step: Step, refusal: AgentRefusal) -> None:
    """An agent refused a command that no retry and no new gang can change (its engine's version or launch
    flags forbid it): the job fails now, with the agent's reason and what to change, and no restart."""
    known = {r.value: r for r in EventReason}
    reason = known.get(refusal.error or "", EventReason.COMMAND_REFUSED)
    fail(step, reason, f"{refusal.pod}: {refusal.reason}")


def fail_on_invalid_spec(step: Step, error: str) -> None:
    """A spec the models refuse, or a child object the API server refused: nothing can make the job run,
    so it fails (reason InvalidSpec, the message naming the field) and its pods go. A job already
    finished stays as it is: terminal phases are sticky, so a repeated round posts no second event."""
    if step.status.phase.terminal:
        clean_up_finished(step)
        return
    fail(step, EventReason.INVALID_SPEC, error)


def past(step: Step, limit: int | None) -> bool:
    return step.passed(step.status.phase_start_time, limit)


def restart_gang_if_timed_out(step: Step, limit: int | None) -> bool:
    """True when the phase ran past `limit`: the job is Degraded and the gang restarted."""
    st = step.status
    if not past(step, limit):
        return False
    why = f"phase {st.phase.value} exceeded {limit}s"
    if st.reason == EventReason.RESUME_WAITING_FOR_MEMORY:  # what it waited for (memory_waits.py)
        why = f"{why}; {st.message}"
    step.event(EventReason.PHASE_TIMEOUT, why, warning=True)
    set_condition(st, ConditionType.DEGRADED, True, EventReason.PHASE_TIMEOUT.value, why, step.now)
    recover(step, why)
    return True


def fail_if_deadline_exceeded(step: Step) -> bool:
    """True when activeDeadlineSeconds passed since the start: the job failed."""
    limit = step.spec.active_deadline_seconds
    if not step.passed(step.status.start_time, limit):
        return False
    fail(step, EventReason.DEADLINE_EXCEEDED, f"activeDeadlineSeconds {limit} exceeded")
    return True


def continue_if_iterations_raised(step: Step) -> bool:
    """spec.iterations raised above the iterations a Succeeded job did: the job continues from its
    committed weights rather than ignoring the edit. True when it does.

    - The gang was kept (podsAfterFinished: Keep) and every member still runs, its trainer too, with its
      agent Serving the committed version: rollout of the next iteration opens on those pods at once.
    - Otherwise (the pods were deleted, or one of them stopped): the remaining pods go and a fresh gang
      is created; it loads the committed weights exactly as a gang recreated after a lost member does
      (Initializing -> Refitting -> Resuming -> Rollout), without counting a restart against
      backoffLimit: nothing failed.

    Condition Complete turns False again; the reason IterationsRaised and the message say so. A Failed
    job stays Failed, and so does one that succeeded because its trainers finished (TrainersFinished)."""
    st, spec = step.status, step.spec
    if st.phase != Phase.SUCCEEDED or spec.iterations is None or spec.iterations <= st.iteration:
        return False
    if st.reason == EventReason.TRAINERS_FINISHED:  # the trainers said they are done: nothing to continue
        return False
    committed = step.committed()
    st.completion_time = None
    st.target_weights = None
    st.iteration += 1
    why = f"iterations raised to {spec.iterations}: continuing with iteration {st.iteration}"
    at = f"committed weights {committed.version}"
    if _kept_gang_serves(step, committed.version):
        why = f"{why} on the kept pods at {committed.version}"
        step.enter(Phase.ROLLOUT, EventReason.ITERATIONS_RAISED, why)
    elif step.obs.pods:
        why = f"{why}: recreating the gang at {at}"
        step.enter(Phase.RECOVERING, EventReason.ITERATIONS_RAISED, why, warning=False)
        step.delete_all_pods()
    else:
        step.enter(Phase.PENDING, EventReason.ITERATIONS_RAISED, f"{why}: creating a gang at {at}")
    return True


def _kept_gang_serves(step: Step, version: str) -> bool:
    """The gang was kept (podsAfterFinished: Keep), whole, every agent Serving `version`."""
    spec = step.spec
    if spec.pods_after_finished != PodsAfterFinished.KEEP or step.lost_member() is not None:
        return False
    if step.finished_trainers():  # a trainer that exited takes no further iteration: a fresh gang does
        return False
    serving = [
        a for a in step.gang_agents() if a.stage == Stage.SERVING and a.engine.served_version == version
    ]
    return len(serving) == spec.replicas


def clean_up_finished(step: Step) -> None:
    """A finished job's pods go (unless podsAfterFinished: Keep after Succeeded), and the job itself
    once ttlSecondsAfterFinished passed. Without a parsed spec: the pods of a Failed job go, no TTL."""
    st, spec = step.status, step.job_spec
    failed = st.phase == Phase.FAILED
    if failed or (spec is not None and spec.pods_after_finished == PodsAfterFinished.DELETE):
        step.delete_all_pods()
    ttl = spec.ttl_seconds_after_finished if spec is not None else None
    if step.passed(st.completion_time, ttl, reached=True):
        step.delete_job = True


def fail_or_recover_after_command_failure(step: Step, pod: PodObservation, cmd: CommandStatus) -> None:
    """A failure the agent marks permanent would repeat in any gang: the job fails with the agent's
    reason, without a restart. Any other failure restarts the gang."""
    where = f"{cmd.action.value}@{cmd.epoch}"
    known = {r.value: r for r in EventReason}
    reason = known.get(cmd.failure_reason or "", EventReason.COMMAND_FAILED)
    if cmd.permanent:
        fail(step, reason, cmd.error or f"{where} failed permanently on {pod.name}")
        return
    step.event(reason, f"{pod.name}: {where}: {cmd.error}", True)
    lost = EventReason.GANG_MEMBER_LOST if reason == EventReason.COMMAND_FAILED else reason
    recover(step, f"{cmd.action.value} failed on {pod.name}: {cmd.error}", lost)


def stop_without_finishing(step: Step, why: str) -> None:
    """A stopping gang whose drain or release cannot finish goes straight to Suspending: the next phase's
    command would be illegal on a pod that did not finish this one (a release of a server still serving,
    invariant 1), and the pods go anyway."""
    step.enter(Phase.SUSPENDING, EventReason.PHASE_CHANGED, f"stopping without finishing: {why}")
