"""What SGLang measures for the rollout report: its `/metrics` series (C-METRIC-PROM) and the token counters
among them. SGLang mounts `/metrics` only with --enable-metrics; without it the load route's rates are
never written (C-METRIC-OFF)."""

from __future__ import annotations

from rljob.agent.engines.base import Counter
from rljob.agent.engines.prometheus import series_sums

# What the rollout sampler reads from `/metrics` (C-METRIC-PROM): the tokenizer's cumulative counters,
# bumped as requests finish, and the schedulers' gauges (one series per DP rank). Sums over label sets:
# `is_streaming` (≥0.5.20) splits requests, `cache_source` (≥0.5.15) splits cached tokens by tier.
METRIC_SERIES = (
    "sglang:prompt_tokens_total",
    "sglang:generation_tokens_total",
    "sglang:cached_tokens_total",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:gen_throughput",
    "sglang:cache_hit_rate",
)


def parse_metrics(text: str) -> dict[str, float]:
    """{series name: sum over its label sets} for METRIC_SERIES (prometheus.series_sums)."""
    return series_sums(text, METRIC_SERIES)


COUNTERS = {
    Counter.PROMPT_TOKENS: "sglang:prompt_tokens_total",
    Counter.CACHED_TOKENS: "sglang:cached_tokens_total",
    Counter.GENERATION_TOKENS: "sglang:generation_tokens_total",
}

METRICS_OFF = "SGLang runs without --enable-metrics (no /metrics; load route rates stay 0.0)"


def counters(series: dict[str, float]) -> dict[Counter, float]:
    """The token counters among the series read; a series absent is 0: SGLang's tokenizer series appear at
    their first bump (prometheus_client emits a labelled series only once used)."""
    return {counter: series.get(name, 0.0) for counter, name in COUNTERS.items()}
