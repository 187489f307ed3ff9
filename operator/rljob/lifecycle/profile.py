"""Where the wall-clock of an iteration went: per-phase seconds, control overhead, the rollout signals of
docs/profiling.md (lifecycle/signals.py), a verdict on whether rollout or training is the lever to pull,
and the ranked levers (lifecycle/levers.py). Seed 004: profile before you tune."""

from __future__ import annotations

from rljob.api.spec import ProfileHints
from rljob.api.status import (
    MAX_ITERATION_HISTORY,
    IterationReport,
    Phase,
    PhaseSeconds,
    PhaseSpan,
    Profile,
    RLJobStatus,
    RolloutTotals,
    Verdict,
)
from rljob.lifecycle import levers, signals

# Phases the operator drives agents in: wall time minus the slowest agent's own is the control plane's.
COMMAND_PHASES = ("Draining", "Releasing", "Refitting", "Resuming")
ROLLOUT_BOUND_SHARE = levers.THRESHOLDS.rollout_bound_share
TRAIN_BOUND_SHARE = levers.THRESHOLDS.train_bound_share


def iteration_report(
    iteration: int, timeline: list[PhaseSpan], hints: ProfileHints | None = None
) -> IterationReport:
    spans = [s for s in timeline if s.iteration == iteration and s.seconds is not None]
    seconds = PhaseSeconds()
    overhead = 0.0
    freed = 0
    hit_rate: float | None = None
    tokens: float | None = None
    totals: RolloutTotals | None = None
    for span in spans:
        key = span.phase.value.lower()
        if hasattr(seconds, key):
            setattr(seconds, key, round(getattr(seconds, key) + (span.seconds or 0.0), 6))
        if span.phase.value in COMMAND_PHASES and span.agent_seconds is not None:
            overhead += max(0.0, (span.seconds or 0.0) - span.agent_seconds)
        freed += span.freed_bytes or 0
        if span.cache_hit_rate is not None:
            hit_rate = span.cache_hit_rate
        if span.tokens_per_second is not None:
            tokens = span.tokens_per_second
        if span.phase == Phase.ROLLOUT and span.rollout is not None:
            totals = span.rollout
    report = IterationReport(
        iteration=iteration,
        seconds=seconds,
        control_overhead_seconds=round(overhead, 6),
        freed_bytes=freed,
        cache_hit_rate=hit_rate,
        generation_tokens_per_second=tokens,
    )
    signals.fill_signals(report, totals, hints or ProfileHints())
    return report


def profile(report: IterationReport) -> Profile | None:
    busy = report.seconds.rollout + report.seconds.training
    if busy <= 0:
        return None
    share = report.seconds.rollout / busy
    if share > ROLLOUT_BOUND_SHARE:
        verdict = Verdict.ROLLOUT_BOUND
    elif share < TRAIN_BOUND_SHARE:
        verdict = Verdict.TRAIN_BOUND
    else:
        verdict = Verdict.BALANCED
    return Profile(rollout_share=round(share, 4), rollout_percent=round(share * 100), verdict=verdict)


def record_iteration(status: RLJobStatus, hints: ProfileHints) -> IterationReport:
    """The iteration just completed, into status: its report (last and in the bounded history), the
    verdict and the diagnosis. The history list is replaced, not appended to: decide works on a shallow
    copy of its input status."""
    report = iteration_report(status.iteration, status.timeline, hints)
    status.last_iteration = report
    history = [r for r in status.iteration_history if r.iteration != report.iteration]
    status.iteration_history = [*history, report][-MAX_ITERATION_HISTORY:]
    status.profile = profile(report) or status.profile
    status.diagnosis = levers.diagnose(report)
    return report
