"""The agent's stage moves, declared once: StateStore.change(stage=...) makes these and refuses any other.
A command's move is its row's in agent/actions.py; Failed is reachable from every stage and is final."""

from __future__ import annotations

from dataclasses import dataclass

from rljob.api.agent import Action, Stage


class IllegalMove(RuntimeError):
    """A stage change that no declared move allows: a bug in the agent, never an operator's mistake."""


@dataclass(frozen=True)
class Move:
    sources: frozenset[Stage]
    to: Stage


# Ready is a fresh server whose weights the operator has not verified yet: it may resume (already at the
# committed version), refit (rejoin at the committed version) or drain (suspend before rollout opened).
BY_ACTION: dict[Action, Move] = {
    Action.DRAIN: Move(frozenset({Stage.READY, Stage.SERVING, Stage.DRAINED}), Stage.DRAINED),
    Action.RELEASE: Move(frozenset({Stage.DRAINED}), Stage.RELEASED),
    Action.GRANT: Move(frozenset({Stage.RELEASED}), Stage.GRANTED),
    Action.REFIT: Move(frozenset({Stage.TRAINED, Stage.READY, Stage.SERVING, Stage.DRAINED}), Stage.REFITTED),
    Action.RESUME: Move(frozenset({Stage.REFITTED, Stage.DRAINED, Stage.READY}), Stage.SERVING),
}
SERVER_UP = Move(frozenset({Stage.STARTING}), Stage.READY)  # the engine answered (watch, recovery)
PUBLISHED = Move(frozenset({Stage.GRANTED}), Stage.TRAINED)  # the trainer returned the lease
REJOIN_PAUSED = Move(frozenset({Stage.READY, Stage.SERVING}), Stage.DRAINED)  # a refit pauses a live server
MOVES: tuple[Move, ...] = (*BY_ACTION.values(), SERVER_UP, PUBLISHED, REJOIN_PAUSED)


def allowed(source: Stage, to: Stage) -> bool:
    if source == Stage.FAILED:
        return False
    return to == Stage.FAILED or any(source in m.sources and to == m.to for m in MOVES)


def check_move(source: Stage, to: Stage) -> None:
    if not allowed(source, to):
        raise IllegalMove(f"the agent cannot move from stage {source.value} to {to.value}")
