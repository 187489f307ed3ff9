"""A trainer container that exited 0 has finished, not failed (docs/lifecycle.md, "When trainers finish").

Its pod stays a gang member while the iteration in flight no longer needs its trainer: before it asked for
the GPU, or once it returned the lease (published, or gave it back without new weights) and, for a pushed
refit, closed its refit window. A trainer that exits 0 while it asked for the GPU, holds the lease or
leaves its refit window open leaves an iteration that cannot complete: that pod is lost, as with any other
exit. Any other container that exits 0 (the engine, the agent) is lost too."""

from __future__ import annotations

from rljob.api.agent import AgentState
from rljob.api.status import Phase
from rljob.lifecycle.evidence import Evidence
from rljob.lifecycle.model import PodObservation

ASKED = "asked for the GPU"  # the trainer's request the finished trainer left behind


def trainer_finished(pod: PodObservation, trainer: str) -> bool:
    """The pod's trainer container (spec.trainer.container) exited 0."""
    return trainer in pod.completed


def unclean_finish(
    pod: PodObservation,
    agent: AgentState | None,
    trainer: str,
    phase: Phase,
    epoch: int,
    stopping: bool,
) -> str | None:
    """Why a container of `pod` that exited 0 makes it a lost member, or None when none does."""
    others = [c for c in pod.completed if c != trainer]
    if others:
        return f"container {others[0]} terminated (exit 0, Completed)"
    if not trainer_finished(pod, trainer) or stopping:
        return None
    why = f"its trainer finished (exit 0) after it {ASKED}"
    if phase in (Phase.DRAINING, Phase.RELEASING):
        return f"{why}: the iteration in flight cannot complete"
    if phase == Phase.ROLLOUT and agent is not None and agent.trainer.requested:
        return f"{why}: the iteration in flight cannot complete"
    returned = agent is not None and Evidence.LEASE_RETURNED.shown_by(agent, epoch, None)
    if phase == Phase.TRAINING and not returned:
        return "its trainer finished (exit 0) holding the GPU lease, without weights or giving it back"
    window = agent.trainer.refit_window_version if agent is not None else None
    if phase == Phase.REFITTING and window is not None:
        # Only the trainer pushes into its window and closes it: nobody will, so the refit cannot finish.
        return f"its trainer finished (exit 0) with its refit window of weights {window} open"
    return None


def with_refusal(why: str, pod: PodObservation, agent: AgentState | None, trainer: str) -> str:
    """`why` a member is lost, with the reason the agent gave its trainer's last refused call when the
    trainer is what ended (a framework exits on a refusal; the CR is where its user reads why)."""
    refusal = agent.trainer.last_refusal if agent is not None else None
    if refusal and (f"container {trainer} " in why or trainer_finished(pod, trainer)):
        return f"{why}; the agent last refused its trainer: {refusal}"
    return why
