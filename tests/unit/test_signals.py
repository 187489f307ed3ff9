"""The signals of docs/profiling.md, one by one on crafted numbers: the agent's rollout window (time
weighting, counter increases, busy fraction), the gang's totals, and the iteration's derived signals."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from rljob.agent import rollout as rollout_module
from rljob.agent.engines.base import EngineError
from rljob.agent.engines.sglang.engine import SGLangEngine
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.engines.sglang.metrics import parse_metrics
from rljob.agent.gpu_probe import GpuMemory
from rljob.agent.rollout import RolloutSampler
from rljob.agent.state import StateStore
from rljob.api.agent import AgentState, RolloutReport, Stage
from rljob.api.spec import ProfileHints
from rljob.api.status import (
    MAX_UNMEASURED,
    IterationReport,
    Phase,
    PhaseSeconds,
    PhaseSpan,
    RolloutTotals,
    Signal,
    Unmeasured,
    UnmeasuredReason,
)
from rljob.emulator.probe import EmulatorProbe
from rljob.lifecycle import signals
from rljob.lifecycle.profile import iteration_report

# --- /metrics -----------------------------------------------------------------------------------------


def test_parse_metrics_sums_label_sets_and_reads_past_labels_with_spaces() -> None:
    text = "\n".join(
        [
            "# TYPE sglang:prompt_tokens counter",
            'sglang:prompt_tokens_total{model_name="m",is_streaming="false"} 100.0',
            'sglang:prompt_tokens_total{model_name="m",is_streaming="true"} 20.0',
            'sglang:cached_tokens_total{model_name="a b} c",cache_source="device"} 60.0',
            'sglang:cached_tokens_total{model_name="m",cache_source="host"} 5.0',
            'sglang:num_running_reqs{tp_rank="0",dp_rank="0"} 3.0',
            'sglang:num_running_reqs{tp_rank="0",dp_rank="1"} 4.0',
            "sglang:generation_tokens_total 7",
            'sglang:token_usage{tp_rank="0"} 0.5',  # not read
            "sglang:num_queue_reqs{} not-a-number",
        ]
    )
    got = parse_metrics(text)
    assert got == {
        "sglang:prompt_tokens_total": 120.0,
        "sglang:cached_tokens_total": 65.0,
        "sglang:num_running_reqs": 7.0,
        "sglang:generation_tokens_total": 7.0,
    }


# --- the agent's rollout window ---------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t


class FakeClient:
    """The load route and /metrics as the sampler reads them, set by the test between samples."""

    def __init__(self) -> None:
        self.load_value: dict[str, float | None] = {}
        self.counters: dict[str, float] | None = {}  # None: a 404 (no --enable-metrics)
        self.metrics_error: EngineError | None = None

    async def load(self, timeout: float = 5.0) -> dict[str, float | None]:
        return dict(self.load_value)

    async def metrics(self, timeout: float = 5.0) -> dict[str, float] | None:
        if self.metrics_error is not None:
            raise self.metrics_error
        return None if self.counters is None else dict(self.counters)


class FakeProbe:
    def __init__(self) -> None:
        self.busy: list[float] | None = None

    async def sample(self) -> list[GpuMemory]:
        return [GpuMemory(0, 1, 2, name="NVIDIA H200"), GpuMemory(1, 1, 2, name="NVIDIA H200")]

    async def utilization(self) -> list[float] | None:
        return self.busy


def _load(running: float, waiting: float) -> dict[str, float | None]:
    return {"cache_hit_rate": 0.25, "gen_throughput": 10.0, "running": running, "waiting": waiting}


def test_sampler_weights_samples_by_time_and_counts_from_the_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = FakeClock()
    monkeypatch.setattr(rollout_module, "time", SimpleNamespace(monotonic=clock.monotonic))

    async def run() -> RolloutReport:
        store = StateStore()
        store.facts = SGLangFacts(
            version="0.5.23",
            weight_cache_mode="off",
            memory_saver=True,
            weights_cpu_backup=False,
            dp_size=1,
            tp_size=2,
        )
        client, probe = FakeClient(), FakeProbe()
        sampler = RolloutSampler(store, SGLangEngine(client), 1.0, 0.0, probe=probe)  # type: ignore[arg-type]
        client.counters = {"sglang:prompt_tokens_total": 1000.0, "sglang:generation_tokens_total": 50.0}
        await sampler.begin()  # at t=100, before Serving: the baseline
        with store.change() as s:
            s.stage, s.rollout = Stage.SERVING, RolloutReport()
        clock.t = 101.0  # 1 s of 4 running, none waiting, GPUs 20% and 40% busy
        client.load_value, probe.busy = _load(4, 0), [0.2, 0.4]
        client.counters = {
            "sglang:prompt_tokens_total": 1400.0,
            "sglang:cached_tokens_total": 300.0,  # first bump: absent at the baseline, so from 0
            "sglang:generation_tokens_total": 250.0,
        }
        await sampler.sample()
        clock.t = 104.0  # 3 s of 8 running and 4 waiting, GPUs fully busy
        client.load_value, probe.busy = _load(8, 4), [1.0, 1.0]
        client.counters = {
            "sglang:prompt_tokens_total": 2000.0,
            "sglang:cached_tokens_total": 900.0,
            "sglang:generation_tokens_total": 850.0,
        }
        await sampler.final_sample()
        return store.state.rollout

    r = asyncio.run(run())
    assert r.samples == 2 and r.window_seconds == 4.0
    assert r.mean_running_requests == (4 * 1 + 8 * 3) / 4  # 7.0
    assert r.mean_waiting_requests == (0 * 1 + 4 * 3) / 4  # 3.0
    assert r.gpu_busy_fraction == pytest.approx((0.3 * 1 + 1.0 * 3) / 4)
    assert (r.prompt_tokens, r.cached_tokens, r.generation_tokens) == (1000, 900, 800)
    assert r.gpus == 2 and r.gpu_name == "NVIDIA H200" and r.tp_size == 2
    assert r.cache_hit_rate == 0.25 and r.generation_tokens_per_second == 10.0  # the load route's, kept


def _sample_once(
    monkeypatch: pytest.MonkeyPatch, client: FakeClient, load: dict[str, float | None]
) -> RolloutReport:
    """A baseline, then one sample of `load` two seconds later, with a probe that reads no busy time."""
    clock = FakeClock()
    monkeypatch.setattr(rollout_module, "time", SimpleNamespace(monotonic=clock.monotonic))

    async def run() -> RolloutReport:
        store = StateStore()
        sampler = RolloutSampler(store, SGLangEngine(client), 1.0, 0.0, probe=FakeProbe())  # type: ignore[arg-type]
        await sampler.begin()
        with store.change() as s:
            s.stage, s.rollout = Stage.SERVING, RolloutReport()
        clock.t = 102.0
        client.load_value = load
        await sampler.sample()
        return store.state.rollout

    return asyncio.run(run())


def test_sampler_without_metrics_or_busy_reports_none_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeClient()
    client.counters = None  # no --enable-metrics: /metrics is a 404
    r = _sample_once(monkeypatch, client, _load(2, 0))
    assert r.samples == 1 and r.mean_running_requests == 2.0
    assert r.prompt_tokens is None and r.gpu_busy_fraction is None


def test_sampler_without_metrics_takes_no_load_rate_as_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """C-METRIC-OFF: without --enable-metrics /v1/loads reports cache_hit_rate and gen_throughput as
    SchedulerStats' 0.0 defaults; the report leaves them unset and says why."""
    client = FakeClient()
    client.counters = None
    load: dict[str, float | None] = {"cache_hit_rate": 0.0, "gen_throughput": 0.0, "running": 3, "waiting": 1}
    r = _sample_once(monkeypatch, client, load)
    assert r.cache_hit_rate is None and r.generation_tokens_per_second is None
    assert r.mean_running_requests == 3.0 and r.mean_waiting_requests == 1.0  # the counts are measured
    assert [(u.signal, u.reason) for u in r.unmeasured] == [
        (Signal.CACHE_HIT_RATE, UnmeasuredReason.METRICS_DISABLED),
        (Signal.GENERATION_TOKENS_PER_SECOND, UnmeasuredReason.METRICS_DISABLED),
        (Signal.TOKEN_COUNTS, UnmeasuredReason.METRICS_DISABLED),
    ]
    assert all("--enable-metrics" in u.message for u in r.unmeasured)
    # the same rates with /metrics served are SGLang's measurement
    client = FakeClient()
    measured = _sample_once(monkeypatch, client, {**load, "cache_hit_rate": 0.0, "gen_throughput": 5.0})
    assert measured.cache_hit_rate == 0.0 and measured.generation_tokens_per_second == 5.0
    assert measured.unmeasured == []


