"""What vLLM measures for the rollout report: its `/metrics` series (V-METRIC-PROM), the same names in
0.26.0 and 0.34.0, summed over their label sets (`engine`, the DP index). With --disable-log-stats the
`vllm:` series are absent: no counter, and no rate, is measured."""

from __future__ import annotations

from rljob.agent.engines.base import Counter
from rljob.agent.engines.prometheus import series_sums

METRIC_SERIES = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
COUNTERS = {
    Counter.PROMPT_TOKENS: "vllm:prompt_tokens_total",
    Counter.CACHED_TOKENS: "vllm:prompt_tokens_cached_total",
    Counter.GENERATION_TOKENS: "vllm:generation_tokens_total",
}
METRICS_OFF = "vLLM runs with --disable-log-stats (no vllm: series on /metrics)"


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {series: sum over its label sets} for METRIC_SERIES; lines that do not parse are
    skipped."""
    return series_sums(text, METRIC_SERIES)


def counters(series: dict[str, float]) -> dict[Counter, float] | None:
    """The token counters, or None when vLLM publishes no `vllm:` series (--disable-log-stats)."""
    if "vllm:prompt_tokens_total" not in series:
        return None
    return {counter: series.get(name, 0.0) for counter, name in COUNTERS.items()}
