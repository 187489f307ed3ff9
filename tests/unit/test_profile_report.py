"""`kubectl rljob profile` and the levers in `kubectl rljob status`: the terminal chart, the HTML report
(self-contained: inline SVG, no script, nothing fetched) and the status rendering, from statuses the
lifecycle machine produced or crafted ones."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from lifecycle_world import World, make_spec

from rljob.api.status import (
    MAX_ITERATION_HISTORY,
    IterationReport,
    Lever,
    LeverName,
    Phase,
    PhaseSeconds,
    PhaseSpan,
    RLJobStatus,
    RolloutTotals,
    Signal,
    Unmeasured,
    UnmeasuredReason,
)
from rljob.cli.kubectl_plugin import render
from rljob.cli.profile_report import html_report, nice_top, si, stack_bar, terminal_chart


def it(n: int, rollout: float, training: float, **signals: object) -> IterationReport:
    seconds = PhaseSeconds(
        rollout=rollout, draining=0.5, releasing=0.5, training=training, refitting=0.5, resuming=0.5
    )
    wall = rollout + training + 2.0
    return IterationReport(
        iteration=n,
        seconds=seconds,
        control_overhead_seconds=0.1,
        wall_seconds=wall,
        rollout_share=rollout / (rollout + training),
        **signals,  # type: ignore[arg-type]
    )


def status() -> RLJobStatus:
    history = [
        it(1, 6.0, 2.0, gpu_busy_fraction=0.9, cache_hit_rate=0.05, generation_tokens_per_second=1500.0),
        it(
            2,
            8.0,
            2.0,
            gpu_busy_fraction=0.95,
            cache_hit_rate=0.02,
            generation_tokens_per_second=1600.0,
            decode_roofline_tokens_per_second=4000.0,
            roofline_fraction=0.4,
            mean_running_requests=16.0,
            mean_waiting_requests=40.0,
            gpu_seconds_per_sample=0.05,
        ),
    ]
    diagnosis = [
        Lever(
            lever=LeverName.ROLLOUT_CAPACITY,
            reason="the GPUs are saturated <during> rollout",
            evidence="GPU busy 95%",
            share=0.66,
        ),
        Lever(lever=LeverName.PROMPT_STRUCTURE, reason="little prefix reuse", evidence="hit 2%", share=0.05),
    ]
    return RLJobStatus(
        phase=Phase.SUCCEEDED,
        iteration=2,
        weight_version="2",
        last_iteration=history[-1],
        iteration_history=history,
        diagnosis=diagnosis,
    )


def test_stack_bar_is_proportional_phase_by_phase() -> None:
    r = it(1, 6.0, 2.0)  # 6 rollout, 0.5 drain, 0.5 release, 2 train, 0.5 refit, 0.5 resume
    assert stack_bar(r, 0.5) == "R" * 12 + "D" + "L" + "T" * 4 + "F" + "S"
    bar = stack_bar(r, 10 / 48)  # the longest iteration fills 48 characters
    assert len(bar) == 48 and bar.count("R") == round(6 / (10 / 48))


def test_terminal_chart_has_a_row_per_iteration_and_the_levers() -> None:
    text = terminal_chart(status(), width=40)
    lines = text.splitlines()
    assert lines[0] == "Per-iteration profile (2 iterations)"
    header, row1, row2 = lines[1], lines[2], lines[3]
    assert "ROLLOUT%" in header and "GPU-BUSY" in header and "ROOFLINE" in header
    assert row1.startswith("1 ") and "90%" in row1 and "75%" in row1  # busy, rollout share
    assert row2.startswith("2 ") and "16.0/40.0" in row2 and "40%" in row2 and "0.05" in row2
    assert len(re.search(r"R+D*L*T+F*S*", row2).group(0)) == 40  # type: ignore[union-attr]  # the longest fills the width
    assert "1. RolloutCapacity (66% of the iteration): the GPUs are saturated <during> rollout" in text
    assert "measured: GPU busy 95%" in text
    assert terminal_chart(RLJobStatus()).startswith("No completed iteration yet")


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.attrs += attrs


def test_html_report_is_self_contained_with_four_plots() -> None:
    page = html_report("job", "ns", status())
    parser = _Tags()
    parser.feed(page)
    assert parser.tags.count("svg") == 4
    assert "script" not in parser.tags and "img" not in parser.tags and "link" not in parser.tags
    urls = [v for k, v in parser.attrs if k in ("src", "href") and v]
    assert urls == []  # nothing to fetch
    assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", page)  # only the SVG namespace
    assert "the GPUs are saturated &lt;during&gt; rollout" in page  # escaped
    assert page.count("<rect") >= 2 * 6  # a phase stack per iteration
    assert "<polyline" in page  # the roofline and the hit-rate lines
    assert "No completed iteration yet" in html_report("job", "ns", RLJobStatus())


def test_axis_tops_and_labels_are_round() -> None:
    assert [nice_top(v) for v in (4.03, 5290, 109, 1, 0)] == [5, 6000, 120, 1, 1.0]
    assert [si(v) for v in (1500, 2_000_000, 0.25, 30)] == ["1.5k", "2M", "0.25", "30"]


def test_status_shows_the_signals_and_levers_of_a_run() -> None:
    world = World(make_spec(iterations=2))
    world.bring_up()
    world.run_iteration("1")
    world.run_iteration("2")
    st = world.status
    assert [r.iteration for r in st.iteration_history] == [1, 2]
    assert st.last_iteration == st.iteration_history[-1]
    text = render("job", "ns", st, {"iterations": 2})
    assert "Levers (largest share of the last iteration first):" in text
    # the world's agents report no counters, GPU busy or samples: the diagnosis says so
    assert LeverName.MEASUREMENT in [lv.lever for lv in st.diagnosis]
    assert "Measurement" in text and "--enable-metrics" in text


def test_history_is_bounded() -> None:
    world = World(make_spec(iterations=MAX_ITERATION_HISTORY + 2))
    world.bring_up()
    for v in range(1, MAX_ITERATION_HISTORY + 3):
        world.run_iteration(str(v))
    history = world.status.iteration_history
    assert len(history) == MAX_ITERATION_HISTORY
    assert [r.iteration for r in history] == list(range(3, MAX_ITERATION_HISTORY + 3))


def _metrics_off_status() -> RLJobStatus:
    """An iteration whose SGLang ran without --enable-metrics, as lifecycle/signals.py leaves it."""
    off = [
        Unmeasured(
            signal=s, reason=UnmeasuredReason.METRICS_DISABLED, message="SGLang runs without --enable-metrics"
        )
        for s in (Signal.CACHE_HIT_RATE, Signal.GENERATION_TOKENS_PER_SECOND, Signal.TOKEN_COUNTS)
    ]
    report = it(1, 6.0, 2.0, gpu_busy_fraction=0.3, mean_running_requests=4.0, mean_waiting_requests=0.0)
    report.unmeasured = off
    span = PhaseSpan(
        phase=Phase.ROLLOUT,
        iteration=1,
        start_time="2024-01-01T00:00:00Z",
        seconds=6.0,
        rollout=RolloutTotals(pods=1, gpus=1, unmeasured=off),
    )
    measurement = Lever(lever=LeverName.MEASUREMENT, reason="not measured, so not judged: ...", share=0.0)
    return RLJobStatus(
        phase=Phase.SUCCEEDED,
        iteration=1,
        timeline=[span],
        last_iteration=report,
        iteration_history=[report],
        diagnosis=[measurement],
    )


def test_unmeasured_signals_read_not_measured_with_the_reason_everywhere() -> None:
    """Metrics off: `kubectl rljob status`, `kubectl rljob profile` and the HTML report say "not
    measured" and why, never a 0 % hit rate or a blank."""
    st = _metrics_off_status()
    text = render("job", "ns", st, {})
    assert "prefix-cache hit rate not measured, generation not measured" in text
    why = "(MetricsDisabled: SGLang runs without --enable-metrics)"
    assert f"  Not measured: prefix-cache hit rate, generation tokens/s, token counts {why}" in text
    rollout_row = next(line for line in text.splitlines() if line.split()[:2] == ["1", "Rollout"])
    assert rollout_row.count("not measured") == 2, rollout_row  # the CACHE-HIT and TOK/S cells
    assert " 0%" not in text and "hit rate 0" not in text
    chart = terminal_chart(st)
    row = chart.splitlines()[2]
    assert row.startswith("1 ") and row.count("n/m") == 3, row  # cache hit, tok/s, roofline
    assert (
        "  n/m, not measured: prefix-cache hit rate, generation tokens/s, token counts (MetricsDisabled"
        in chart
    )
    page = html_report("job", "ns", st)
    assert page.count('<td class="nm" title="MetricsDisabled: SGLang runs without --enable-metrics">') == 5
    assert "Not measured in the last iteration, so not judged" in page
    assert "<li>prefix-cache hit rate, generation tokens/s, token counts (MetricsDisabled: SGLang" in page
