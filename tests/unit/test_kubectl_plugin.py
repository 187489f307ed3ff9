"""`kubectl rljob status` rendering, from a status the lifecycle machine produced."""

from __future__ import annotations

from datetime import datetime

from lifecycle_world import World, make_spec

from rljob.api.agent import AgentState, RolloutReport, Stage
from rljob.api.spec import ProfileHints
from rljob.api.status import LeverName, Phase, RLJobStatus, Signal, Unmeasured, UnmeasuredReason
from rljob.cli.kubectl_plugin import render
from rljob.lifecycle.clock import parse
from rljob.lifecycle.profile import record_iteration
from rljob.lifecycle.timeline import close_span, open_span, record_rollout_sample


def test_status_shows_timeline_pods_versions_and_verdict() -> None:
    world = World(make_spec(iterations=2))
    world.bring_up()
    world.run_iteration("1")
    world.run_iteration("2", held={"job-0": 12.5, "job-1": 17.25})
    text = render("job", "ns", world.status, {"iterations": 2})
    assert "Phase:      Succeeded (Completed)" in text
    assert "Iteration:  2 of 2" in text
    assert "Weights:    2" in text
    assert "Releasing" in text and "Refitting" in text  # the timeline
    assert "job-0" in text and "job-1" in text  # per-pod rows
    assert "Profile: TrainBound" in text
    assert "Weight history: 0 -> 1 -> 2" in text
    assert "CONTROL-OVERHEAD" in text
    # Training's row: the slowest pod's lease as its agent timed it, beside the span's wall time.
    training = [line.split() for line in text.splitlines() if line.split()[:2] == ["2", "Training"]]
    header = next(line.split() for line in text.splitlines() if line.startswith("ITER"))
    assert training and training[0][header.index("TRAINER")] == "17.25s", training


def _at(stamp: str) -> datetime:
    when = parse(stamp)
    assert when is not None
    return when


def test_status_of_a_job_without_metrics_says_what_was_not_measured() -> None:
    """Two agents whose SGLang ran without --enable-metrics (as agent/rollout.py reports it), through the
    operator's aggregation (timeline, profile, levers) into `kubectl rljob status`."""
    metrics_signals = [Signal.CACHE_HIT_RATE, Signal.GENERATION_TOKENS_PER_SECOND, Signal.TOKEN_COUNTS]
    off = [
        Unmeasured(
            signal=s, reason=UnmeasuredReason.METRICS_DISABLED, message="SGLang runs without --enable-metrics"
        )
        for s in metrics_signals
    ]
    rollout = RolloutReport(
        samples=4,
        window_seconds=6.0,
        gpus=1,
        gpu_busy_fraction=0.3,
        mean_running_requests=4.0,
        mean_waiting_requests=0.0,
        completed_samples=8,
        unmeasured=off,
    )
    agents = [AgentState(revision=1, boot_id=f"b{i}", stage=Stage.DRAINED, rollout=rollout) for i in (0, 1)]
    status = RLJobStatus(phase=Phase.TRAINING, iteration=1)
    open_span(status.timeline, Phase.ROLLOUT, 1, "2024-01-01T00:00:00Z")
    span = close_span(status.timeline, Phase.ROLLOUT, _at("2024-01-01T00:00:06Z"))
    assert span is not None
    record_rollout_sample(status.timeline, span, 1, agents)
    open_span(status.timeline, Phase.TRAINING, 1, "2024-01-01T00:00:06Z")
    close_span(status.timeline, Phase.TRAINING, _at("2024-01-01T00:00:08Z"))
    report = record_iteration(status, ProfileHints(model_bytes=16 << 30))
    assert report.cache_hit_rate is None and report.generation_tokens_per_second is None
    assert [u.signal for u in report.unmeasured] == metrics_signals
    assert [lv.lever for lv in status.diagnosis] == [LeverName.ROLLOUT_CONCURRENCY, LeverName.MEASUREMENT]
    text = render("job", "ns", status, {})
    assert "prefix-cache hit rate not measured, generation not measured" in text
    assert (
        "Not measured: prefix-cache hit rate, generation tokens/s, token counts (MetricsDisabled: SGLang"
        in text
    )
    assert "--enable-metrics" in text and "hit rate 0%" not in text