def test_unmeasured_has_room_for_every_signal_and_names_a_missing_baseline() -> None:
    assert len(Signal) <= MAX_UNMEASURED
    # an agent restarted mid-rollout whose /metrics answers: no baseline yet, so no increase
    (entry,) = RolloutSampler._unmeasured(RolloutReport(), None)
    assert (entry.signal, entry.reason) == (Signal.TOKEN_COUNTS, UnmeasuredReason.NOT_REPORTED)
    assert "baseline" in entry.message
    assert RolloutSampler._unmeasured(RolloutReport(prompt_tokens=0), None) == []


def test_sampler_whose_metrics_do_not_answer_lacks_only_the_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeClient()
    client.metrics_error = EngineError("metrics", 500, "boom")
    r = _sample_once(monkeypatch, client, _load(2, 0))
    assert r.cache_hit_rate == 0.25 and r.generation_tokens_per_second == 10.0  # /metrics exists: measured
    assert r.prompt_tokens is None
    assert [(u.signal, u.reason) for u in r.unmeasured] == [
        (Signal.TOKEN_COUNTS, UnmeasuredReason.METRICS_UNANSWERED)
    ]


def test_emulator_probe_turns_cumulative_busy_seconds_into_a_fraction() -> None:
    replies = iter(
        [
            {
                "monotonic": 10.0,
                "gpus": [{"index": 0, "busy_seconds": 1.0}, {"index": 1, "busy_seconds": 0.0}],
            },
            {
                "monotonic": 12.0,
                "gpus": [{"index": 0, "busy_seconds": 2.5}, {"index": 1, "busy_seconds": 2.0}],
            },
        ]
    )

    class Client:
        async def get_json(self, operation: str, path: str, timeout: float = 5.0) -> Any:
            assert path == "/_emulator/utilization"
            return next(replies)

    probe = EmulatorProbe(Client())  # type: ignore[arg-type]

    async def run() -> tuple[list[float] | None, list[float] | None]:
        return await probe.utilization(), await probe.utilization()

    first, second = asyncio.run(run())
    assert first is None  # the first call starts the interval
    assert second == [0.75, 1.0]


