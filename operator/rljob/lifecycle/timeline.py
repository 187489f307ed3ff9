"""Bookkeeping the machine does at each phase change: the timeline spans `kubectl rljob status` prints
(and profile.py sums per iteration), and the per-pod entries of status.pods. Pure functions over the
status' lists; nothing here decides what the job does next."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime

from rljob.api.agent import Action, AgentState, CommandState
from rljob.api.status import MAX_MESSAGE, MAX_PODS_IN_STATUS, MAX_TIMELINE, Phase, PhaseSpan, PodStatus
from rljob.lifecycle import signals
from rljob.lifecycle.clock import seconds_between
from rljob.lifecycle.model import PodObservation
from rljob.lifecycle.weights import describe as describe_weights

SpanRecord = Callable[[list[PhaseSpan], PhaseSpan, int, Sequence[AgentState]], None]
"""Numbers a phase's span keeps when it closes: (timeline, closed span, iteration, gang agents)."""


def open_span(timeline: list[PhaseSpan], phase: Phase, iteration: int, now: str) -> None:
    """Start a span for `phase`; the timeline keeps the newest MAX_TIMELINE spans."""
    timeline.append(PhaseSpan(phase=phase, iteration=iteration, start_time=now))
    del timeline[:-MAX_TIMELINE]


def close_span(timeline: list[PhaseSpan], phase: Phase, now: datetime) -> PhaseSpan | None:
    """Stamp the open span of `phase` with its wall time; the span closed, or None when none was open.

    The span is replaced by a copy before it is written: the machine's status is a shallow copy of its
    input, and the input must stay as it was (decide is pure)."""
    if not timeline or timeline[-1].seconds is not None or timeline[-1].phase != phase:
        return None
    span = timeline[-1].model_copy()
    span.seconds = round(seconds_between(span.start_time, now), 6)
    timeline[-1] = span
    return span


def slowest_agent_seconds(agents: Iterable[AgentState], epoch: int, action: Action) -> float | None:
    """The slowest pod's time inside its agent for this epoch's command: the rest of the span's wall
    time is what the control plane cost."""
    own = [
        a.last_command.seconds
        for a in agents
        if a.last_command is not None
        and a.last_command.epoch == epoch
        and a.last_command.action == action
        and a.last_command.seconds is not None
    ]
    return round(max(own), 6) if own else None


def record_freed_bytes(
    timeline: list[PhaseSpan], span: PhaseSpan, iteration: int, agents: Sequence[AgentState]
) -> None:
    """Releasing: the memory every pod freed, summed."""
    span.freed_bytes = sum(a.memory.freed_bytes for a in agents)


def record_trainer_seconds(
    timeline: list[PhaseSpan], span: PhaseSpan, iteration: int, agents: Sequence[AgentState]
) -> None:
    """Training: the longest any pod's trainer held the GPU under this grant (its agent's grant to the
    publish), the user's part of the span as agent_seconds is the agents' part of the others."""
    held = [
        a.trainer.held_seconds
        for a in agents
        if a.trainer.held_seconds is not None and a.trainer.published_epoch == a.epoch
    ]
    span.trainer_seconds = round(max(held), 6) if held else None


def record_rollout_sample(
    timeline: list[PhaseSpan], span: PhaseSpan, iteration: int, agents: Sequence[AgentState]
) -> None:
    """Rollout and Draining: the agent takes its last rollout sample as the drain starts, so the numbers
    are read at the end of Draining too, and kept on this iteration's Rollout span (with the gang's
    RolloutTotals, from which the iteration's report is made)."""
    at = next(
        (
            i
            for i in range(len(timeline) - 1, -1, -1)
            if timeline[i].phase == Phase.ROLLOUT and timeline[i].iteration == iteration
        ),
        None,
    )
    if at is None:
        return
    rates = [a.rollout.cache_hit_rate for a in agents if a.rollout.cache_hit_rate is not None]
    tps = [
        a.rollout.generation_tokens_per_second
        for a in agents
        if a.rollout.generation_tokens_per_second is not None
    ]
    totals = signals.rollout_totals(agents)
    if not rates and not tps and totals is None:
        return
    rollout = timeline[at] if timeline[at] is span else timeline[at].model_copy()  # copy before writing
    timeline[at] = rollout
    if rates:
        rollout.cache_hit_rate = round(sum(rates) / len(rates), 6)
    if tps:
        rollout.tokens_per_second = round(sum(tps), 3)
    if totals is not None:
        rollout.rollout = totals
        hit = signals.prefix_hit_rate(totals)
        if hit is not None:  # the whole rollout's, token-weighted, over the last batches'
            rollout.cache_hit_rate = hit
        if totals.generation_tokens_per_second is not None:
            rollout.tokens_per_second = totals.generation_tokens_per_second


def gpu_summary(agent: AgentState) -> str | None:
    """`Container: 2 GPU(s)`, `Process: GPU-a,GPU-b`, `Unknown: why` (agent/gpu_scope.py)."""
    g = agent.gpus
    if g is None:
        return None
    if g.reason:
        return f"{g.scope.value}: {g.reason}"[:MAX_MESSAGE]
    what = ",".join(g.devices) if g.devices else f"{g.gpus if g.gpus is not None else '?'} GPU(s)"
    return f"{g.scope.value}: {what}"[:MAX_MESSAGE]


def _held(agent: AgentState) -> tuple[str, str, str] | None:
    w = agent.engine.weights
    if w is None or w.checksum is None or w.version is None or w.layout is None:
        return None
    return w.version, w.layout, w.checksum


def pod_entries(gang: Iterable[tuple[PodObservation, AgentState | None]]) -> list[PodStatus]:
    """status.pods: one entry per gang member (by index, at most MAX_PODS_IN_STATUS), as its agent last
    reported. Refreshed at phase changes only, so status writes per iteration stay constant whatever
    the number of pods."""
    entries = []
    members = sorted(gang, key=lambda pa: pa[0].index)[:MAX_PODS_IN_STATUS]
    # Pods holding one checksum at one version in one layout vouch for each other (lifecycle/weights.py).
    same = Counter(_held(a) for _, a in members if a is not None and _held(a) is not None)
    for pod, agent in members:
        # One constructor call per entry, not field by field: this runs for every pod at every phase change.
        if agent is None:
            entries.append(PodStatus(name=pod.name, stage="Unreachable", last_error=pod.broken or None))
            continue
        cmd = agent.last_command
        failed = cmd is not None and cmd.state == CommandState.FAILED
        w, key = agent.engine.weights, _held(agent)
        entries.append(
            PodStatus(
                name=pod.name,
                stage=agent.stage.value,
                engine=f"{agent.engine.kind.label} {agent.engine.version or ''}".rstrip(),
                weight_version=agent.engine.served_version,
                weights_checksum=w.checksum if w is not None else None,
                weights=describe_weights(w, same[key] - 1 if key is not None else 0),
                released_tags=list(agent.released_tags),
                freed_bytes=agent.memory.freed_bytes,
                gpus=gpu_summary(agent),
                last_error=pod.broken or agent.fatal or (cmd.error if failed and cmd else None),
            )
        )
    return entries
