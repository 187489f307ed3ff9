"""`/metrics` (only with --enable-metrics) in SGLang's names and labels per version (C-METRIC-PROM in
docs/sglang-conformance.md), rendered by hand: names contain colons and labels differ by version.

- Scheduler gauges, one series per DP rank: labels {model_name, engine_type, tp_rank, pp_rank[, moe_ep_rank]
  [, dp_rank]} (…/managers/scheduler_metrics_mixin.py:62-71@0.5.6, …/observability/metrics_collector.py:
  1056-1066@0.5.15.post1; dp_rank only with --dp-size > 1).
- Tokenizer counters, bumped when a request finishes, present once bumped (prometheus_client emits a
  labelled series only after its first use): labels {model_name} on 0.5.6 (…/managers/tokenizer_manager.py:
  383-390@0.5.6), {model_name, engine_type} from 0.5.15.post1 (tokenizer_manager.py:534-537@0.5.15.post1);
  `cached_tokens_total` gains `cache_source` from 0.5.15.post1 ("device" for radix hits:
  metrics_collector.py:1655-1661@0.5.15.post1), and prompt/generation/num_requests gain `is_streaming`
  from 0.5.20 (metrics_collector.py:1559-1566,1644-1646@0.5.20).
- With SGLANG_ENABLE_METRICS_DEVICE_TIMER=1, the scheduler's forward-pass GPU seconds by category
  (C-METRIC-DEVICE-TIMER)."""

from __future__ import annotations

from rljob.emulator.engine import Engine
from rljob.emulator.scheduler import Scheduler

GiB = 1 << 30


def _render_labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"


def scheduler_labels(engine: Engine, rank: Scheduler) -> dict[str, str]:
    labels = {
        "model_name": engine.cfg.served_model_name,
        "engine_type": "unified",
        "tp_rank": "0",
        "pp_rank": "0",
    }
    if engine.profile.has_moe_ep_rank_label:
        labels["moe_ep_rank"] = "0"
    if engine.cfg.dp_size > 1:
        labels["dp_rank"] = str(rank.dp_rank)
    return labels


def tokenizer_labels(engine: Engine) -> dict[str, str]:
    labels = {"model_name": engine.cfg.served_model_name}
    if engine.profile.tokenizer_labels_have_engine_type:
        labels["engine_type"] = "unified"
    return labels


def render(engine: Engine) -> str:
    sizes = engine.cfg.region_sizes
    lines: list[str] = []
    gauges: dict[str, list[tuple[dict[str, str], float]]] = {}
    for s in engine.ranks:
        lab = scheduler_labels(engine, s)
        values = {
            "num_running_reqs": s.num_running(),
            "num_queue_reqs": s.num_waiting(),
            "num_paused_reqs": s.num_waiting() if s.scheduler_paused else 0,
            "utilization": 0.0,  # C-METRIC-UTILIZATION (metrics_reporter.py:1303-1315@0.5.23)
            "gen_throughput": s.gen_throughput(),
            "cache_hit_rate": s.cache_hit_rate,  # C-METRIC-CACHE-HIT: the last prefill batch's
            "token_usage": s.num_used_tokens() / engine.cfg.max_total_tokens,
            "num_used_tokens": s.num_used_tokens(),
            "max_total_num_tokens": engine.cfg.max_total_tokens,
            "weight_memory_usage_gb": sizes["weights"] / GiB,  # set at startup, not updated by release
            "kv_cache_memory_usage_gb": sizes["kv_cache"] / GiB,
        }
        for name, value in values.items():
            gauges.setdefault(name, []).append((lab, float(value)))
    for name, series in gauges.items():
        lines.append(f"# TYPE sglang:{name} gauge")
        lines += [f"sglang:{name}{_render_labels(lab)} {value}" for lab, value in series]

    c, prof, tok = engine.tokenizer.counters, engine.profile, tokenizer_labels(engine)
    per_request = {**tok, "is_streaming": "false"} if prof.request_counters_have_is_streaming else tok
    cached = {**tok, "cache_source": "device"} if prof.cached_tokens_have_cache_source else tok
    counters = [
        ("prompt_tokens", per_request, c.prompt_tokens, c.num_requests > 0),
        ("generation_tokens", per_request, c.generation_tokens, c.num_requests > 0),
        ("cached_tokens", cached, c.cached_tokens, c.cached_tokens > 0),
        ("num_requests", per_request, c.num_requests, c.num_requests > 0),
        ("num_aborted_requests", tok, c.num_aborted, c.num_aborted > 0),
    ]
    for name, lab, value, present in counters:
        lines.append(f"# TYPE sglang:{name} counter")
        if present:
            lines.append(f"sglang:{name}_total{_render_labels(lab)} {float(value)}")

    timer = prof.device_timer_metric if engine.cfg.metrics_device_timer else None
    if timer is not None:
        # C-METRIC-DEVICE-TIMER: forward-pass GPU seconds per category, a series once its first pass was
        # timed; the emulator times its decode only (the busy seconds its GPU probe reads)
        name, decode = timer
        lines.append(f"# TYPE sglang:{name} counter")
        for s in engine.ranks:
            busy = s.busy_seconds
            if busy > 0:
                labelled = _render_labels({**scheduler_labels(engine, s), "category": decode})
                lines.append(f"sglang:{name}_total{labelled} {busy}")

    if prof.has_weight_load_duration_metric:
        lines.append("# TYPE sglang:weight_load_duration_seconds gauge")
        lab = scheduler_labels(engine, engine.ranks[0])
        for source, seconds in sorted(engine.weight_load_seconds.items()):
            labelled = _render_labels({**lab, "source": source})
            lines.append(f"sglang:weight_load_duration_seconds{labelled} {seconds}")
    return "\n".join(lines) + "\n"
