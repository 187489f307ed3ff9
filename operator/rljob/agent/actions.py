"""The agent's command actions, a row each: its guards (the core's, then the engine's), what a leader does
to the engine (agent/operations.py), what a follower does on its own GPUs (agent/follower.py), and its
stage move (agent/stages.py). `Actions` checks and runs a command through its row; nothing else dispatches
on a command's action."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rljob.agent import engines
from rljob.agent.engines.base import EngineFacts, EngineGuards
from rljob.agent.follower import FollowerOperations
from rljob.agent.operations import Operations, Record
from rljob.agent.stages import BY_ACTION, Move
from rljob.agent.transitions import (
    follower_ready,
    grant_bookkeeping,
    leader_ready,
    no_bookkeeping,
    no_guard,
    no_inputs,
    refit_inputs,
    release_bookkeeping,
    resume_bookkeeping,
    stage_allows,
)
from rljob.api.agent import (
    Action,
    AgentState,
    Command,
    DrainCommand,
    GrantCommand,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
)

C = TypeVar("C")


Guard = Callable[[C, AgentState, EngineFacts], None]


@dataclass(frozen=True)
class ActionRow(Generic[C]):
    move: Move  # the stages it starts from, and the stage it ends in
    bookkeeping: Callable[[C, AgentState], None]  # refusals on the agent's own record, on every pod
    guards: Callable[[EngineGuards], Guard[C]]  # the leader's engine's: what would kill or fool it
    inputs: Callable[[C, AgentState], None]  # the leader's: what the command must carry, after the engine's
    lead: Callable[[Operations, C], Awaitable[Record]]  # the leader's engine calls
    follow: Callable[[FollowerOperations, C], Awaitable[Record]]  # a follower's checks of its own GPUs


ACTIONS: dict[Action, ActionRow[Any]] = {
    Action.DRAIN: ActionRow[DrainCommand](
        BY_ACTION[Action.DRAIN],
        no_bookkeeping,
        lambda g: g.drain,
        no_inputs,
        Operations.drain,
        FollowerOperations.follow_drain,
    ),
    Action.RELEASE: ActionRow[ReleaseCommand](
        BY_ACTION[Action.RELEASE],
        release_bookkeeping,
        lambda g: g.release,
        no_inputs,
        Operations.release,
        FollowerOperations.follow_release,
    ),
    Action.GRANT: ActionRow[GrantCommand](
        BY_ACTION[Action.GRANT],
        grant_bookkeeping,
        lambda g: no_guard,
        no_inputs,
        Operations.grant,
        Operations.grant,
    ),
    Action.REFIT: ActionRow[RefitCommand](
        BY_ACTION[Action.REFIT],
        no_bookkeeping,
        lambda g: g.refit,
        refit_inputs,
        Operations.refit,
        FollowerOperations.follow_refit,
    ),
    Action.RESUME: ActionRow[ResumeCommand](
        BY_ACTION[Action.RESUME],
        resume_bookkeeping,
        lambda g: g.resume,
        no_inputs,
        Operations.resume,
        FollowerOperations.follow_resume,
    ),
}


def check_leader(cmd: Command, state: AgentState, facts: EngineFacts | None) -> None:
    """Raise Refused (409, 403) when `cmd` must not run now on a leader; a pure function of the state."""
    row = ACTIONS[cmd.action]
    leader_ready(state, facts)
    assert facts is not None  # leader_ready refused a command before the engine reported its facts
    guards = engines.guards(facts.kind)
    guards.leader_ready(state, facts)
    stage_allows(cmd, state)
    row.bookkeeping(cmd, state)
    row.guards(guards)(cmd, state, facts)
    row.inputs(cmd, state)


def check_follower(cmd: Command, state: AgentState) -> None:
    """A follower's refusals: the stage order and its own record. The engine's guards are its leader's."""
    follower_ready(state)
    stage_allows(cmd, state)
    ACTIONS[cmd.action].bookkeeping(cmd, state)


class Actions:
    """A pod's commands through ACTIONS: a leader's (node rank 0, `Actions.leader`) or a follower's
    (`Actions.follower`). A refusal from `check` means nothing was sent to the engine."""

    def __init__(self, ops: Operations, follower: FollowerOperations | None) -> None:
        self.ops = ops
        self._follower = follower

    @classmethod
    def leader(cls, ops: Operations) -> Actions:
        return cls(ops, None)

    @classmethod
    def follower(cls, ops: FollowerOperations) -> Actions:
        return cls(ops, ops)

    def check(self, cmd: Command, state: AgentState, facts: EngineFacts | None) -> None:
        if self._follower is not None:
            check_follower(cmd, state)
        else:
            check_leader(cmd, state, facts)

    async def execute(self, cmd: Command) -> None:
        """The row's calls, then its record and its stage move in one revision."""
        row = ACTIONS[cmd.action]
        self.ops.warm_probe()
        if self._follower is not None:
            record = await row.follow(self._follower, cmd)
        else:
            record = await row.lead(self.ops, cmd)
        with self.ops.store.change(stage=row.move.to) as s:
            if record is not None:
                record(s)
