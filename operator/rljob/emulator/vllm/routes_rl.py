"""The pause and weight routes: rlhf/api_router.py@0.26.0, rl/online/api_router.py@0.34.0 (V-ROUTE-PAUSE,
-RESUME, -IS-PAUSED, -ABORT, -WT-*, -WORLD-SIZE, -WV, -CHECKER in docs/vllm-conformance.md). Registered only
with VLLM_SERVER_DEV_MODE=1 (V-LAUNCH-DEVMODE)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from rljob.emulator.vllm.errors import HTTPError, query_bool, query_literal, wrong_body_type
from rljob.emulator.vllm.metrics_text import OperationHistogram
from rljob.emulator.vllm.middleware import LLM_KEY, STATE_KEY, embedded, llm_of, raw_json

PAUSE_MODES = ("abort", "wait", "keep")


@contextlib.contextmanager
def _timed(histogram: OperationHistogram, operation: str, on: bool) -> Iterator[None]:
    """weight_operation_metrics().record(op) (0.34): observed whether the call succeeds or not."""
    started = time.perf_counter()
    try:
        yield
    finally:
        if on:
            histogram.observe(operation, time.perf_counter() - started)


async def pause(request: web.Request) -> web.Response:
    llm = llm_of(request)
    mode = query_literal(request.query, "mode", PAUSE_MODES, "abort")
    if llm.profile.pause_takes_wait_for_inflight and query_bool(
        request.query, "wait_for_inflight_requests", False
    ):
        mode = "wait"  # deprecated spelling of mode=wait (alm:775-783@0.26.0)
    clear_cache = query_bool(request.query, "clear_cache", True)
    try:
        await llm.pause_generation(mode, clear_cache)
    except ValueError as e:
        return web.json_response({"error": str(e)}, status=400)
    except Exception as e:
        return web.json_response({"error": f"Failed to pause generation: {e}"}, status=500)
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    try:
        await llm_of(request).resume_generation()
    except Exception as e:
        return web.json_response({"error": f"Failed to resume generation: {e}"}, status=500)
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    try:
        paused = await llm_of(request).is_paused()
    except Exception as e:
        return web.json_response({"error": f"Failed to fetch pause status: {e}"}, status=500)
    return web.json_response({"is_paused": paused})


async def abort_requests(request: web.Request) -> web.Response:
    llm = llm_of(request)
    body = await raw_json(request)
    if not isinstance(body, dict):
        if llm.profile.body_must_be_object:
            raise HTTPError(400, "Request body must be a JSON object")
        raise AttributeError(f"'{type(body).__name__}' object has no attribute 'get'")
    ids = body.get("request_ids")
    try:
        n = llm.abort(list(ids) if ids else None)
    except Exception as e:
        return web.json_response({"error": f"Failed to abort requests: {e}"}, status=500)
    return web.json_response({"status": "aborted", "aborted": n})


# --- weight transfer -------------------------------------------------------------------------------


async def _legacy_field(request: web.Request, name: str) -> Any:
    """0.26: `body = await raw_request.json()`, then `body.get(name)`, None -> 400."""
    body = await raw_json(request)
    if not isinstance(body, dict):
        raise AttributeError(f"'{type(body).__name__}' object has no attribute 'get'")
    value = body.get(name)
    if value is None:
        raise HTTPError(400, f"Missing '{name}' in request body")
    return value


async def init_weight_transfer_engine(request: web.Request) -> web.Response:
    llm = llm_of(request)
    if llm.profile.weight_bodies_validated:
        init_info = (await embedded(request, {"init_info": True}))["init_info"]
        if not isinstance(init_info, dict):
            raise wrong_body_type("init_info", "dict_type", "Input should be a valid dictionary", init_info)
    else:
        init_info = await _legacy_field(request, "init_info")
    with _timed(request.app[STATE_KEY].weight_metrics, "init", llm.profile.weight_bodies_validated):
        await llm.collective_rpc("init_weight_transfer_engine", None, (), {"init_info": init_info})
    return web.json_response({"message": "Weight transfer initialized"})


async def shutdown_weight_transfer_engine(request: web.Request) -> web.Response:
    with _timed(request.app[STATE_KEY].weight_metrics, "shutdown", True):
        await llm_of(request).collective_rpc("shutdown_weight_transfer_engine", None, (), {})
    return web.json_response({"message": "Weight transfer shut down"})


async def start_weight_update(request: web.Request) -> web.Response:
    llm = llm_of(request)
    with _timed(request.app[STATE_KEY].weight_metrics, "start", llm.profile.weight_bodies_validated):
        await llm.collective_rpc("start_weight_update", None, (), {})
    return web.json_response({"message": "Weight update started"})


async def update_weights(request: web.Request) -> web.Response:
    llm = llm_of(request)
    if llm.profile.weight_bodies_validated:
        update_info = (await embedded(request, {"update_info": True}))["update_info"]
        if not isinstance(update_info, dict | list):
            raise wrong_body_type(
                "update_info", "dict_type", "Input should be a valid dictionary", update_info
            )
    else:
        update_info = await _legacy_field(request, "update_info")
    with _timed(request.app[STATE_KEY].weight_metrics, "update", llm.profile.weight_bodies_validated):
        await llm.collective_rpc("update_weights", None, (), {"update_info": update_info})
    return web.json_response({"message": "Weights updated"})


async def finish_weight_update(request: web.Request) -> web.Response:
    llm = llm_of(request)
    version = None
    if llm.profile.finish_takes_weight_version:
        version = (await embedded(request, {"weight_version": False}))["weight_version"]
        if version is not None and not isinstance(version, str):
            raise wrong_body_type("weight_version", "string_type", "Input should be a valid string", version)
    with _timed(request.app[STATE_KEY].weight_metrics, "finish", llm.profile.weight_bodies_validated):
        await llm.collective_rpc("finish_weight_update", None, (), {})
        if version is not None:
            await llm.set_weight_version(version)
    return web.json_response({"message": "Weight update finished"})


async def start_draft_weight_update(request: web.Request) -> web.Response:
    """The emulated model has no speculative draft model."""
    await llm_of(request).collective_rpc("start_draft_weight_update", None, (), {})
    return web.json_response({"message": "Draft weight update started"})


async def get_world_size(request: web.Request) -> web.Response:
    cfg = llm_of(request).cfg
    include_dp = query_bool(request.query, "include_dp", True)
    return web.json_response({"world_size": cfg.world_size * (cfg.dp_size if include_dp else 1)})


# --- 0.34: weight version and checker --------------------------------------------------------------


async def update_weight_version(request: web.Request) -> web.Response:
    version = (await embedded(request, {"new_version": True}))["new_version"]
    if not isinstance(version, str):
        raise wrong_body_type("new_version", "string_type", "Input should be a valid string", version)
    await llm_of(request).set_weight_version(version)
    return web.json_response({"success": True, "new_version": version})


async def weight_info(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": await llm_of(request).get_weight_version()})


CHECKER_ACTIONS = ("checksum", "reset", "compare")


async def weight_checker(request: web.Request) -> web.Response:
    """rl:232-266@0.34.0: checksums over every worker of every DP engine (keys are unique per worker)."""
    llm = llm_of(request)
    body = await embedded(request, {"action": True, "baseline": False})
    action, baseline = body["action"], body["baseline"]
    if action not in CHECKER_ACTIONS:
        msg = "Input should be 'checksum', 'reset' or 'compare'"
        raise wrong_body_type("action", "literal_error", msg, action)
    if baseline is not None and not isinstance(baseline, dict):
        raise wrong_body_type("baseline", "dict_type", "Input should be a valid dictionary", baseline)
    if action == "reset":
        await llm.collective_rpc("reset_weights", None, (), {})
        return web.json_response({"status": "reset"})
    if action == "compare" and baseline is None:
        raise HTTPError(400, "action='compare' requires a 'baseline' object")
    checksums: dict[str, str] = {}
    for worker in await llm.compute_weight_checksums():
        duplicates = checksums.keys() & worker.keys()
        if duplicates:
            raise HTTPError(500, f"Duplicate weight checksum keys: {sorted(duplicates)}")
        checksums.update(worker)
    if action == "checksum":
        return web.json_response({"checksums": checksums})
    assert baseline is not None
    mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
    return web.json_response({"match": not mismatches, "mismatches": mismatches})


def add_routes(app: web.Application) -> None:
    profile = app[LLM_KEY].profile
    r = app.router
    r.add_post("/pause", pause)
    r.add_post("/resume", resume)
    r.add_get("/is_paused", is_paused)
    r.add_post("/abort_requests", abort_requests)
    r.add_post("/init_weight_transfer_engine", init_weight_transfer_engine)
    r.add_post("/start_weight_update", start_weight_update)
    r.add_post("/start_draft_weight_update", start_draft_weight_update)
    r.add_post("/update_weights", update_weights)
    r.add_post("/finish_weight_update", finish_weight_update)
    r.add_get("/get_world_size", get_world_size)
    if profile.has_shutdown_weight_transfer:
        r.add_post("/shutdown_weight_transfer_engine", shutdown_weight_transfer_engine)
    if profile.has_weight_version:
        r.add_post("/update_weight_version", update_weight_version)
        r.add_get("/weight_info", weight_info)
    if profile.has_weight_checker:
        r.add_post("/weight_checker", weight_checker)
