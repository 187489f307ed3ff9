"""Which state changes the operator acts on. `GET /v1/state?changes=operator` long-polls until one of
these, not until any revision: most revisions are steps inside a running command or rollout samples,
and at hundreds of pods each report costs the operator a parse and a decision.

A revision is one the operator acts on unless
- only the rollout report changed (samples while serving: the operator reads them once the drain has
  finished, and the drain takes its last sample before that), or
- a command is running and neither the boot, `fatal`, a Failed stage, the trainer's report nor the
  recovery state changed: its acceptance and its steps (paused, memory, released tags, an intermediate
  stage) change no decision until it finishes. The operator never re-sends a command the agent accepted
  (controller/conductor.py), so it does not need to see the acceptance either.
"""

from __future__ import annotations

from typing import Any

from rljob.api.agent import AgentState, CommandState, Stage

IGNORED = frozenset({"revision", "rollout"})
WHILE_RUNNING = ("boot_id", "fatal", "trainer", "recovery")


def operator_view(state: AgentState) -> dict[str, Any]:
    return state.model_dump(exclude=set(IGNORED))


def acted_on(before: dict[str, Any] | None, after: dict[str, Any]) -> bool:
    """Whether the change from `before` to `after` (operator_view of each) is one the operator acts on."""
    if before is None:
        return True
    if before == after:
        return False
    command = after.get("last_command")
    if command is not None and command.get("state") == CommandState.RUNNING:
        return after.get("stage") == Stage.FAILED or any(before.get(k) != after.get(k) for k in WHILE_RUNNING)
    return True


class OperatorReports:
    """`revision`: the last revision the operator acts on (the long-poll's `changes=operator`)."""

    def __init__(self) -> None:
        self.revision = 0
        self._view: dict[str, Any] | None = None

    def committed(self, state: AgentState) -> None:
        view = operator_view(state)
        if acted_on(self._view, view):
            self.revision = state.revision
        self._view = view
