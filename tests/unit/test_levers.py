"""The lever table (lifecycle/levers.py) on crafted iterations: which levers fire, why, in which order;
and docs/profiling.md carries the same table and thresholds."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from rljob.api.status import (
    MAX_DIAGNOSIS,
    IterationReport,
    LeverName,
    PhaseSeconds,
    Signal,
    Unmeasured,
    UnmeasuredReason,
    Verdict,
)
from rljob.lifecycle import levers
from rljob.lifecycle.levers import THRESHOLDS, Thresholds, diagnose, lever_table_markdown
from rljob.lifecycle.profile import profile

ROOT = Path(__file__).resolve().parents[2]


def report(
    rollout: float = 8.0,
    training: float = 2.0,
    handoff: float = 0.0,
    overhead: float = 0.0,
    **signals: Any,
) -> IterationReport:
    """An iteration of `rollout` + `training` seconds (plus `handoff` split over the four command phases)
    with the measured signals given; every signal a rule reads defaults to a neutral, measured value."""
    seconds = PhaseSeconds(
        rollout=rollout,
        training=training,
        draining=handoff / 4,
        releasing=handoff / 4,
        refitting=handoff / 4,
        resuming=handoff / 4,
    )
    neutral: dict[str, Any] = dict(
        gpu_busy_fraction=0.65,
        mean_running_requests=16.0,
        mean_waiting_requests=0.0,
        prompt_tokens=10_000,
        cached_tokens=6_000,
        generation_tokens=20_000,
        cache_hit_rate=0.6,
        samples=128,
        roofline_fraction=0.6,
        decode_roofline_tokens_per_second=5000.0,
        generation_tokens_per_second=3000.0,
        tokens_per_second_per_gpu=1500.0,
    )
    wall = rollout + training + handoff
    share = rollout / (rollout + training) if rollout + training else None
    return IterationReport(
        iteration=1,
        seconds=seconds,
        control_overhead_seconds=overhead,
        wall_seconds=wall,
        rollout_share=share,
        **{**neutral, **signals},
    )


def names(r: IterationReport, t: Thresholds = THRESHOLDS) -> list[LeverName]:
    return [lv.lever for lv in diagnose(r, t)]


def test_a_neutral_rollout_bound_iteration_names_nothing() -> None:
    # busy between the idle and saturated thresholds, no queue, prefix reuse fine, no handoff cost
    assert names(report()) == []


def test_train_bound_names_the_trainer_only() -> None:
    r = report(rollout=2.0, training=8.0, gpu_busy_fraction=0.1, cache_hit_rate=0.0, cached_tokens=0)
    got = diagnose(r)
    assert [lv.lever for lv in got] == [LeverName.TRAINER]
    assert got[0].share == 0.8 and "training 8.00s = 80% of the iteration" in got[0].evidence
    assert profile(r) is not None and profile(r).verdict == Verdict.TRAIN_BOUND  # type: ignore[union-attr]


def test_half_idle_gpus_without_a_queue_want_more_concurrency() -> None:
    got = diagnose(report(gpu_busy_fraction=0.3, mean_running_requests=4.0, mean_waiting_requests=0.0))
    assert [lv.lever for lv in got] == [LeverName.ROLLOUT_CONCURRENCY]
    assert got[0].share == pytest.approx(0.8 * 0.7)
    assert "GPU busy 30% during rollout, 4.0 running and 0.0 waiting" in got[0].evidence


def test_a_queue_while_gpus_have_room_is_the_running_request_limit() -> None:
    got = names(report(gpu_busy_fraction=0.4, mean_running_requests=16.0, mean_waiting_requests=40.0))
    assert got == [LeverName.RUNNING_REQUEST_LIMIT]  # not concurrency: requests already wait


def test_saturated_gpus_want_capacity_and_a_slow_runtime_is_named_too() -> None:
    r = report(gpu_busy_fraction=0.95, mean_waiting_requests=20.0, roofline_fraction=0.1)
    got = diagnose(r)
    assert [lv.lever for lv in got] == [LeverName.ROLLOUT_CAPACITY, LeverName.RUNTIME_SPEED]
    assert "requests queue" in got[0].reason
    assert got[0].share == pytest.approx(0.8 * 0.95)
    assert got[1].share == pytest.approx(0.8 * 0.95 * 0.9)
    # a runtime close to the roofline is not the lever
    assert names(report(gpu_busy_fraction=0.95, roofline_fraction=0.5)) == [LeverName.ROLLOUT_CAPACITY]


def test_low_prefix_reuse_names_prompt_structure_sized_by_prefill_tokens() -> None:
    r = report(cache_hit_rate=0.05, prompt_tokens=10_000, cached_tokens=500, generation_tokens=9_500)
    got = diagnose(r)
    assert [lv.lever for lv in got] == [LeverName.PROMPT_STRUCTURE]
    assert got[0].share == pytest.approx(0.8 * 9_500 / (9_500 + 9_500))
    # too few prompt tokens to judge, or reuse above the threshold: nothing
    assert names(report(cache_hit_rate=0.0, prompt_tokens=100, cached_tokens=0)) == []
    assert names(report(cache_hit_rate=0.25)) == []


def test_handoff_and_control_overhead_above_their_shares() -> None:
    got = diagnose(report(rollout=4.0, training=4.0, handoff=2.0, overhead=0.5))
    by_name = {lv.lever: lv for lv in got}
    assert by_name[LeverName.WEIGHT_HANDOFF].share == 0.2
    assert by_name[LeverName.CONTROL_OVERHEAD].share == 0.05
    assert "0.500s of 10.00s = 5%" in by_name[LeverName.CONTROL_OVERHEAD].evidence
    assert names(report(handoff=1.0, overhead=0.2)) == []  # 1/11 and 0.2/11: below both


def test_balanced_gets_both_sides_ranked_by_share() -> None:
    r = report(rollout=5.0, training=5.0, gpu_busy_fraction=0.2)
    got = diagnose(r)
    assert [lv.lever for lv in got] == [LeverName.TRAINER, LeverName.ROLLOUT_CONCURRENCY]
    assert got[0].share == 0.5 and got[1].share == pytest.approx(0.5 * 0.8)


def test_missing_signals_are_named_last_not_judged() -> None:
    r = report(
        gpu_busy_fraction=None, prompt_tokens=None, cached_tokens=None, cache_hit_rate=None, samples=None
    )
    got = diagnose(r)
    assert [lv.lever for lv in got] == [LeverName.MEASUREMENT]
    assert "--enable-metrics" in got[0].reason and "GPU busy" in got[0].reason
    assert "handoff.report_rollout" in got[0].reason


def _off(*signals: Signal) -> list[Unmeasured]:
    return [
        Unmeasured(
            signal=s, reason=UnmeasuredReason.METRICS_DISABLED, message="SGLang runs without --enable-metrics"
        )
        for s in signals
    ]


def test_no_lever_is_ranked_from_an_unmeasured_signal() -> None:
    """Figures that would fire PromptStructure (no reuse) and RuntimeSpeed (far below the roofline), each
    listed as not measured: neither fires; Measurement names them, grouped by why."""
    prompts = dict(cache_hit_rate=0.0, prompt_tokens=10_000, cached_tokens=0, generation_tokens=9_500)
    assert LeverName.PROMPT_STRUCTURE in names(report(**prompts))  # measured: it fires
    got = diagnose(report(**prompts, unmeasured=_off(Signal.CACHE_HIT_RATE)))
    assert [lv.lever for lv in got] == [LeverName.MEASUREMENT]
    assert got[0].reason == (
        "not measured, so not judged: prefix-cache hit rate: SGLang runs without --enable-metrics"
    )
    runtime = dict(gpu_busy_fraction=0.95, roofline_fraction=0.1)
    assert LeverName.RUNTIME_SPEED in names(report(**runtime))
    off = _off(Signal.GENERATION_TOKENS_PER_SECOND, Signal.TOKEN_COUNTS)
    got = diagnose(report(**runtime, unmeasured=off))
    assert [lv.lever for lv in got] == [LeverName.ROLLOUT_CAPACITY, LeverName.MEASUREMENT]
    assert "generation tokens/s, token counts: SGLang runs without --enable-metrics" in got[1].reason
    assert "tok/s not measured" in got[0].evidence


def test_every_lever_reading_a_signal_is_held_back_by_it() -> None:
    """Each row's `reads`: a report on which the row fires stops firing once that signal is unmeasured."""
    fires: dict[LeverName, dict[str, Any]] = {
        LeverName.ROLLOUT_CONCURRENCY: dict(gpu_busy_fraction=0.3),
        LeverName.RUNNING_REQUEST_LIMIT: dict(gpu_busy_fraction=0.4, mean_waiting_requests=40.0),
        LeverName.ROLLOUT_CAPACITY: dict(gpu_busy_fraction=0.95),
        LeverName.RUNTIME_SPEED: dict(gpu_busy_fraction=0.95, roofline_fraction=0.1),
        LeverName.PROMPT_STRUCTURE: dict(cache_hit_rate=0.05, cached_tokens=500),
    }
    rows = {row.lever: row for row in levers.RULES}
    for lever, figures in fires.items():
        assert rows[lever].reads, lever
        assert lever in names(report(**figures)), lever
        for signal in rows[lever].reads:
            assert lever not in names(report(**figures, unmeasured=_off(signal))), (lever, signal)