# --- the gang's totals ------------------------------------------------------------------------------


def _agent(**rollout: Any) -> AgentState:
    return AgentState(revision=1, boot_id="b", stage=Stage.DRAINED, rollout=RolloutReport(**rollout))


def test_rollout_totals_sum_pods_weight_busy_by_gpus_and_add_per_pod_rates() -> None:
    a = _agent(
        samples=5,
        window_seconds=2.0,
        gpus=1,
        gpu_name="NVIDIA H100 80GB HBM3",
        tp_size=1,
        gpu_busy_fraction=0.9,
        prompt_tokens=1000,
        cached_tokens=800,
        generation_tokens=400,
        mean_running_requests=8.0,
        mean_waiting_requests=1.0,
        completed_samples=16,
    )
    b = _agent(
        samples=4,
        window_seconds=4.0,
        gpus=3,
        gpu_busy_fraction=0.5,
        prompt_tokens=1000,
        cached_tokens=0,
        generation_tokens=400,
        mean_running_requests=4.0,
        mean_waiting_requests=0.0,
        completed_samples=16,
    )
    never_sampled = _agent(samples=0, gpus=8, gpu_busy_fraction=0.0, generation_tokens=10**6)
    t = signals.rollout_totals([a, b, never_sampled])
    assert t is not None
    assert (t.pods, t.gpus, t.window_seconds) == (2, 4, 4.0)
    assert t.gpu_busy_fraction == pytest.approx((0.9 * 1 + 0.5 * 3) / 4)
    assert (t.prompt_tokens, t.cached_tokens, t.generation_tokens) == (2000, 800, 800)
    assert t.generation_tokens_per_second == 400 / 2 + 400 / 4
    assert (t.mean_running_requests, t.mean_waiting_requests, t.samples) == (12.0, 1.0, 32)
    assert t.gpu_name == "NVIDIA H100 80GB HBM3" and t.tp_size == 1
    assert signals.prefix_hit_rate(t) == 0.4
    assert signals.rollout_totals([never_sampled]) is None
    assert signals.rollout_totals([_agent(samples=1)]) == RolloutTotals(pods=1)  # nothing else measured


