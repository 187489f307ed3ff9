"""Serving, info, load and health routes, by version (C-HEALTH-*, C-METRIC-LOAD-ROUTE, C-ROUTE-WV-READ in
docs/sglang-conformance.md)."""

from __future__ import annotations

import functools
import json
import os
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from rljob.emulator import metrics_text
from rljob.emulator.bodies import GenerateBody
from rljob.emulator.engine import Engine
from rljob.emulator.generation import GenerateError, generate, generate_stream, sse, stream_error
from rljob.emulator.http_common import bad_request, engine_of, parse_body
from rljob.emulator.scheduler import Scheduler
from rljob.emulator.versions import VersionProfile

LOAD_INCLUDES = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}


async def generate_route(request: web.Request) -> web.StreamResponse:
    """A ValueError from normalization or the scheduler is 400 {"error": {"message"}}; with `stream` it
    is one `data:` event before `[DONE]` (C-GEN-STREAM)."""
    body = await parse_body(request, GenerateBody)
    eng = engine_of(request)
    if not body.stream:
        try:
            return web.json_response(await generate(eng, body))
        except GenerateError as e:
            return web.json_response({"error": {"message": str(e)}}, status=400)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
    await resp.prepare(request)
    try:
        async for chunk in generate_stream(eng, body):
            await resp.write(sse(chunk))
    except GenerateError as e:
        await resp.write(sse(stream_error(eng, str(e))))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    status = await engine_of(request).health_generate()
    return web.Response(status=status)


async def ping(request: web.Request) -> web.Response:
    """C-HEALTH-PING: a constant 200 through 0.5.22, even with a dead scheduler; 0.5.23: is_healthy()."""
    eng = engine_of(request)
    if not eng.profile.ping_reflects_health:
        return web.Response(status=200)
    return web.Response(status=200 if eng.status == "Up" else 503)


async def ready(request: web.Request) -> web.Response:
    """C-HEALTH-READY: not paused and healthy (tokenizer_manager.py:732-734@0.5.23)."""
    eng = engine_of(request)
    ok = eng.status == "Up" and not eng.tokenizer.is_pause
    return web.Response(status=200 if ok else 503)


@functools.lru_cache(maxsize=8)
def _hf_config(model_path: str) -> dict[str, Any]:
    """The checkpoint's config.json (SGLang's `model_config.hf_config`), {} where there is none."""
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _model_info(eng: Engine) -> dict[str, Any]:
    """C-ROUTE-MODEL-INFO: the version's keys (`VersionProfile.model_info_keys`). `model_type` and
    `architectures` come from the launch checkpoint's config.json, as SGLang's model_config does (a disk
    refit moves `model_path`, not the config); a path without one answers the emulated placeholders. A text
    model understands neither images nor audio (…/configs/model_config.py:841-846,854-858@0.5.23).
    `reasoning_parser`/`tool_call_parser` default None (…/arg_groups/fields/serving.py:199,218@0.5.20),
    `disaggregation_mode` the string "null" (…/arg_groups/fields/disagg.py:55-58@0.5.21)."""
    args = eng.cfg.server_args
    hf = _hf_config(eng.cfg.model_path)
    values: dict[str, Any] = {
        "model_path": eng.model_path,
        "served_model_name": eng.served_model_name,
        "tokenizer_path": args["tokenizer_path"],
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": eng.weight_version,
        "load_format": args["load_format"],
        "reasoning_parser": args.get("reasoning_parser"),
        "tool_call_parser": args.get("tool_call_parser"),
        "disaggregation_mode": args.get("disaggregation_mode", "null"),
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf.get("model_type") if hf else "emulated",
        "architectures": hf.get("architectures") if hf else ["EmulatedForCausalLM"],
    }
    return {key: values[key] for key in eng.profile.model_info_keys}


async def model_info(request: web.Request) -> web.Response:
    return web.json_response(_model_info(engine_of(request)))


async def server_info(request: web.Request) -> web.Response:
    """Server args plus get_internal_state, one entry per DP rank: it needs the schedulers
    (…/entrypoints/http_server.py:537-557@0.5.6)."""
    eng = engine_of(request)
    info = dict(eng.cfg.server_args)
    async with eng.control("get_internal_state") as ranks:
        usage = memory_usage(eng)
        states = [{"last_gen_throughput": rank.gen_throughput(), "memory_usage": usage} for rank in ranks]
    info.update(
        version=eng.profile.version,
        launch_command=eng.cfg.launch_command,
        max_total_num_tokens=eng.cfg.max_total_tokens,
        startup_time=eng.startup_time,
        internal_states=states,
    )
    return web.json_response(info)


GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")


def memory_usage(eng: Engine) -> dict[str, Any]:
    """C-MEM-USAGE-REPORT: one rank's region sizes in GB of 2^30 bytes, as the version lays them out (the
    emulated graphs are decode graphs)."""
    sizes, GB = eng.cfg.region_sizes, float(1 << 30)
    if not eng.profile.memory_usage_per_phase:
        return {
            "weight": round(sizes["weights"] / GB, 2),
            "kvcache": round(sizes["kv_cache"] / GB, 2),
            "token_capacity": eng.cfg.max_total_tokens,
            "graph": round(sizes["cuda_graph"] / GB, 2),
        }
    graph = dict.fromkeys(GRAPH_PHASES, 0.0) | {"decode": round(sizes["cuda_graph"] / GB, 3)}
    return {
        "weight": round(sizes["weights"] / GB, 3),
        "kvcache": round(sizes["kv_cache"] / GB, 3),
        "startup_available": round((eng.cfg.gpu_total_bytes - eng.cfg.baseline_bytes) / GB, 3),
        "token_capacity": eng.cfg.max_total_tokens,
        "token_capacity_swa": None,
        "graph": graph,
    }


def _load(eng: Engine, s: Scheduler) -> dict[str, Any]:
    """One rank's load snapshot, core fields, as the version lays it out (`v1_loads_snapshot_layout`;
    …/managers/scheduler_components/load_inquirer.py:215-234@0.5.15.post1, load_inquirer.py:218-241
    @0.5.20, load_inquirer.py:226-250@0.5.23)."""
    cfg = eng.cfg
    counts = s.published_counts(eng.profile.loads_frozen_while_paused)
    used = counts.used_tokens
    total = used + counts.waiting_tokens  # load_inquirer.py:131-133@0.5.15.post1
    snapshot = eng.profile.v1_loads_snapshot_layout
    load: dict[str, Any] = {"timestamp": time.time()} if snapshot else {}
    load.update(
        dp_rank=s.dp_rank,
        num_running_reqs=counts.running,
        num_waiting_reqs=counts.waiting,
        num_waiting_uncached_tokens=counts.waiting_tokens,
        num_used_tokens=used,
        num_total_tokens=total,
    )
    if snapshot:
        # total minus tokens awaiting a KV transfer, and the prealloc-ready tokens: both disaggregated
        # decode only (load_inquirer.py:136,176@0.5.20)
        load.update(num_active_tokens=total, num_prealloc_ready_tokens=0)
    load.update(
        max_total_num_tokens=cfg.max_total_tokens,
        max_running_requests=cfg.max_running_requests,
        token_usage=round(used / cfg.max_total_tokens, 4),
        # C-METRIC-OFF: SchedulerStats' two rates are written only with --enable-metrics, else their 0.0
        gen_throughput=round(s.gen_throughput(), 2) if cfg.enable_metrics else 0.0,
        cache_hit_rate=round(s.cache_hit_rate, 4) if cfg.enable_metrics else 0.0,
        # C-METRIC-UTILIZATION: computed only when max_running_requests_under_SLO > 0, which nothing sets
        # (…/managers/scheduler_components/metrics_reporter.py:1303-1315@0.5.23): always 0.0
        utilization=0.0,
    )
    if snapshot:
        # cumulative prefill counters and the decode step-time moment sums (None before a decode step,
        # load_inquirer.py:215@0.5.20): the emulator counts the uncached prefill tokens only; it has no
        # step times, so busy time stays 0 and the moments None
        load.update(
            total_prefill_uncached_tokens=s.prefill_uncached_tokens,
            total_prefill_busy_us=0,
            decode_moments=None,
        )
    return load


