"""`/metrics` in vLLM's series names per version (V-METRIC-PROM in docs/vllm-conformance.md), rendered as
prometheus_client renders them: a counter `vllm:x` is sampled as `vllm:x_total`, labels in declaration
order `model_name, engine` (ml:468@0.26.0), one series per DP engine created at startup (so present at 0).
With --disable-log-stats the `vllm:` engine series are absent. Gauges are the last values a step
published: while nothing steps (paused, asleep) they keep them (inferred in the conformance doc).

0.34's operation histograms (sleep, wake, release_kv_cache_memory; the weight-transfer steps) appear once
an operation was observed, with `_count`, `_sum` and `_bucket`."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from rljob.emulator.vllm.client import AsyncLLM

BUCKETS = (0.01, 0.1, 1.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # …/entrypoints/rl/online/metrics.py:22


@dataclass
class OperationHistogram:
    """One 0.34 operation-duration histogram, labelled by `operation`."""

    name: str
    observed: dict[str, list[float]] = field(default_factory=dict)

    def observe(self, operation: str, seconds: float) -> None:
        self.observed.setdefault(operation, []).append(seconds)

    def render(self) -> list[str]:
        if not self.observed:
            return []
        lines = [f"# TYPE {self.name} histogram"]
        for op, values in sorted(self.observed.items()):
            counts = [0] * (len(BUCKETS) + 1)
            for v in values:
                counts[bisect.bisect_left(BUCKETS, v)] += 1
            running = 0
            for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts, strict=True):
                running += n
                lines.append(f'{self.name}_bucket{{le="{bound}",operation="{op}"}} {float(running)}')
            lines.append(f'{self.name}_count{{operation="{op}"}} {float(len(values))}')
            lines.append(f'{self.name}_sum{{operation="{op}"}} {sum(values)}')
        return lines


def _labels(**labels: str) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def render(llm: AsyncLLM, histograms: list[OperationHistogram]) -> str:
    lines: list[str] = []
    if llm.cfg.log_stats:
        model = llm.cfg.served_model_name
        per_engine = [(str(c.dp_index), c.scheduler.stats) for c in llm.cores]

        def gauge(name: str, values: list[tuple[str, float]]) -> None:
            lines.append(f"# TYPE {name} gauge")
            lines.extend(f"{name}{_labels(model_name=model, engine=e)} {float(v)}" for e, v in values)

        def counter(name: str, values: list[tuple[str, float]]) -> None:
            lines.append(f"# TYPE {name} counter")
            lines.extend(f"{name}_total{_labels(model_name=model, engine=e)} {float(v)}" for e, v in values)

        gauge("vllm:num_requests_running", [(e, s.running) for e, s in per_engine])
        gauge("vllm:num_requests_waiting", [(e, s.waiting) for e, s in per_engine])
        lines.append("# TYPE vllm:engine_sleep_state gauge")
        awake, offloaded, discard_all = llm.sleep_state
        for e, _ in per_engine:
            for state, value in (
                ("awake", awake),
                ("weights_offloaded", offloaded),
                ("discard_all", discard_all),
            ):
                labels = _labels(model_name=model, engine=e, sleep_state=state)
                lines.append(f"vllm:engine_sleep_state{labels} {float(value)}")
        gauge("vllm:kv_cache_usage_perc", [(e, s.kv_cache_usage) for e, s in per_engine])
        counter("vllm:prefix_cache_queries", [(e, s.prefix_cache_queries) for e, s in per_engine])
        counter("vllm:prefix_cache_hits", [(e, s.prefix_cache_hits) for e, s in per_engine])
        counter("vllm:num_preemptions", [(e, s.preemptions) for e, s in per_engine])
        counter("vllm:prompt_tokens", [(e, s.prompt_tokens) for e, s in per_engine])
        counter("vllm:prompt_tokens_cached", [(e, s.prompt_tokens_cached) for e, s in per_engine])
        if "vllm:prompt_tokens_cached_by_source" in llm.profile.extra_metric_series:
            lines.append("# TYPE vllm:prompt_tokens_cached_by_source counter")
            for e, s in per_engine:
                for source in ("device", "host", "p2p"):
                    value = s.prompt_tokens_cached if source == "device" else 0
                    labels = _labels(model_name=model, engine=e, source=source)
                    lines.append(f"vllm:prompt_tokens_cached_by_source_total{labels} {float(value)}")
        counter("vllm:generation_tokens", [(e, s.generation_tokens) for e, s in per_engine])
        lines.append("# TYPE vllm:request_success counter")
        for e, s in per_engine:
            for reason in ("stop", "length", "abort", "error"):
                labels = _labels(model_name=model, engine=e, finished_reason=reason)
                lines.append(f"vllm:request_success_total{labels} {float(s.finished.get(reason, 0))}")
    for h in histograms:
        lines.extend(h.render())
    return "\n".join(lines) + "\n"
