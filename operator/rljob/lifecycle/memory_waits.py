"""A resume that waits for GPU memory, as people read it: the agent does not send a resume whose memory
another process holds (agent/headroom.py) and reports who holds it (AgentState.headroom); while any pod's
resume waits, status.reason is ResumeWaitingForMemory and status.message the agent's words, with one
Warning event when the wait begins. A trainer that still holds GPU memory after returning its lease is named
in a TrainerHoldsGpuMemory Warning once rollout reopens, whether or not a resume waited for it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from rljob.api.agent import AgentState
from rljob.api.status import MAX_MESSAGE
from rljob.lifecycle.model import EventReason, PodObservation

if TYPE_CHECKING:
    from rljob.lifecycle.step import Step

WAITING = EventReason.RESUME_WAITING_FOR_MEMORY.value


def memory_wait(agent: AgentState | None, epoch: int) -> str | None:
    """What the pod's resume of `epoch` waits for, or None when it does not wait."""
    h = agent.headroom if agent is not None else None
    return h.message if h is not None and h.waiting and h.epoch == epoch else None


def show_memory_waits(step: Step, waits: list[tuple[str, str]]) -> None:
    """`waits`: (pod, what it waits for) of every pod whose resume of this epoch waits, by index."""
    st = step.status
    if waits:
        pod, message = waits[0]
        more = f" (and {len(waits) - 1} more pods)" if len(waits) > 1 else ""
        text = f"{pod}: {message}{more}"[:MAX_MESSAGE]
        if st.reason != WAITING:
            step.event(EventReason.RESUME_WAITING_FOR_MEMORY, text, warning=True)
        st.reason, st.message = WAITING, text
    elif st.reason == WAITING:
        st.reason = EventReason.PHASE_CHANGED.value
        st.message = f"{st.phase.value}: the GPU memory the resume waited for is free"


def name_trainers_holding_memory(
    step: Step, gang: Iterable[tuple[PodObservation, AgentState | None]], epochs: set[int]
) -> None:
    """One Warning per pod whose last gated resume (of one of `epochs`) found its trainer holding memory."""
    for pod, agent in sorted(gang, key=lambda pa: pa[0].index):
        h = agent.headroom if agent is not None else None
        if h is not None and h.trainer_held and h.epoch in epochs:
            step.event(EventReason.TRAINER_HOLDS_GPU_MEMORY, f"{pod.name}: {h.trainer_held}", warning=True)
