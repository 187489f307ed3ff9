"""The core's guards of each command action (their rows: agent/actions.py): the stage order and the
agent's own record (the invariants of docs/lifecycle.md); the engine's own refusals are its guards
(agent/engines/base.py EngineGuards). Pure functions of the state: a refusal here means nothing was sent
to the engine."""

from __future__ import annotations

from rljob.agent.engines.base import EngineFacts
from rljob.agent.errors import conflict
from rljob.agent.stages import BY_ACTION
from rljob.api.agent import (
    AgentState,
    Command,
    GrantCommand,
    RefitCommand,
    ReleaseCommand,
    Stage,
)
from rljob.api.spec import RefitSource


def refit_path(cmd: RefitCommand, state: AgentState) -> str | None:
    """The checkpoint a disk refit loads: the command's path, else what the trainer published."""
    if cmd.path:
        return cmd.path
    return state.trainer.published_path if state.stage == Stage.TRAINED else None


def leader_ready(state: AgentState, facts: EngineFacts | None) -> None:
    """Refused while no command may run on the leader, whatever the action."""
    if state.stage == Stage.FAILED:
        raise conflict("AgentFailed", f"the pod must be replaced: {state.fatal}")
    if state.stage == Stage.STARTING or facts is None:
        raise conflict("NotReady", "the engine has not reported its launch facts yet")


def follower_ready(state: AgentState) -> None:
    """Refused while no command may run on a follower, whatever the action."""
    if state.stage == Stage.FAILED:
        raise conflict("AgentFailed", f"the pod must be replaced: {state.fatal}")
    if state.stage == Stage.STARTING:
        raise conflict("NotReady", "the engine's liveness has not answered yet")


def stage_allows(cmd: Command, state: AgentState) -> None:
    allowed = BY_ACTION[cmd.action].sources
    if state.stage not in allowed:
        raise conflict(
            "IllegalTransition",
            f"{cmd.action.value} is not allowed in stage {state.stage.value} "
            f"(only from {', '.join(sorted(s.value for s in allowed))})",
        )


def no_guard(cmd: Command, state: AgentState, facts: EngineFacts) -> None:
    """An action whose engine calls need no launch or version guard."""


def release_bookkeeping(cmd: ReleaseCommand, state: AgentState) -> None:
    if len(set(cmd.tags)) != len(cmd.tags):
        # Harmless to the engine (each part is sent once), but a malformed command: say so.
        raise conflict("DuplicateTag", "a tag appears twice in one release")
    again = [t.value for t in cmd.tags if t in state.released_tags]
    if again:
        raise conflict(
            "AlreadyReleased", f"already released: {', '.join(again)} (a second release may kill the engine)"
        )


def grant_bookkeeping(cmd: GrantCommand, state: AgentState) -> None:
    if not state.memory.verified:
        raise conflict("NotVerified", "freed GPU memory was not verified on every GPU")


def resume_bookkeeping(cmd: Command, state: AgentState) -> None:
    if state.engine.unloaded is not None:
        # Serving now would run on weights the engine cannot use (garbage, or layers a failed load left
        # unbuilt): a refit that completes a load comes first.
        raise conflict("WeightsNotLoaded", f"{state.engine.unloaded}; refit before resuming")


def no_bookkeeping(cmd: Command, state: AgentState) -> None:
    """An action whose legality is its stage alone."""


def no_inputs(cmd: Command, state: AgentState) -> None:
    """An action that needs nothing from the command beyond its fields."""


def refit_inputs(cmd: RefitCommand, state: AgentState) -> None:
    if cmd.source == RefitSource.DISK and not cmd.reload and refit_path(cmd, state) is None:
        raise conflict(
            "NoPath", "disk refit needs a path: none in the command and none published by the trainer"
        )
