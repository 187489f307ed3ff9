"""Which committed states the channel sends the operator: api/agent.py's NOT_SENT_ALONE and
SENT_WHILE_RUNNING, applied state by state."""

from __future__ import annotations

from typing import Any

from rljob.api.agent import NOT_SENT_ALONE, SENT_WHILE_RUNNING, AgentState, CommandState, Stage


def operator_view(state: AgentState) -> dict[str, Any]:
    return state.model_dump(exclude=set(NOT_SENT_ALONE))


def carried(before: dict[str, Any] | None, after: dict[str, Any]) -> bool:
    """Whether the change from `before` to `after` (operator_view of each) is sent."""
    if before is None:
        return True
    if before == after:
        return False
    command = after.get("last_command")
    if command is None or command.get("state") != CommandState.RUNNING:
        return True
    changed = any(before.get(k) != after.get(k) for k in SENT_WHILE_RUNNING)
    return changed or after.get("stage") == Stage.FAILED


class OperatorReports:
    """`revision`: the revision of the last state the channel sends."""

    def __init__(self) -> None:
        self.revision = 0
        self._view: dict[str, Any] | None = None

    def committed(self, state: AgentState) -> None:
        view = operator_view(state)
        if carried(self._view, view):
            self.revision = state.revision
        self._view = view
