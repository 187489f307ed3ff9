"""The lock-step phases, one row each: the command every pod gets (stamped with the phase's epoch), the
evidence each pod's report must show (evidence.py), the phase's deadline, and where the job goes once
every pod showed it. collect.py runs a row; machine.py runs the other phases."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rljob.api.agent import (
    Action,
    AgentState,
    Command,
    DrainCommand,
    GrantCommand,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    Stage,
)
from rljob.api.spec import PhaseTimeouts
from rljob.api.status import MAX_WEIGHT_HISTORY, CommittedWeights, ConditionType, Phase
from rljob.lifecycle import timeline, weights
from rljob.lifecycle.conditions import set_condition
from rljob.lifecycle.endings import fail, recover, succeed_if_trainers_finished
from rljob.lifecycle.evidence import Evidence, returned_unchanged
from rljob.lifecycle.memory_waits import name_trainers_holding_memory
from rljob.lifecycle.model import EventReason
from rljob.lifecycle.profile import record_iteration
from rljob.lifecycle.roles import Role
from rljob.lifecycle.step import Step
from rljob.lifecycle.timeline import SpanRecord
from rljob.lifecycle.versions import is_newer


@dataclass(frozen=True)
class LockStep:
    """One lock-step phase: every pod gets `command(step, agent, role)` stamped with the phase's epoch; the
    phase is done when every pod's report shows `evidence` for that epoch; then `then(step, agents)` moves
    the job on. With `after_leader`, a follower gets its command only once its instance's leader showed the
    evidence: the leader's engine call is what acts on the follower's ranks.

    A lost member, the deadline or a failed command restarts the gang (a permanent failure fails the job),
    unless `best_effort`: the pods go anyway, so a lost member or the deadline ends the phase early and a
    failed command counts as done. A stopping gang (status.stopping) that meets any of these goes straight
    to Suspending."""

    action: Action
    deadline: Callable[[PhaseTimeouts], int | None]
    command: Callable[[Step, AgentState, Role], Command]
    evidence: Evidence
    then: Callable[[Step, list[AgentState]], None]
    record: SpanRecord | None = None
    best_effort: bool = False
    after_leader: bool = False
    already_done: Callable[[Step], bool] | None = None  # then() at once: nothing left to send
    # What the command depends on besides the step and the role: one command is built per role and value.
    varies: Callable[[AgentState], str | None] = lambda agent: None


# A follower's agent reads each command by its own role (docs/agent.md, "Leader and followers").


def _drain(step: Step, agent: AgentState, role: Role) -> Command:
    drain = step.spec.rollout.drain
    return DrainCommand(epoch=step.status.epoch, mode=drain.mode, timeout_seconds=drain.timeout_seconds)


def _release(step: Step, agent: AgentState, role: Role) -> Command:
    release = step.spec.release
    return ReleaseCommand(epoch=step.status.epoch, tags=list(release.tags), verify=release.verify)


def _grant(step: Step, agent: AgentState, role: Role) -> Command:
    return GrantCommand(epoch=step.status.epoch)


def _refit(step: Step, agent: AgentState, role: Role) -> Command:
    target = step.status.target_weights
    assert target is not None
    # After training each pod loads what its own trainer published; a rejoin loads the committed path.
    committed = step.committed()
    rejoin = target.version == committed.version
    path = target.path if rejoin else (agent.trainer.published_path or target.path)
    return RefitCommand(
        epoch=step.status.epoch,
        version=target.version,
        path=path,
        source=step.spec.refit.source,
        timeout_seconds=step.spec.refit.timeout_seconds,
        # The same pods, whose trainers gave the lease back without weights: what the release discarded.
        reload=rejoin and agent.stage == Stage.TRAINED,
        # A rejoin or reload must bring back what every pod verified when the version was committed.
        committed_checksum=committed.weights_checksum if rejoin else None,
        committed_layout=committed.weights_layout if rejoin else None,
    )


def _resume(step: Step, agent: AgentState, role: Role) -> Command:
    timeout = float(step.spec.phase_timeout_seconds.resuming or 300)
    # A follower has no engine API to read the served version from: it reports what its leader verified.
    version = step.target_version() if role == Role.FOLLOWER else None
    return ResumeCommand(epoch=step.status.epoch, timeout_seconds=timeout, version=version)


def _advance_to(phase: Phase, message: str | None = None) -> Callable[[Step, list[AgentState]], None]:
    def then(step: Step, agents: list[AgentState]) -> None:
        step.enter(phase, EventReason.PHASE_CHANGED, message)

    return then


def _refit_published_version(step: Step, agents: list[AgentState]) -> None:
    """Training done: every trainer published; refit that version, or fail if they disagree or it does
    not move forward (invariant 6). Every trainer gave the lease back without weights: the gang goes back
    to the committed version, and no version is recorded."""
    epoch = step.status.epoch
    unchanged = [a for a in agents if returned_unchanged(a, epoch)]
    if unchanged and len(unchanged) < len(agents):
        fail(
            step,
            EventReason.TRAINER_VERSION_MISMATCH,
            f"{len(agents) - len(unchanged)} of {len(agents)} trainers published weights and "
            f"{len(unchanged)} gave the lease back without any: every trainer must publish, or none",
        )
        return
    if unchanged:
        _back_to_committed(step)
        return
    versions = sorted({str(a.trainer.published_version) for a in agents})
    if len(versions) != 1:
        fail(step, EventReason.TRAINER_VERSION_MISMATCH, f"trainers published different versions: {versions}")
        return
    version = versions[0]
    history = [w.version for w in step.status.weight_history] + [step.committed().version]
    if not is_newer(version, history):
        fail(
            step,
            EventReason.VERSION_NOT_NEWER,
            f"trainers published version {version}, not newer than committed {step.committed().version}",
        )
        return
    step.status.target_weights = CommittedWeights(
        version=version, path=agents[0].trainer.published_path, iteration=step.status.iteration
    )
    step.enter(Phase.REFITTING, EventReason.PHASE_CHANGED, f"every trainer published {version}")


WARN_LEASES_WITHOUT_WEIGHTS = 2  # in a row: the job says so (one is AReaL's start-up offload and onload)


def _back_to_committed(step: Step) -> None:
    """Every trainer gave the lease back without weights: the gang serves the committed version again, and
    the leases in a row that brought none are counted (status.leasesWithoutWeights, 0 again at the next
    commit). From WARN_LEASES_WITHOUT_WEIGHTS the job is Degraded with a Warning; past the spec's bound it
    fails: trainers that release and resume without ever training would loop for as long as they run."""
    st, bound = step.status, step.spec.max_leases_without_weights
    st.leases_without_weights += 1
    count, committed = st.leases_without_weights, step.committed()
    in_a_row = f"{count} lease{'' if count == 1 else 's'} in a row given back without new weights"
    if count > bound:
        fail(
            step,
            EventReason.LEASES_WITHOUT_WEIGHTS_EXCEEDED,
            f"{in_a_row}, more than spec.maxLeasesWithoutWeights ({bound}): the trainers release and resume "
            f"{step.engine_name()} without pushing or loading weights, and the pods serve committed "
            f"{committed.version}; "
            "check that the framework refits after its release, or raise spec.maxLeasesWithoutWeights if "
            "it releases without training on purpose",
        )
        return
    back = f"back to committed {committed.version}"
    if count >= WARN_LEASES_WITHOUT_WEIGHTS:
        why = f"{in_a_row} (at most {bound}: spec.maxLeasesWithoutWeights); {back}"
        reason = EventReason.LEASES_WITHOUT_WEIGHTS
        set_condition(st, ConditionType.DEGRADED, True, reason.value, why, step.now)
        step.event(reason, why, warning=True)
    st.target_weights = committed.model_copy(update={"committed_at": None})
    step.enter(
        Phase.REFITTING,
        EventReason.NO_NEW_WEIGHTS,
        f"every trainer gave the lease back without new weights ({count} in a row): {back}",
    )


def _verify_weights_then_resume(step: Step, agents: list[AgentState]) -> None:
    """Refitted: every leader's agent verified its own engine's weights (a mismatch failed its refit); here
    the pods of one layout must hold the same weights at the target version, which the commit records.
    A pod whose engine gave no checksum is said in a WeightsNotVerified event (and in status.pods)."""
    target = step.status.target_weights
    assert target is not None
    named = step.named_leaders()
    held = weights.held_at(named, target.version)
    odd = weights.disagreement(held, target.version)
    if odd is not None:
        step.event(EventReason.WEIGHTS_MISMATCH, odd, warning=True)
        recover(step, f"weights mismatch: {odd}", EventReason.WEIGHTS_MISMATCH)
        return
    both = weights.agreed(held)
    if both is not None:
        step.status.target_weights = target.model_copy(
            update={"weights_checksum": both[0], "weights_layout": both[1]}
        )
    why = weights.unverified(named, target.version)
    if why is not None:
        step.event(EventReason.WEIGHTS_NOT_VERIFIED, why, warning=True)
    step.enter(Phase.RESUMING, EventReason.PHASE_CHANGED)


def _commit_and_open_rollout(step: Step, agents: list[AgentState]) -> None:
    """Resuming done: commit the target weights, then open the next iteration's rollout (or the same
    iteration's, after a rejoin), or finish when spec.iterations are done."""
    st = step.status
    target = st.target_weights
    assert target is not None
    rejoin = target.version == step.committed().version
    gang = [(p, step.agent(p)) for p in step.gang().values()]
    name_trainers_holding_memory(step, gang, {st.epoch - 1, st.epoch})  # the refit's and this resume's
    _commit(step, target)
    st.target_weights = None
    if rejoin:
        step.enter(
            Phase.ROLLOUT,
            EventReason.PHASE_CHANGED,
            f"rollout of iteration {st.iteration} open at {target.version}",
        )
        return
    st.leases_without_weights = 0  # a lease brought weights: the count of those that did not restarts
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
    if succeed_if_trainers_finished(step, ran=st.iteration):
        return
    st.iteration += 1
    step.enter(
        Phase.ROLLOUT,
        EventReason.PHASE_CHANGED,
        f"rollout of iteration {st.iteration} open at {target.version}",
    )


