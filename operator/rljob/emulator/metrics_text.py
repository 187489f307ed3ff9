"""`/metrics` in SGLang's names (contract §6), rendered by hand: names contain colons and labels differ
by version, which is simpler to spell out than to bend prometheus_client into."""

from __future__ import annotations

from rljob.emulator.engine import Engine

GiB = 1 << 30


def _labels(engine: Engine) -> str:
    parts = [f'model_name="{engine.cfg.served_model_name}"']
    if engine.profile.key >= (0, 5, 15):
        parts.append('engine_type="unified"')
    parts += ['tp_rank="0"', 'pp_rank="0"']
    if engine.profile.has_moe_ep_rank_label:
        parts.append('moe_ep_rank="0"')
    return "{" + ",".join(parts) + "}"


def render(engine: Engine) -> str:
    s, c, lab = engine.scheduler, engine.scheduler.counters, _labels(engine)
    sizes = engine.cfg.region_sizes
    gauges = {
        "num_running_reqs": s.num_running(),
        "num_queue_reqs": s.num_waiting(),
        "num_paused_reqs": s.num_waiting() if s.scheduler_paused else 0,
        "utilization": s.utilization(),
        "gen_throughput": s.gen_throughput(),
        "cache_hit_rate": s.cache_hit_rate(),
        "token_usage": s.num_used_tokens() / engine.cfg.max_total_tokens,
        "num_used_tokens": s.num_used_tokens(),
        "max_total_num_tokens": engine.cfg.max_total_tokens,
        "weight_memory_usage_gb": sizes["weights"] / GiB,  # static, set at startup (not updated by release)
        "kv_cache_memory_usage_gb": sizes["kv_cache"] / GiB,
    }
    counters = {
        "num_requests_total": c.num_requests,
        "num_aborted_requests_total": c.num_aborted,
        "prompt_tokens_total": c.prompt_tokens,
        "generation_tokens_total": c.generation_tokens,
        "cached_tokens_total": c.cached_tokens,
    }
    lines: list[str] = []
    for name, value in gauges.items():
        lines += [f"# TYPE sglang:{name} gauge", f"sglang:{name}{lab} {float(value)}"]
    for name, value in counters.items():
        lines += [f"# TYPE sglang:{name} counter", f"sglang:{name}{lab} {float(value)}"]
    if engine.profile.has_weight_load_duration_metric:
        lines.append("# TYPE sglang:weight_load_duration_seconds gauge")
        for source, seconds in sorted(engine.weight_load_seconds.items()):
            lines.append(f'sglang:weight_load_duration_seconds{lab[:-1]},source="{source}"}} {seconds}')
    return "\n".join(lines) + "\n"