def _off(signal: Signal) -> Unmeasured:
    return Unmeasured(signal=signal, reason=UnmeasuredReason.METRICS_DISABLED, message="no --enable-metrics")


def test_rollout_totals_list_a_signal_unmeasured_only_where_no_pod_measured_it() -> None:
    off = [_off(Signal.CACHE_HIT_RATE), _off(Signal.TOKEN_COUNTS)]
    a = _agent(samples=2, window_seconds=1.0, mean_running_requests=2.0, unmeasured=off)
    b = _agent(samples=2, window_seconds=1.0, mean_running_requests=2.0, unmeasured=off[1:])
    t = signals.rollout_totals([a, b])
    assert t is not None and t.unmeasured == off[1:]  # b measured the hit rate
    t = signals.rollout_totals([a, a])
    assert t is not None and t.unmeasured == off


def test_prefix_hit_rate_needs_prompt_tokens() -> None:
    assert signals.prefix_hit_rate(None) is None
    assert signals.prefix_hit_rate(RolloutTotals(prompt_tokens=0, cached_tokens=0)) is None
    assert signals.prefix_hit_rate(RolloutTotals(prompt_tokens=400, cached_tokens=None)) is None
    assert signals.prefix_hit_rate(RolloutTotals(prompt_tokens=400, cached_tokens=100)) == 0.25


# --- hardware -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bandwidth"),
    [
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA H100 80GB HBM3", 3.35e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA A100-SXM4-80GB", 2.039e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12),
        ("NVIDIA L40S", 0.864e12),
        ("NVIDIA L4", 0.3e12),
        ("NVIDIA GH200 480GB", None),  # two memory configurations under one name: ask the user
        ("Some Other GPU", None),
        (None, None),
    ],
)
def test_gpu_bandwidth_by_name(name: str | None, bandwidth: float | None) -> None:
    assert signals.gpu_bandwidth(name) == bandwidth


def test_decode_roofline_is_running_times_bandwidth_over_bytes_per_gpu() -> None:
    # 8 running requests, 4.8 TB/s, 16 GB of weights over TP=2: each step reads 8 GB on each GPU in
    # 1/600 s and advances 8 requests: 4800 tokens/s.
    assert signals.decode_roofline(8, 4_800_000_000_000, 16_000_000_000, 2) == pytest.approx(4800)
    assert signals.decode_roofline(8, 4_800_000_000_000, 16_000_000_000, None) == pytest.approx(2400)
    assert signals.decode_roofline(0, 4_800_000_000_000, 16_000_000_000, 1) is None
    assert signals.decode_roofline(8, None, 16_000_000_000, 1) is None
    assert signals.decode_roofline(8, 4_800_000_000_000, None, 1) is None


