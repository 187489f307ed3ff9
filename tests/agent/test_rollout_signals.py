"""The emulator produces the signals the rollout profile reads (docs/profiling.md), and the real agent
reads them: queueing past --max-running-requests, GPU busy falling as batches shrink, prefix reuse
following the prompts, and the trainer's sample count. Without --enable-metrics SGLang measures neither
rate (C-METRIC-OFF): the emulator reports them as SGLang does, and the agent reports them absent."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from agent_procs import Agent, AgentDriver, Emulator, http

from rljob.emulator.versions import SUPPORTED_VERSIONS


def _generate(emu: Emulator, text: str | list[str], tokens: int) -> Any:
    r = http(
        "POST",
        emu.url + "/generate",
        {"text": text, "sampling_params": {"max_new_tokens": tokens}},
        timeout=60,
    )
    assert r.status == 200, r.text
    return r.body


def _busy(emu: Emulator) -> tuple[float, float]:
    body = emu.call("GET", "/_emulator/utilization").body
    return float(body["monotonic"]), float(body["gpus"][0]["busy_seconds"])


def _busy_rate(emu: Emulator, seconds: float) -> float:
    t0, b0 = _busy(emu)
    time.sleep(seconds)
    t1, b1 = _busy(emu)
    return (b1 - b0) / (t1 - t0)


def test_requests_queue_past_the_running_limit_and_busy_follows_the_batch(
    start_emulator: Callable[..., Emulator],
) -> None:
    emu = start_emulator("0.5.23", "--max-running-requests", "4", "--saturation-batch", "8", tps=50)
    emu.wait_ready()
    with ThreadPoolExecutor(12) as pool:
        many = [pool.submit(_generate, emu, f"q{i}", 60) for i in range(12)]
        time.sleep(0.3)
        load = emu.call("GET", "/v1/loads").body["loads"][0]
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (4, 8)  # 4 slots, the rest queue
        assert 0.35 < _busy_rate(emu, 0.5) < 0.65  # 4 running of the 8 that saturate: half busy
        for f in many:
            f.result()
    with ThreadPoolExecutor(1) as pool:
        one = pool.submit(_generate, emu, "alone", 60)
        time.sleep(0.2)
        assert 0.05 < _busy_rate(emu, 0.5) < 0.2  # one running of 8
        one.result()
    assert _busy_rate(emu, 0.3) == 0.0  # nothing runs: not busy


def test_saturated_requests_share_the_gpu(start_emulator: Callable[..., Emulator]) -> None:
    """Past the saturation batch the tokens/s stay at tokens_per_second x saturation_batch."""
    emu = start_emulator("0.5.23", "--saturation-batch", "2", tps=100)
    emu.wait_ready()
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _generate(emu, f"s{i}", 25), range(8)))
    took = time.monotonic() - started
    assert took > 8 * 25 / (100 * 2) * 0.9  # 200 tokens at 200 tok/s: at least ~1 s, not 0.25 s


def test_agent_reports_queue_busy_reuse_and_samples(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator(
        "0.5.23", "--enable-metrics", "--max-running-requests", "4", "--saturation-batch", "4", tps=100
    )
    agent = start_agent(emu, "--rollout-sample-seconds", "0.05")
    prefix = " ".join(f"sys{i}" for i in range(100))
    with ThreadPoolExecutor(4) as pool:  # 4 prompts x 3 samples: 12 requests for 4 slots
        list(pool.map(lambda i: _generate(emu, [f"{prefix} q{i}"] * 3, 30), range(4)))
    r = agent.trainer("POST", "/v1/trainer/rollout", {"samples": 12})
    assert r.status == 200 and r.body["completedSamples"] == 12, r.text
    AgentDriver(agent).ok("drain")  # the drain's sample closes the window
    report = agent.state()["rollout"]
    assert report["completedSamples"] == 12
    assert report["promptTokens"] == 12 * 101 and report["generationTokens"] == 12 * 30
    # the first sample of each prompt misses the prompt (but hits the shared prefix after the first
    # prompt), the other two hit all of it
    assert report["cachedTokens"] / report["promptTokens"] > 0.8, report
    assert report["meanWaitingRequests"] > 0, report  # 12 requests, 4 slots
    assert report["meanRunningRequests"] <= 4.0, report
    assert 0.0 < report["gpuBusyFraction"] <= 1.0, report
    assert report["gpus"] == 1 and report["gpuName"] == "NVIDIA H100 80GB HBM3" and report["tpSize"] == 1
    assert report["windowSeconds"] > 0


@pytest.mark.parametrize("version", [v for v in SUPPORTED_VERSIONS if v != "0.5.6"])
def test_c_metric_off_load_route_rates_stay_zero(
    version: str, start_emulator: Callable[..., Emulator]
) -> None:
    """C-METRIC-OFF: without --enable-metrics no /metrics, and /v1/loads' cache_hit_rate and gen_throughput
    are SchedulerStats' never-written 0.0, while requests reuse the cache and tokens are generated;
    /server_info's last_gen_throughput (the decode log line's) is still computed."""
    emu = start_emulator(version, tps=100)
    emu.wait_ready()
    prefix = " ".join(f"c{i}" for i in range(40))
    _generate(emu, f"{prefix} first", 5)
    with ThreadPoolExecutor(2) as pool:
        busy = pool.submit(_generate, emu, [f"{prefix} again"] * 2, 200)
        time.sleep(0.5)
        load = emu.call("GET", "/v1/loads").body["loads"][0]
        assert load["num_running_reqs"] == 2, load  # generating, from the cached prefix
        assert (load["cache_hit_rate"], load["gen_throughput"]) == (0.0, 0.0), load
        states = emu.call("GET", "/server_info").body["internal_states"]
        assert states[0]["last_gen_throughput"] > 0, states
        busy.result()
    assert emu.call("GET", "/metrics").status == 404


@pytest.mark.parametrize("version", SUPPORTED_VERSIONS)
def test_agent_without_metrics_reports_the_rates_and_counts_not_measured(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """Row 6 of issue 32: the agent took the load route's 0.0 for a measured hit rate. Without
    --enable-metrics the report leaves the rates and counts unset, each with MetricsDisabled."""
    emu = start_emulator(version, tps=100)
    agent = start_agent(emu, "--rollout-sample-seconds", "0.05")
    prefix = " ".join(f"p{i}" for i in range(60))
    with ThreadPoolExecutor(2) as pool:  # prefix reuse and generation SGLang does not measure
        list(pool.map(lambda i: _generate(emu, [f"{prefix} q{i}"] * 2, 40), range(2)))
    AgentDriver(agent).ok("drain")  # the drain's sample closes the window
    report = agent.state()["rollout"]
    assert report["samples"] >= 1 and report["meanRunningRequests"] > 0, report  # the counts are measured
    for key in ("cacheHitRate", "generationTokensPerSecond", "promptTokens", "cachedTokens"):
        assert key not in report, (key, report)
    unmeasured = {u["signal"]: u for u in report.get("unmeasured", [])}
    assert set(unmeasured) == {"cacheHitRate", "generationTokensPerSecond", "tokenCounts"}, report
    for entry in unmeasured.values():
        assert entry["reason"] == "MetricsDisabled" and "--enable-metrics" in entry["message"], entry


def test_agent_reads_get_load_where_v1_loads_answers_500(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-METRIC-LOAD-ASGI: 0.5.15.post1 with --enable-metrics under FastAPI >= 0.137 answers /v1/loads with
    500 (seen on a GPU, tests/gpu/RESULTS.md). The agent reads the 0.5.15 `/get_load` shim from then on:
    the rollout report still has its running and waiting counts."""
    emu = start_emulator("0.5.15.post1", "--enable-metrics", "--fastapi-lazy-routers", tps=100)
    emu.wait_ready()
    r = emu.call("GET", "/v1/loads")
    assert (r.status, r.text) == (500, "Internal Server Error"), r.text
    agent = start_agent(emu, "--rollout-sample-seconds", "0.05")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: _generate(emu, [f"q{i}"] * 2, 40), range(2)))
    AgentDriver(agent).ok("drain")
    report = agent.state()["rollout"]
    assert report["samples"] >= 1 and report["meanRunningRequests"] > 0, report
    assert "reading /get_load from now on (C-METRIC-LOAD-ASGI)" in agent.log_text()