def _train_or_stop(step: Step, agents: list[AgentState]) -> None:
    """Released: the trainers get the GPUs, or, when the gang is stopping, Suspending deletes it."""
    if step.status.stopping:
        step.enter(Phase.SUSPENDING, EventReason.PHASE_CHANGED, "memory freed and verified on every pod")
    else:
        step.enter(Phase.TRAINING, EventReason.PHASE_CHANGED, "memory freed and verified on every pod")


def _delete_gang_then_suspend(step: Step, agents: list[AgentState]) -> None:
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


def _commit(step: Step, committed: CommittedWeights) -> None:
    """Invariant 6: weightVersion is written only here, after every pod served it, and never repeats."""
    st = step.status
    if st.weight_version == committed.version:
        last = st.weight_history[-1] if st.weight_history else None
        if (
            last is not None
            and last.version == committed.version
            and last.weights_checksum is None
            and committed.weights_checksum
        ):
            st.weight_history = [*st.weight_history[:-1], last.model_copy(update=_checksum_of(committed))]
        return
    entry = committed.model_copy(update={"committed_at": step.now})
    st.weight_version = committed.version
    st.weight_history = ([*st.weight_history, entry])[-MAX_WEIGHT_HISTORY:]
    held = (
        f" (checksum {committed.weights_checksum[:16]}, {committed.weights_layout})"
        if committed.weights_checksum
        else ""
    )
    step.event(
        EventReason.WEIGHTS_COMMITTED, f"weights {committed.version} served and verified on every pod{held}"
    )