# --- the iteration ------------------------------------------------------------------------------------


def _seconds() -> PhaseSeconds:
    return PhaseSeconds(rollout=6.0, draining=0.5, releasing=0.5, training=2.0, refitting=0.5, resuming=0.5)


def _totals(**over: Any) -> RolloutTotals:
    base: dict[str, Any] = dict(
        pods=2,
        gpus=2,
        gpu_name="NVIDIA H200",
        tp_size=1,
        window_seconds=6.0,
        gpu_busy_fraction=0.5,
        prompt_tokens=4000,
        cached_tokens=3000,
        generation_tokens=6000,
        generation_tokens_per_second=1000.0,
        mean_running_requests=10.0,
        mean_waiting_requests=0.0,
        samples=100,
    )
    return RolloutTotals(**{**base, **over})


def test_fill_signals_derives_shares_costs_and_the_roofline() -> None:
    r = IterationReport(iteration=1, seconds=_seconds(), control_overhead_seconds=0.2)
    signals.fill_signals(r, _totals(), ProfileHints(model_bytes=16_000_000_000))
    assert r.wall_seconds == 10.0 and r.rollout_share == 0.75
    assert r.cache_hit_rate == 0.75 and r.generation_tokens_per_second == 1000.0
    assert r.gpus == 2 and r.gpu_seconds == 20.0
    assert r.gpu_seconds_per_sample == 0.2  # 20 GPU-s / 100 samples
    assert r.tokens_per_gpu_second == 300.0  # 6000 tokens / 20 GPU-s
    assert r.tokens_per_second_per_gpu == 500.0
    assert r.decode_roofline_tokens_per_second == pytest.approx(10 * 4.8e12 / 16e9)  # 3000
    assert r.roofline_fraction == pytest.approx(1000 / 3000, abs=1e-4)
    # the user's bandwidth wins over the table's
    r2 = IterationReport(iteration=1, seconds=_seconds())
    hints = ProfileHints(model_bytes=16_000_000_000, memory_bandwidth_bytes_per_second=1_600_000_000_000)
    signals.fill_signals(r2, _totals(), hints)
    assert r2.decode_roofline_tokens_per_second == pytest.approx(1000)
    assert r2.roofline_fraction == 1.0


def test_fill_signals_leaves_unmeasured_signals_unset() -> None:
    r = IterationReport(iteration=1, seconds=_seconds(), cache_hit_rate=0.5)
    signals.fill_signals(r, None, ProfileHints())
    assert r.wall_seconds == 10.0 and r.rollout_share == 0.75
    assert r.cache_hit_rate == 0.5  # the last batches' rate stays when SGLang has no counters
    assert r.gpus is None and r.gpu_seconds_per_sample is None and r.decode_roofline_tokens_per_second is None
    r = IterationReport(iteration=1, seconds=_seconds())
    signals.fill_signals(r, _totals(samples=None), ProfileHints())  # no samples reported, no model size
    assert r.gpu_seconds == 20.0 and r.gpu_seconds_per_sample is None
    assert r.decode_roofline_tokens_per_second is None and r.roofline_fraction is None


