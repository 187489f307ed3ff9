"""The vLLM emulator against docs/vllm-conformance.md, over HTTP, at 0.26.0 and 0.34.0: one test per
behaviour group (launch and gates, routes and bodies, drain, memory, DP, health and death, metrics, the
weight version and checker). Each test names its rows and asserts the status and body the row states;
where vLLM dies, the emulator must exit, and where vLLM serves garbage, so must the emulator. Refits are in
test_vllm_emulator_refit.py."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import pytest
from agent_procs import PY, wait_until
from vllm_procs import GARBAGE, VLLM_VERSIONS, Background, start_long_request

NEW = "0.34.0"
StartVllm = Any  # the start_vllm fixture: (version, *flags, **kw) -> VllmEmulator


def _error(r: Any) -> dict[str, Any]:
    assert isinstance(r.body, dict) and "error" in r.body, r.text
    return dict(r.body["error"])


# --- 0. launch, gates, reads -------------------------------------------------------------------------


def test_unrecorded_version_is_a_startup_error(tmp_path: Path) -> None:
    """Only the recorded versions start; the error names them."""
    out = subprocess.run(
        [PY, "-m", "rljob.emulator.vllm", "--vllm-version", "0.30.0", "m"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(Path(__file__).parents[2] / "operator")},
    )
    assert out.returncode == 1
    assert "0.26.0, 0.34.0" in out.stderr and "not recorded" in out.stderr


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_rl_routes_need_dev_mode(version: str, start_vllm: StartVllm) -> None:
    """V-LAUNCH-DEVMODE: without VLLM_SERVER_DEV_MODE=1 every RL route is a 404; the serving routes are not.
    With it, the version's own routes exist and the other version's do not."""
    off, on = start_vllm(version, dev_mode=False), start_vllm(version)
    for path in ("/pause", "/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/update_weights"):
        r = off.call("POST", path, {})
        assert (r.status, r.body) == (404, {"detail": "Not Found"}), path
    assert off.call("GET", "/server_info").status == 404
    assert off.call("GET", "/health").status == 200
    assert on.call("POST", "/pause").status == 200
    only_new = [("POST", "/release_kv_cache_memory"), ("GET", "/weight_info"), ("POST", "/weight_checker"),
                ("POST", "/update_weight_version"), ("POST", "/shutdown_weight_transfer_engine")]  # fmt: skip
    for method, path in only_new:
        status = on.call(method, path, {}).status
        assert (status == 404) == (version != NEW), (path, status)


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_reads_version_server_info_world_size(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-VERSION, V-ROUTE-SERVER-INFO, V-ROUTE-WORLD-SIZE."""
    emu = start_vllm(version, "-tp", "2", "-dp", "2", "--weight-transfer-config", '{"backend": "ipc"}')
    assert emu.ok("GET", "/version").body == {"version": version}
    info = emu.ok("GET", "/server_info?config_format=json").body
    cfg = info["vllm_config"]
    assert cfg["model_config"]["enable_sleep_mode"] is True
    assert cfg["parallel_config"]["tensor_parallel_size"] == 2
    assert cfg["parallel_config"]["data_parallel_size"] == 2
    assert cfg["weight_transfer_config"] == {"backend": "ipc"}
    assert info["vllm_env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert isinstance(emu.ok("GET", "/server_info").body["vllm_config"], str)  # config_format=text
    assert emu.ok("GET", "/get_world_size").body == {"world_size": 4}
    assert emu.ok("GET", "/get_world_size?include_dp=false").body == {"world_size": 2}
    assert emu.ok("GET", "/load").body == {"server_load": 0}  # V-METRIC-LOAD-ROUTE: no tracking flag


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_api_key_guards_only_v1(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-AUTH: --api-key guards /v1 only; the RL routes, /health and /metrics stay open."""
    emu = start_vllm(version, "--api-key", "k1")
    r = emu.complete()
    assert (r.status, r.body) == (401, {"error": "Unauthorized"})
    assert emu.call("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}, token="k1").status == 200
    assert emu.call("POST", "/pause").status == 200
    assert emu.call("GET", "/health").status == 200
    assert emu.call("GET", "/metrics").status == 200


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_agent_gpu_probe_reads_the_vllm_emulator(version: str, start_vllm: StartVllm) -> None:
    """The agent's emulator probe plugin (memory, NVML's per-process list, busy time) reads the vLLM
    emulator as it reads SGLang's; a level-1 sleep shows on it."""
    from rljob.agent.engines.sglang.client import SGLangClient
    from rljob.agent.engines.sglang.engine import SGLangEngine
    from rljob.emulator.probe import EmulatorProbe

    emu = start_vllm(version, "-tp", "2")
    emu.wait_ready()

    async def read() -> tuple[list[Any], list[Any]]:
        client = SGLangClient(
            emu.url, api_key=None, admin_api_key=None, call_timeout_s=10, observe=lambda *_: None
        )
        await client.start()
        try:
            probe = EmulatorProbe(SGLangEngine(client))
            return await probe.sample(), await probe.processes()
        finally:
            await client.close()

    memory, processes = asyncio.run(read())
    assert len(memory) == 2 and {p.gpu for p in processes} == {0, 1}
    assert {p.pid for p in processes} == {emu.pid}
    emu.ok("POST", "/sleep?level=1")
    asleep, _ = asyncio.run(read())
    freed = memory[0].used_bytes - asleep[0].used_bytes
    assert freed == (16 + 40) << 30  # the default --weights-bytes and --kv-bytes


# --- 1. routes and bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_pause_resume_bodies_and_validation(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-PAUSE, V-ROUTE-RESUME, V-ROUTE-IS-PAUSED, V-ROUTE-IS-SLEEPING, V-ROUTE-ERRORS."""
    emu = start_vllm(version)
    assert emu.ok("GET", "/is_paused").body == {"is_paused": False}
    assert emu.ok("POST", "/pause?mode=keep").body == {"status": "paused"}
    assert emu.ok("GET", "/is_paused").body == {"is_paused": True}
    assert emu.ok("GET", "/is_sleeping").body == {"is_sleeping": True}  # a plain pause counts as sleeping
    assert emu.ok("POST", "/resume").body == {"status": "resumed"}
    assert emu.ok("GET", "/is_sleeping").body == {"is_sleeping": False}
    r = emu.call("POST", "/pause?mode=bogus")
    err = _error(r)
    assert (r.status, err["type"], err["param"], err["code"]) == (400, "Bad Request", "query.mode", 400)
    assert err["message"].startswith("1 validation error:")
    r = emu.call("POST", "/pause?clear_cache=maybe")
    assert (r.status, _error(r)["param"]) == (400, "query.clear_cache")
    r = emu.call("POST", "/pause?wait_for_inflight_requests=true")
    assert r.status == 200  # 0.26: deprecated mode=wait; 0.34: an unknown query parameter, ignored


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_sleep_and_wake_bodies(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-SLEEP, V-ROUTE-WAKE, V-KILL-L3: 0.26 answers empty 200s and takes any integer level (an
    invalid mode fails in the engine: 500); 0.34 answers JSON and validates level 0..2 and mode."""
    emu = start_vllm(version)
    r = emu.call("POST", "/sleep?level=abc")
    assert r.status == 400
    assert _error(r)["type"] == ("Bad Request" if version == NEW else "BadRequestError")
    r = emu.call("POST", "/sleep?level=1&mode=bogus")
    if version == NEW:
        assert (r.status, _error(r)["param"]) == (400, "query.mode")
    else:
        err = _error(r)
        assert (r.status, err["type"]) == (500, "InternalServerError")
        assert err["message"] == "Call to sleep method failed: Invalid pause mode: bogus"
        emu.ok("POST", "/resume")  # the failed sleep left nothing paused
    r = emu.ok("POST", "/sleep?level=2")
    assert r.text == "" if version != NEW else r.body == {"status": "sleeping", "level": 2}
    r = emu.ok("POST", "/wake_up?tags=weights")
    assert r.text == "" if version != NEW else r.body == {"status": "sleeping", "tags": ["weights"]}
    r = emu.ok("POST", "/wake_up?tags=kv_cache")
    assert r.text == "" if version != NEW else r.body == {"status": "awake", "tags": ["kv_cache"]}
    emu.ok("POST", "/sleep?level=0")  # a pause only (V-MEM-LEVELS); `scheduling` wakes no memory
    assert emu.metric("vllm:engine_sleep_state", sleep_state="awake") == 0.0
    assert emu.ok("GET", "/is_paused").body == {"is_paused": True} and emu.regions()["weights"] > 0
    emu.ok("POST", "/wake_up?tags=scheduling")
    assert emu.ok("GET", "/is_paused").body == {"is_paused": False}
    r = emu.call("POST", "/sleep?level=3")
    assert r.status == (400 if version == NEW else 200)
    if version == NEW:
        assert _error(r)["param"] == "query.level"


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_abort_requests_and_rpc_bodies(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-ABORT, V-ROUTE-RPC, V-ROUTE-ERRORS: a body that is not an object is 400 on 0.34 and an
    AttributeError (500) on 0.26; an unknown worker method fails in the worker."""
    emu = start_vllm(version)
    assert emu.ok("POST", "/abort_requests", {}).body == {"status": "aborted", "aborted": 0}
    r = emu.call("POST", "/abort_requests", raw=b"{not json")
    assert (r.status, _error(r)["message"]) == (400, "Invalid JSON format")
    for path in ("/abort_requests", "/collective_rpc"):
        r = emu.call("POST", path, [])
        if version == NEW:
            assert (r.status, _error(r)["message"]) == (400, "Request body must be a JSON object")
        else:
            assert (r.status, _error(r)["type"]) == (500, "InternalServerError")
            assert "'list' object has no attribute 'get'" in _error(r)["message"]
    r = emu.call("POST", "/collective_rpc", {"args": []})
    assert (r.status, _error(r)["message"], _error(r)["type"]) == (
        400,
        "Missing 'method' in request body",
        "Bad Request",
    )
    r = emu.call("POST", "/collective_rpc", raw=b"nope")
    assert r.status == 400 and _error(r)["message"].startswith("JSON decode error: ")
    r = emu.call("POST", "/collective_rpc", {"method": "skyrl_start_weight_update"})
    assert r.status == 500
    assert _error(r)["message"] == (
        "Call to collective_rpc method failed: Worker failed with error 'Method 'skyrl_start_weight_update' "
        "is not implemented.', please check the stack trace above for the root cause"
    )


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_abort_requests_by_id_does_not_pause(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-ABORT: the client's ids (`cmpl-{request_id}-{prompt index}`) abort those requests only; the
    engine is not paused, so new requests run."""
    emu = start_vllm(version, tps=50)
    running = Background(lambda: emu.complete(max_tokens=100_000, request_id="r1"))
    wait_until(lambda: emu.stats()["running"] == 1, 10, "the request to run")
    r = emu.ok("POST", "/abort_requests", {"request_ids": ["cmpl-r1-0"]})
    assert r.body == {"status": "aborted", "aborted": 1}
    reply = running.wait()
    assert (reply.body["id"], reply.body["choices"][0]["finish_reason"]) == ("cmpl-r1", "abort")
    assert emu.ok("GET", "/is_paused").body == {"is_paused": False}
    assert emu.complete(max_tokens=2).body["choices"][0]["finish_reason"] == "length"


# --- 2. drain ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_abort_pause(version: str, start_vllm: StartVllm) -> None:
    """V-DRAIN-ABORT, V-REQ-PAUSED: the running request answers 200 with its partial output and
    finish_reason abort; a new request waits in the queue on 0.26 and is refused with 503 on 0.34, until
    the resume."""
    emu = start_vllm(version, tps=50)
    running = start_long_request(emu)
    emu.ok("POST", "/pause?mode=abort")
    reply = running.wait()
    assert reply.status == 200
    choice = reply.body["choices"][0]
    assert choice["finish_reason"] == "abort" and reply.body["usage"]["completion_tokens"] < 100_000
    if version == NEW:
        r = emu.complete(max_tokens=2)
        err = _error(r)
        assert (r.status, err["type"], err["code"]) == (503, "ServiceUnavailableError", 503)
        assert err["message"] == "Generation is paused. Please retry after it resumes."
        emu.ok("POST", "/resume")
        assert emu.complete(max_tokens=2).status == 200
    else:
        queued = Background(lambda: emu.complete(max_tokens=2))
        wait_until(lambda: emu.stats()["waiting"] == 1, 10, "the request to queue")
        assert not queued.done()
        emu.ok("POST", "/resume")
        assert queued.wait().body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_wait_pause_answers_after_running_requests(version: str, start_vllm: StartVllm) -> None:
    """V-DRAIN-WAIT, V-DRAIN-TIMING: the pause answers once the running request finished (not aborted);
    until then other utility calls answer (the pause is a deferred future, not a blocked loop)."""
    emu = start_vllm(version, tps=50)
    running = start_long_request(emu, max_tokens=200)  # 200 steps of 1/50 s
    pause = Background(lambda: emu.call("POST", "/pause?mode=wait", timeout=60))
    wait_until(lambda: emu.ok("GET", "/is_paused").body == {"is_paused": True}, 10, "the pause to be seen")
    assert not pause.done() and emu.stats()["running"] == 1
    assert pause.wait().body == {"status": "paused"}
    assert running.done()
    reply = running.wait()
    assert (reply.body["choices"][0]["finish_reason"], reply.body["usage"]["completion_tokens"]) == (
        "length",
        200,
    )
    emu.ok("POST", "/resume")


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_keep_pause_preempts_and_flush(version: str, start_vllm: StartVllm) -> None:
    """V-DRAIN-KEEP, V-ROUTE-FLUSH, V-KILL-FLUSH-HELD: keep with clear_cache (the default) preempts the
    running request into the queue (KV freed), resumed later; keep without it holds the KV blocks, so
    the prefix-cache reset answers success false until reset_running_requests preempts them."""
    emu = start_vllm(version, tps=50)
    running = start_long_request(emu, max_tokens=60)
    emu.ok("POST", "/pause?mode=keep")
    assert (emu.stats()["running"], emu.stats()["waiting"]) == (0, 1)
    assert emu.ok("POST", "/reset_prefix_cache").body == {"success": True}
    emu.ok("POST", "/resume")
    reply = running.wait()
    assert (reply.body["choices"][0]["finish_reason"], reply.body["usage"]["completion_tokens"]) == (
        "length",
        60,
    )
    assert emu.metric("vllm:num_preemptions_total") == 1.0

    held = start_long_request(emu, max_tokens=100_000)
    emu.ok("POST", "/pause?mode=keep&clear_cache=false")
    assert emu.ok("POST", "/reset_prefix_cache").body == {"success": False}
    assert emu.ok("POST", "/reset_prefix_cache", {"reset_running_requests": True}).body == {"success": False}
    assert emu.ok("POST", "/reset_prefix_cache?reset_running_requests=true").body == {"success": True}
    assert (emu.stats()["running"], emu.stats()["waiting"]) == (0, 1)
    emu.ok("POST", "/abort_requests", {})
    assert held.wait().body["choices"][0]["finish_reason"] == "abort"


# --- 3. memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_sleep_level1_wake_order(version: str, start_vllm: StartVllm) -> None:
    """V-MEM-LEVELS, V-MEM-WAKE-ORDER, V-MEM-REPLY-ALL: level 1 frees weights and KV; a weights wake
    keeps scheduling paused (a queued request does not run), the kv_cache wake resumes it; the weights
    came back from the host copy (no garbage). CUDA graphs stay resident (V-MEM-RESIDENT)."""
    emu = start_vllm(version)
    before = emu.regions()
    emu.ok("POST", "/sleep?level=1")
    regions = emu.regions()
    assert (regions["weights"], regions["kv_cache"], regions["cuda_graph"]) == (0, 0, before["cuda_graph"])
    assert emu.engine()["host_backup_bytes"] == before["weights"]
    queued = Background(lambda: emu.complete(max_tokens=4))
    wait_until(lambda: emu.stats()["waiting"] == 1, 10, "the request to queue")
    emu.ok("POST", "/wake_up?tags=weights")
    assert emu.regions()["weights"] == before["weights"] and emu.regions()["kv_cache"] == 0
    assert emu.stats()["waiting"] == 1 and not queued.done()
    assert emu.ok("GET", "/is_sleeping").body == {"is_sleeping": True}
    emu.ok("POST", "/wake_up?tags=kv_cache")
    reply = queued.wait()
    assert reply.status == 200 and GARBAGE not in reply.body["choices"][0]["text"]
    assert emu.regions() == before
    assert emu.engine()["host_backup_bytes"] == (
        before["weights"] if version == NEW else 0
    )  # V-MEM-LEVEL1-HOST


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_level2_without_refit_serves_garbage(version: str, start_vllm: StartVllm, tmp_path: Path) -> None:
    """V-KILL-L2-NO-REFIT (silent): after a level-2 sleep and a wake with no refit the weights are fresh
    memory: 200s with garbage. A disk reload between the wakes restores them (V-REFIT-DISK)."""
    emu = start_vllm(version)
    clean = emu.complete().body["choices"][0]["text"]
    assert GARBAGE not in clean
    emu.ok("POST", "/sleep?level=2")
    emu.ok("POST", "/wake_up")
    r = emu.complete()
    assert r.status == 200 and GARBAGE in r.body["choices"][0]["text"]
    emu.ok("POST", "/sleep?level=2")
    emu.ok("POST", "/wake_up?tags=weights")
    model = emu.weights()["path"]
    emu.ok("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model}})
    emu.ok("POST", "/wake_up?tags=kv_cache")
    assert emu.complete().body["choices"][0]["text"] == clean  # the launch checkpoint, loaded again


def test_level3_loses_buffers_for_good(start_vllm: StartVllm) -> None:
    """V-KILL-L3 (0.26; 0.34 refuses the level, test_sleep_and_wake_bodies): level 3 loses the model's
    buffers: garbage even after a refit."""
    version = "0.26.0"
    emu = start_vllm(version)
    emu.ok("POST", "/sleep?level=3")
    emu.ok("POST", "/wake_up?tags=weights")
    model = emu.weights()["path"]
    emu.ok("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": model}})
    emu.ok("POST", "/wake_up?tags=kv_cache")
    r = emu.complete()
    assert r.status == 200 and GARBAGE in r.body["choices"][0]["text"]


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_sleep_without_sleep_mode_frees_nothing(version: str, start_vllm: StartVllm) -> None:
    """V-LAUNCH-SLEEPMODE, V-KILL-NO-SLEEP-MODE (silent): 200, is_sleeping true, nothing freed, and the
    weights survive a level-2 sleep."""
    emu = start_vllm(version, sleep_mode=False)
    before = emu.regions()
    emu.ok("POST", "/sleep?level=2")
    assert emu.ok("GET", "/is_sleeping").body == {"is_sleeping": True}
    assert emu.regions() == before
    emu.ok("POST", "/wake_up")
    assert GARBAGE not in emu.complete().body["choices"][0]["text"]


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_wake_skips_and_repeats(version: str, start_vllm: StartVllm) -> None:
    """V-MEM-WAKE-NOT-ASLEEP, V-KILL-WAKE-NOT-ASLEEP, V-MEM-WAKE-DUP-TAG, V-KILL-WAKE-DUP: a wake naming a
    tag that is not asleep skips the whole wake (200); a tag twice wakes the memory, then fails (500)
    before scheduling resumes. After the last tag woke that way, 0.26's executor still counts itself
    asleep (its flag clears only after a wake that completes): a wake naming a tag skips and the engine
    stays paused until a wake with no tags; on 0.34 any wake resumes it."""
    emu = start_vllm(version)
    emu.ok("POST", "/sleep?level=1")
    emu.ok("POST", "/wake_up?tags=weights&tags=cuda_graph")
    assert emu.regions()["weights"] == 0  # skipped, weights included
    for tag in ("weights", "kv_cache"):
        r = emu.call("POST", f"/wake_up?tags={tag}&tags={tag}")
        err = _error(r)
        assert (r.status, err["type"]) == (500, "InternalServerError")
        assert err["message"] == f"Call to wake_up method failed: '{tag}'"
        assert emu.regions()[tag] > 0  # the memory woke before the KeyError
    assert emu.ok("GET", "/is_sleeping").body == {"is_sleeping": True}  # the failed wake did not resume
    emu.ok("POST", "/wake_up?tags=kv_cache")
    assert emu.ok("GET", "/is_sleeping").body == {"is_sleeping": version != NEW}
    emu.ok("POST", "/wake_up")
    assert emu.ok("GET", "/is_sleeping").body == {"is_sleeping": False}
    emu.ok("POST", "/pause?mode=keep")
    emu.ok("POST", "/wake_up?tags=weights")  # nothing asleep: the wake skips, then resumes the plain pause
    assert emu.ok("GET", "/is_paused").body == {"is_paused": False}


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_sleep_twice(version: str, start_vllm: StartVllm) -> None:
    """V-MEM-SLEEP-TWICE, V-KILL-SLEEP-TWICE: after a weights-only wake a second sleep leaves the woken
    weights mapped on 0.26 (it skips while any tag sleeps) and puts them back to sleep on 0.34."""
    emu = start_vllm(version)
    emu.ok("POST", "/sleep?level=1")
    emu.ok("POST", "/wake_up?tags=weights")
    weights = emu.regions()["weights"]
    assert weights > 0
    emu.ok("POST", "/sleep?level=1")
    assert emu.regions()["weights"] == (0 if version == NEW else weights)
    assert "Executor is already sleeping." in emu.log_text() or version == NEW


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_release_kv_cache_memory(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-RELEASE-KV, V-MEM-RELEASE-KV: 0.34 only; needs a completed pause; discards the KV cache and
    keeps the weights; the kv_cache wake resumes scheduling."""
    emu = start_vllm(version)
    if version != NEW:
        assert emu.call("POST", "/release_kv_cache_memory").status == 404
        return
    r = emu.call("POST", "/release_kv_cache_memory")
    assert r.status == 500
    assert _error(r)["message"] == (
        "Call to release_kv_cache_memory method failed: "
        "release_kv_cache_memory() requires a completed pause first"
    )
    emu.ok("POST", "/pause?mode=abort")
    assert emu.ok("POST", "/release_kv_cache_memory").body == {"status": "kv_cache_released"}
    assert emu.regions()["kv_cache"] == 0 and emu.regions()["weights"] > 0
    assert emu.metric("vllm:engine_sleep_state", sleep_state="awake") == 0.0
    assert emu.metric("vllm:engine_sleep_state", sleep_state="discard_all") == 0.0
    assert emu.ok("POST", "/wake_up?tags=kv_cache").body == {"status": "awake", "tags": ["kv_cache"]}
    assert emu.ok("GET", "/is_paused").body == {"is_paused": False}
    assert emu.complete().status == 200


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_resume_while_asleep_is_fatal(version: str, start_vllm: StartVllm) -> None:
    """V-KILL-RESUME-ASLEEP: /resume unpauses a sleeping engine; the queued request's forward touches
    unmapped memory and the engine core dies; its client gets 500 and the server exits."""
    emu = start_vllm(version)
    emu.ok("POST", "/sleep?level=1")
    queued = Background(lambda: emu.complete(max_tokens=4))
    wait_until(lambda: emu.stats()["waiting"] == 1, 10, "the request to queue")
    emu.ok("POST", "/resume")
    emu.dies("an illegal memory access")
    reply = queued.wait() if not queued.dropped else None
    if reply is not None:
        assert (reply.status, _error(reply)["type"]) == (500, "InternalServerError")


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_sleep_assert_then_wake_is_fatal(version: str, start_vllm: StartVllm) -> None:
    """V-KILL-SLEEP-ASSERT, V-MEM-REPLY-ALL: another process allocates during the sleep: 500 after the
    memory was unmapped; the executor believes it is awake, so the next wake maps nothing and resumes,
    and the next forward dies."""
    emu = start_vllm(version, "--fault-sleep-memory-grows")
    r = emu.call("POST", "/sleep?level=1")
    assert r.status == 500 and "Memory usage increased after sleeping." in _error(r)["message"]
    assert emu.regions()["weights"] == 0
    emu.ok("POST", "/_emulator/faults", {"sleep_memory_grows": False})
    emu.ok("POST", "/wake_up")
    assert emu.regions()["weights"] == 0
    r2 = Background(lambda: emu.complete())
    emu.dies("an illegal memory access")
    assert r2.dropped or r2.wait().status == 500


# --- 5. DP, health, death ----------------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_dp_fanout_first_or_and(version: str, start_vllm: StartVllm) -> None:
    """V-DP-FANOUT: every utility call reaches both DP engines; /reset_prefix_cache answers DP rank 0's
    success on 0.26 and the AND of the ranks on 0.34 (here rank 1 holds KV blocks, rank 0 none)."""
    emu = start_vllm(version, "-dp", "2", tps=50)
    assert emu.complete(max_tokens=1).status == 200  # engine 0 (ties go to the first of the rotation)
    held = start_long_request(emu)  # the rotation moved on: engine 1
    assert (emu.engine(0)["running"], emu.engine(1)["running"]) == (0, 1)
    emu.ok("POST", "/pause?mode=keep&clear_cache=false")
    assert emu.engine(0)["pause_state"] == emu.engine(1)["pause_state"] == "paused_all"
    assert emu.ok("POST", "/reset_prefix_cache").body == {"success": version != NEW}
    emu.ok("POST", "/abort_requests", {})
    assert held.wait().body["choices"][0]["finish_reason"] == "abort"
    assert emu.ok("POST", "/reset_prefix_cache").body == {"success": True}


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_health_and_engine_death(version: str, start_vllm: StartVllm) -> None:
    """V-HEALTH, V-DEATH-EXC, V-DEATH-HARD: /health and /ping answer 200 while paused and asleep; once the
    engine core died, 503, every engine call answers 500, and the server exits (unless
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1)."""
    kept = start_vllm(version, env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    kept.ok("POST", "/sleep?level=1")
    assert kept.call("GET", "/health").status == kept.call("POST", "/ping").status == 200
    kept.ok("POST", "/_emulator/kill_engine_core")
    assert kept.call("GET", "/health").status == 503 and kept.call("GET", "/ping").status == 503
    r = kept.call("GET", "/is_sleeping")
    assert (r.status, _error(r)["message"]) == (
        500,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    )
    assert kept.alive()
    dies = start_vllm(version)
    dies.ok("POST", "/_emulator/kill_engine_core")
    dies.dies("engine core process died")


# --- 6. metrics --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_metrics_series(version: str, start_vllm: StartVllm) -> None:
    """V-METRIC-PROM: the series and labels; the sleep state per level and after a partial wake (0.26
    records awake after any wake, 0.34 only once nothing sleeps); --disable-log-stats drops them."""
    emu = start_vllm(version, "--served-model-name", "served")
    emu.complete("x y z " * 20, max_tokens=3)
    emu.complete("x y z " * 20, max_tokens=3)
    assert emu.metric("vllm:generation_tokens_total", model_name="served", engine="0") == 6.0
    assert emu.metric("vllm:prompt_tokens_total") == 120.0
    assert emu.metric("vllm:prefix_cache_hits_total") > 0  # the repeated prompt hit the prefix cache
    assert emu.metric("vllm:prompt_tokens_cached_total") == emu.metric("vllm:prefix_cache_hits_total")
    assert emu.metric("vllm:num_requests_running") == 0.0
    assert emu.metric("vllm:engine_sleep_state", sleep_state="awake") == 1.0
    emu.ok("POST", "/sleep?level=2")
    assert emu.metric("vllm:engine_sleep_state", sleep_state="discard_all") == 1.0
    emu.ok("POST", "/wake_up?tags=weights")
    assert emu.metric("vllm:engine_sleep_state", sleep_state="awake") == (0.0 if version == NEW else 1.0)
    emu.ok("POST", "/wake_up?tags=kv_cache")
    assert emu.metric("vllm:engine_sleep_state", sleep_state="awake") == 1.0
    emu.ok("POST", "/sleep?level=1")
    assert emu.metric("vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1.0
    text = emu.call("GET", "/metrics").text
    assert ('vllm:sleep_mode_operation_duration_seconds_count{operation="sleep"} 2.0' in text) == (
        version == NEW
    )
    assert ("vllm:prompt_tokens_cached_by_source_total" in text) == (version == NEW)
    quiet = start_vllm(version, "--disable-log-stats")
    assert "vllm:" not in quiet.call("GET", "/metrics").text


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_gauges_keep_last_values_while_nothing_steps(version: str, start_vllm: StartVllm) -> None:
    """V-METRIC-PROM (inferred): the scheduler gauges are set by steps; an abort pause finishes the
    running request without a step, so num_requests_running keeps 1."""
    emu = start_vllm(version, tps=50)
    running = start_long_request(emu)
    wait_until(lambda: emu.metric("vllm:num_requests_running") == 1.0, 10, "a step to publish")
    emu.ok("POST", "/pause?mode=abort")
    running.wait()
    assert emu.stats()["running"] == 0
    assert emu.metric("vllm:num_requests_running") == 1.0


# --- weight version and checker (0.34) ----------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_weight_version_and_spans(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-WV: 0.26 has none (404); 0.34 starts at "default", is set by /update_weight_version, and
    stamps each choice's tokens with `weight_versions` spans when asked."""
    emu = start_vllm(version)
    if version != NEW:
        assert emu.call("GET", "/weight_info").status == 404
        assert "weight_versions" not in emu.complete(return_weight_versions=True).body["choices"][0]
        return
    assert emu.ok("GET", "/weight_info").body == {"weight_version": "default"}
    r = emu.ok("POST", "/update_weight_version", {"new_version": "v7"})
    assert r.body == {"success": True, "new_version": "v7"}
    assert emu.ok("GET", "/weight_info").body == {"weight_version": "v7"}
    choice = emu.complete(max_tokens=3, return_weight_versions=True).body["choices"][0]
    assert choice["weight_versions"] == [{"version": "v7", "start": 0, "end": 3}]
    assert emu.complete(max_tokens=3).body["choices"][0]["weight_versions"] is None
    r = emu.call("POST", "/update_weight_version", {})
    assert (r.status, _error(r)["param"]) == (400, "body.new_version")


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_weight_checker(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-CHECKER: keys per parameter per worker; compare needs a baseline; reset zeroes the weights
    (then garbage). The checksum values are a placeholder, not vLLM's sha256 (V-CHECKER-HASH)."""
    emu = start_vllm(version, "-tp", "2")
    if version != NEW:
        assert emu.call("POST", "/weight_checker", {"action": "checksum"}).status == 404
        return
    sums = emu.ok("POST", "/weight_checker", {"action": "checksum"}).body["checksums"]
    assert "dp0:pp0:pcp0:tp1:model.layers.3.mlp.weight" in sums and len(sums) == 8
    r = emu.call("POST", "/weight_checker", {"action": "compare"})
    assert (r.status, _error(r)["message"]) == (400, "action='compare' requires a 'baseline' object")
    assert emu.ok("POST", "/weight_checker", {"action": "compare", "baseline": sums}).body == {
        "match": True,
        "mismatches": [],
    }
    r = emu.call("POST", "/weight_checker", {"action": "bogus"})
    assert (r.status, _error(r)["param"]) == (400, "body.action")
    assert emu.ok("POST", "/weight_checker", {"action": "reset"}).body == {"status": "reset"}
    after = emu.ok("POST", "/weight_checker", {"action": "compare", "baseline": sums}).body
    assert after["match"] is False and len(after["mismatches"]) == 8
    assert GARBAGE in emu.complete().body["choices"][0]["text"]