def _checksum_of(w: CommittedWeights) -> dict[str, str | None]:
    return {"weights_checksum": w.weights_checksum, "weights_layout": w.weights_layout}


LOCK_STEPS: dict[Phase, LockStep] = {
    Phase.DRAINING: LockStep(
        action=Action.DRAIN,
        deadline=lambda t: t.draining,
        command=_drain,
        evidence=Evidence.COMMAND_SUCCEEDED,
        then=_advance_to(Phase.RELEASING),
        record=timeline.record_rollout_sample,
    ),
    Phase.RELEASING: LockStep(
        action=Action.RELEASE,
        deadline=lambda t: t.releasing,
        command=_release,
        evidence=Evidence.MEMORY_VERIFIED,
        then=_train_or_stop,
        record=timeline.record_freed_bytes,
        after_leader=True,
    ),
    Phase.TRAINING: LockStep(
        action=Action.GRANT,
        deadline=lambda t: t.training,
        command=_grant,
        evidence=Evidence.LEASE_RETURNED,
        then=_refit_published_version,
        record=timeline.record_trainer_seconds,
    ),
    Phase.REFITTING: LockStep(
        action=Action.REFIT,
        deadline=lambda t: t.refitting,
        command=_refit,
        varies=lambda agent: agent.trainer.published_path,
        evidence=Evidence.SERVES_TARGET,
        then=_verify_weights_then_resume,
        after_leader=True,
    ),
    Phase.RESUMING: LockStep(
        action=Action.RESUME,
        deadline=lambda t: t.resuming,
        command=_resume,
        evidence=Evidence.SERVING_TARGET,
        then=_commit_and_open_rollout,
        after_leader=True,
    ),
    Phase.SUSPENDING: LockStep(
        action=Action.DRAIN,  # drain first, so in-flight requests end cleanly before their pods go
        deadline=lambda t: t.draining,
        command=_drain,
        evidence=Evidence.COMMAND_SUCCEEDED,
        then=_delete_gang_then_suspend,
        best_effort=True,
        already_done=lambda step: step.status.stopping,  # drained and released on the way here
    ),
}