def test_fill_signals_lists_what_was_not_measured_and_derives_nothing_from_it() -> None:
    """Metrics off: the agents' reasons for the hit rate, tokens/s and counts; the derived tokens/s per
    GPU, roofline fraction and tokens per GPU-second stay unset; the roofline itself (running requests)
    and the measured signals stay."""
    said = [
        _off(Signal.CACHE_HIT_RATE),
        _off(Signal.GENERATION_TOKENS_PER_SECOND),
        _off(Signal.TOKEN_COUNTS),
    ]
    totals = _totals(
        prompt_tokens=None,
        cached_tokens=None,
        generation_tokens=None,
        generation_tokens_per_second=None,
        unmeasured=said,
    )
    r = IterationReport(iteration=1, seconds=_seconds(), cache_hit_rate=0.0, generation_tokens_per_second=0.0)
    signals.fill_signals(r, totals, ProfileHints(model_bytes=16_000_000_000))
    assert r.unmeasured == said
    assert r.cache_hit_rate is None and r.generation_tokens_per_second is None  # never the load route's 0.0
    assert r.tokens_per_second_per_gpu is None and r.roofline_fraction is None
    assert r.tokens_per_gpu_second is None and r.prompt_tokens is None
    assert r.decode_roofline_tokens_per_second == pytest.approx(3000) and r.gpu_busy_fraction == 0.5
    assert r.gpu_seconds_per_sample == 0.2
    # what no agent gave a reason for is NotReported, by its source
    r = IterationReport(iteration=1, seconds=_seconds())
    signals.fill_signals(r, _totals(gpu_busy_fraction=None, samples=None), ProfileHints())
    assert [(u.signal, u.reason) for u in r.unmeasured] == [
        (Signal.GPU_BUSY_FRACTION, UnmeasuredReason.NOT_REPORTED),
        (Signal.SAMPLES, UnmeasuredReason.NOT_REPORTED),
    ]
    assert "handoff.report_rollout" in r.unmeasured[1].message and r.gpu_seconds_per_sample is None
    r = IterationReport(iteration=1, seconds=_seconds())
    signals.fill_signals(r, None, ProfileHints())
    assert {u.signal for u in r.unmeasured} == set(Signal)
    assert {u.message for u in r.unmeasured} == {signals.NO_ROLLOUT_SAMPLE}


def test_iteration_report_reads_the_rollout_span_totals() -> None:
    spans = [
        PhaseSpan(
            phase=Phase.ROLLOUT,
            iteration=2,
            start_time="t",
            seconds=3.0,
            cache_hit_rate=0.1,
            rollout=_totals(),
        ),
        PhaseSpan(phase=Phase.DRAINING, iteration=2, start_time="t", seconds=1.0, agent_seconds=0.5),
        PhaseSpan(phase=Phase.TRAINING, iteration=2, start_time="t", seconds=1.0),
        PhaseSpan(phase=Phase.ROLLOUT, iteration=3, start_time="t", seconds=9.0),  # the next iteration's
    ]
    r = iteration_report(2, spans, ProfileHints())
    assert r.seconds.rollout == 3.0 and r.wall_seconds == 5.0
    assert r.control_overhead_seconds == 0.5
    assert r.cache_hit_rate == 0.75  # from the counters, over the span's last-batch 0.1
    assert r.samples == 100 and r.gpu_seconds == 10.0


def test_iteration_report_without_metrics_keeps_no_rate_of_the_span() -> None:
    """The Rollout span's own rates (the agents' load-route means) are not a measurement of a signal the
    span's totals list as unmeasured."""
    totals = RolloutTotals(
        pods=1,
        gpus=1,
        window_seconds=2.0,
        mean_running_requests=4.0,
        mean_waiting_requests=0.0,
        unmeasured=[_off(Signal.CACHE_HIT_RATE), _off(Signal.GENERATION_TOKENS_PER_SECOND)],
    )
    span = PhaseSpan(
        phase=Phase.ROLLOUT,
        iteration=1,
        start_time="t",
        seconds=2.0,
        cache_hit_rate=0.0,
        tokens_per_second=0.0,
        rollout=totals,
    )
    r = iteration_report(1, [span], ProfileHints())
    assert r.cache_hit_rate is None and r.generation_tokens_per_second is None
    assert [u.signal for u in r.unmeasured][:2] == [
        Signal.CACHE_HIT_RATE,
        Signal.GENERATION_TOKENS_PER_SECOND,
    ]
