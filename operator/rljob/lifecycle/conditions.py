"""Conditions derived from the phase, selected by type; lastTransitionTime moves only on a change."""

from __future__ import annotations

from rljob.api.status import Condition, ConditionStatus, ConditionType, Phase, RLJobStatus

# Progressing: every phase on the way somewhere; a new phase is in it unless it is at rest.
_ACTIVE = frozenset(p for p in Phase if not p.terminal and p != Phase.SUSPENDED)


def set_condition(
    status: RLJobStatus, type_: ConditionType, value: bool, reason: str, message: str, now: str
) -> None:
    new = ConditionStatus.TRUE if value else ConditionStatus.FALSE
    old = status.condition(type_)
    if old is not None and old.status == new and old.reason == reason and old.message == message:
        return
    changed_at = now if old is None or old.status != new else old.last_transition_time
    cond = Condition(
        type=type_, status=new, reason=reason, message=message[:1024], last_transition_time=changed_at
    )
    status.conditions = [c for c in status.conditions if c.type != type_] + [cond]
    status.conditions.sort(key=lambda c: list(ConditionType).index(c.type))


def refresh_phase_conditions(status: RLJobStatus, now: str) -> None:
    phase = status.phase
    reason = status.reason or phase.value
    set_condition(
        status,
        ConditionType.READY,
        phase == Phase.ROLLOUT,
        reason,
        "rollout open on every pod" if phase == Phase.ROLLOUT else f"phase {phase.value}",
        now,
    )
    set_condition(status, ConditionType.PROGRESSING, phase in _ACTIVE, reason, f"phase {phase.value}", now)
    set_condition(
        status, ConditionType.SUSPENDED, phase == Phase.SUSPENDED, reason, f"phase {phase.value}", now
    )
    set_condition(status, ConditionType.COMPLETE, phase == Phase.SUCCEEDED, reason, status.message or "", now)
    set_condition(status, ConditionType.FAILED, phase == Phase.FAILED, reason, status.message or "", now)