def test_at_most_five_largest_first() -> None:
    r = report(
        rollout=5.0,
        training=4.0,
        handoff=3.0,
        overhead=1.0,
        gpu_busy_fraction=0.2,
        cache_hit_rate=0.0,
        cached_tokens=0,
        samples=None,
    )
    got = diagnose(r)
    assert len(got) == MAX_DIAGNOSIS
    shares = [lv.share or 0.0 for lv in got]
    assert shares == sorted(shares, reverse=True)
    assert LeverName.MEASUREMENT not in [lv.lever for lv in got]  # share 0: cut first


def test_thresholds_move_the_verdicts() -> None:
    r = report(gpu_busy_fraction=0.6)
    assert names(r) == []
    assert names(r, Thresholds(idle_gpu_busy=0.7)) == [LeverName.ROLLOUT_CONCURRENCY]
    assert names(r, Thresholds(saturated_gpu_busy=0.6)) == [LeverName.ROLLOUT_CAPACITY]


def test_the_two_e2e_workloads_get_different_first_levers() -> None:
    """tests/e2e/test_profile.py's two trainers, as numbers: many samples of one long shared prompt, one
    request at a time; many short unique prompts, all at once, behind a running-request limit."""
    shared = report(
        rollout=0.6,
        training=0.1,
        gpu_busy_fraction=0.12,
        mean_running_requests=14.0,
        mean_waiting_requests=0.0,
        prompt_tokens=8_300,
        cached_tokens=7_800,
        cache_hit_rate=0.94,
    )
    unique = report(
        rollout=1.6,
        training=0.1,
        gpu_busy_fraction=0.9,
        mean_running_requests=28.0,
        mean_waiting_requests=60.0,
        prompt_tokens=576,
        cached_tokens=0,
        cache_hit_rate=0.0,
        generation_tokens=9_216,
    )
    assert names(shared)[0] == LeverName.ROLLOUT_CONCURRENCY
    assert names(unique)[:1] == [LeverName.ROLLOUT_CAPACITY] and LeverName.PROMPT_STRUCTURE in names(unique)


def test_the_docs_mirror_the_table_and_every_threshold() -> None:
    doc = (ROOT / "docs/profiling.md").read_text()
    assert lever_table_markdown() in doc
    for f in fields(Thresholds):
        assert f"| `{f.name}` | {getattr(THRESHOLDS, f.name)} |" in doc, f.name
    assert len(levers.RULES) == len(LeverName)  # every lever has its row