async def v1_loads(request: web.Request) -> web.Response:
    """Read from the snapshots the schedulers publish, not a scheduler call (tokenizer_control_mixin.py:
    1001-1029@0.5.23); one entry per DP rank, `?dp_rank=` filters."""
    eng = engine_of(request)
    cfg = eng.cfg
    if cfg.fastapi_lazy_routers and cfg.enable_metrics and eng.profile.metrics_middleware_reads_route_path:
        # AttributeError in the middleware: Starlette's ServerErrorMiddleware answers (C-METRIC-LOAD-ASGI)
        return web.Response(status=500, text="Internal Server Error", content_type="text/plain")
    include = [x.strip() for x in request.query.get("include", "core").split(",") if x.strip()]
    bad = [x for x in include if x not in LOAD_INCLUDES]
    if bad:
        return bad_request(f"invalid include: {', '.join(bad)}")
    ranks = eng.ranks
    if "dp_rank" in request.query:
        try:
            wanted = int(request.query["dp_rank"])
        except ValueError:
            return bad_request("dp_rank: Input should be a valid integer")
        ranks = [r for r in ranks if r.dp_rank == wanted]
    loads = [_load(eng, r) for r in ranks]
    if request.query.get("format") == "prometheus":
        lines: list[str] = []
        keys = [k for k in (loads[0] if loads else {}) if k not in ("dp_rank", "timestamp", "decode_moments")]
        for key in keys:
            lines.append(f"# TYPE sglang_{key} gauge")
            lines += [f'sglang_{key}{{dp_rank="{ld["dp_rank"]}"}} {ld[key]}' for ld in loads]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
    # ISO text (v1_loads.py:120@0.5.15.post1, v1_loads.py:145@0.5.20)
    reply: dict[str, Any] = {"timestamp": datetime.now(UTC).isoformat(), "version": eng.profile.version}
    if eng.profile.v1_loads_snapshot_layout:
        # get_device_name() and tp * pp (// dp with DP attention) GPUs per rank (v1_loads.py:39-54@0.5.20)
        reply.update(accelerator="emulated", num_accelerators=eng.cfg.gpus)
    reply["loads"] = loads
    return web.json_response(reply)


async def get_load(request: web.Request) -> web.Response:
    """0.5.6: a "watching" call to every scheduler (concurrent callers share one; a dead scheduler makes
    every later call hang; tokenizer_communicator_mixin.py:215-216,717-719@0.5.6); items
    {dp_rank, num_reqs, num_waiting_reqs, num_tokens} (scheduler_metrics_mixin.py:400-426@0.5.6).
    0.5.15-0.5.20: a shim over the load snapshots (http_server.py:730-755@0.5.15.post1)."""
    eng = engine_of(request)
    if eng.profile.get_load == "shim":
        ts = time.perf_counter()
        counts = [(r.dp_rank, r.published_counts(eng.profile.loads_frozen_while_paused)) for r in eng.ranks]
        return web.json_response(
            [
                {
                    "dp_rank": rank,
                    "num_reqs": c.running + c.waiting,
                    "num_waiting_reqs": c.waiting,
                    "num_tokens": c.used_tokens + c.waiting_tokens,
                    "num_pending_tokens": c.waiting_tokens,
                    "ts_tic": ts,
                }
                for rank, c in counts
            ]
        )
    return web.json_response(await eng.get_load())


async def get_weight_version(request: web.Request) -> web.Response:
    eng = engine_of(request)
    if eng.profile.get_weight_version == "deprecated":
        # HTTPException(404) through SGLang's handler (http_server.py:456-500@0.5.15.post1)
        detail = (
            "Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
            "Please use '/model_info' instead."
        )
        return web.json_response(
            {"object": "error", "message": detail, "type": "404", "param": None, "code": 404}, status=404
        )
    return web.json_response({"weight_version": eng.weight_version})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=metrics_text.render(engine_of(request)), content_type="text/plain")


def add_routes(app: web.Application, profile: VersionProfile, *, enable_metrics: bool) -> None:
    r = app.router
    r.add_post("/generate", generate_route)
    for path in ("/health", "/health_generate"):
        r.add_get(path, health)
    r.add_get("/ping", ping)
    for path in ("/model_info", "/get_model_info"):
        r.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        r.add_get(path, server_info)
    if profile.has_ready:
        r.add_get("/ready", ready)
    if profile.has_v1_loads:
        r.add_get("/v1/loads", v1_loads)
    if profile.get_load != "removed":
        r.add_get("/get_load", get_load)
    if profile.get_weight_version != "removed":
        for path in ("/get_weight_version", "/weight_version"):
            r.add_get(path, get_weight_version)
    if enable_metrics:
        r.add_get("/metrics", metrics)
