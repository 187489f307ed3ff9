"""The emulator's HTTP contract by version: what the agent relies on. Row IDs are those of
docs/sglang-conformance.md; tests/agent/test_emulator_conformance.py has one test per row."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_procs import Emulator, sha256_file, wait_until, write_weights
from test_refit_window import bucket_payloads

from rljob.emulator.versions import SUPPORTED_VERSIONS as VERSIONS
from rljob.trainer.engines.sglang import packing


def _gen(emu: Emulator, text: str | list[str], n: int = 4) -> object:
    r = emu.call("POST", "/generate", {"text": text, "sampling_params": {"max_new_tokens": n}})
    assert r.status == 200, r.text
    return r.body


def _until_idle(emu: Emulator) -> None:
    """What every client must do before a release: finished requests leave the batch a moment later."""
    wait_until(lambda: emu.call("POST", "/flush_cache").status == 200, 5, "SGLang to be idle")


@pytest.mark.parametrize("version", VERSIONS)
def test_version_matrix_of_routes(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """C-ROUTE-WV-READ, C-METRIC-LOAD-ROUTE, C-HEALTH-READY, C-ROUTE-SESSION, C-MEM-WEIGHT-CACHE."""
    emu = start_emulator(version)
    wv = emu.call("GET", "/get_weight_version")
    load = emu.call("GET", "/get_load")
    loads = emu.call("GET", "/v1/loads")
    ready = emu.call("GET", "/ready")
    begin = emu.call("POST", "/begin_weight_update", {})
    assert emu.call("GET", "/server_info").body["version"] == version
    assert emu.call("GET", "/model_info").body["weight_version"] == "default"
    if version == "0.5.6":
        assert wv.status == 200 and wv.body == {"weight_version": "default"}
        assert load.status == 200 and set(load.body[0]) == {
            "dp_rank",
            "num_reqs",
            "num_waiting_reqs",
            "num_tokens",
        }
        assert loads.status == 404 and ready.status == 404
    elif version in ("0.5.15.post1", "0.5.20"):
        assert wv.status == 404 and "Please use '/model_info' instead." in wv.body["message"]
        assert load.status == 200 and "num_pending_tokens" in load.body[0] and "ts_tic" in load.body[0]
        assert loads.status == 200 and ready.status == (200 if version == "0.5.20" else 404)
    else:
        assert wv.status == 404 and wv.body == {"detail": "Not Found"}
        assert load.status == 404 and loads.status == 200 and ready.status == 200
        assert set(loads.body["loads"][0]) >= {
            "cache_hit_rate",
            "gen_throughput",
            "utilization",
            "num_running_reqs",
        }
    assert (begin.status == 200) == (version in ("0.5.21", "0.5.23"))
    has_cache_mode = "weight_cache_mode" in emu.call("GET", "/server_info").body
    assert has_cache_mode == (version in ("0.5.20", "0.5.21", "0.5.23"))


@pytest.mark.parametrize("version", VERSIONS)
def test_refit_sessions_by_version(version: str, start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator(version)
    payload = packing.to_wire(bucket_payloads([("w", "float32", (4,))])[0])
    push = {
        "serialized_named_tensors": [payload],
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "weight_version": "7",
    }
    r = emu.call("POST", "/update_weights_from_tensor", push)
    if version in ("0.5.21", "0.5.23"):
        assert (
            r.status == 400 and "between begin_weight_update() and end_weight_update()" in r.body["message"]
        )
        assert (
            emu.call("POST", "/end_weight_update", {}).body["message"] == "no weight-update session is open"
        )
        assert emu.call("POST", "/begin_weight_update", {}).status == 200
        again = emu.call("POST", "/begin_weight_update", {})
        assert again.status == 400 and "already open" in again.body["message"]
        r = emu.call("POST", "/update_weights_from_tensor", push)
        assert emu.call("POST", "/end_weight_update", {}).status == 200
    assert (
        r.status == 200 and r.body["success"] is True and "Weight version updated to 7" in r.body["message"]
    )
    assert emu.call("GET", "/model_info").body["weight_version"] == "7"
    assert emu.weights()["source"] == "tensor"


def test_flush_cache_timeout_from_0_5_10(start_emulator: Callable[..., Emulator]) -> None:
    """C-ROUTE-FLUSH: `?timeout=` defers the flush until idle from 0.5.10; 0.5.6 ignores the parameter."""
    new, old = start_emulator("0.5.15.post1", tps=100), start_emulator("0.5.6", tps=100)
    for emu in (new, old):
        # 150 tokens at 100/s: still running when the flushes come, even on a loaded machine
        threading.Thread(target=_gen, args=(emu, "a b", 150), daemon=True).start()
        wait_until(lambda emu=emu: emu.stats()["running"] == 1, 5, "request running")
    r = old.call("POST", "/flush_cache?timeout=5")
    assert r.status == 400 and r.text.startswith("Cache flushed.")  # 0.5.6: refused with the success text
    assert new.stats()["running"] == 1  # the flush below has a request to wait for
    started = time.monotonic()
    r = new.call("POST", "/flush_cache?timeout=5")
    assert r.status == 200 and r.text.startswith("Cache flushed.") and 0.05 < time.monotonic() - started < 5
    r = new.call("POST", "/flush_cache?timeout=-1")
    assert r.status == 400 and r.body["object"] == "error"


def test_pause_modes(start_emulator: Callable[..., Emulator]) -> None:
    """C-DRAIN-ABORT, C-DRAIN-RETRACT on 0.5.23."""
    emu = start_emulator("0.5.23", tps=100)
    out: list[object] = []
    threading.Thread(target=lambda: out.append(_gen(emu, "x y", 200)), daemon=True).start()
    wait_until(lambda: emu.stats()["running"] == 1, 5, "request running")
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    # abort returns only once every in-flight request was answered (aborted)
    assert emu.stats()["in_flight"] == 0
    wait_until(lambda: out, 2, "the aborted reply to reach its client")
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"  # type: ignore[index]
    # new requests block while paused; they are not rejected
    threading.Thread(target=lambda: out.append(_gen(emu, "x y", 5)), daemon=True).start()
    time.sleep(0.3)
    assert len(out) == 1 and emu.stats()["in_flight"] == 0
    assert emu.call("GET", "/ping").status == 200  # /ping stays 200 while paused
    emu.call("POST", "/continue_generation", {})
    wait_until(lambda: len(out) == 2, 5, "blocked request to finish after continue")
    # retract: the running request goes back to the queue, KV freed, and finishes after continue
    threading.Thread(target=lambda: out.append(_gen(emu, "x y", 40)), daemon=True).start()
    wait_until(lambda: emu.stats()["running"] == 1, 5, "request running")
    assert emu.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    st = emu.stats()
    assert st["running"] == 0 and st["waiting"] == 1 and st["idle"] is True  # paused: waiting ignored
    emu.call("POST", "/continue_generation", {})
    wait_until(lambda: len(out) == 3, 5, "retracted request to finish")
    assert out[2]["meta_info"]["completion_tokens"] == 40  # type: ignore[index]


def test_health_while_paused_and_unhealthy_state(start_emulator: Callable[..., Emulator]) -> None:
    """C-HEALTH-GENERATE, C-HEALTH-PING, C-HEALTH-READY on 0.5.23."""
    emu = start_emulator("0.5.23", "--health-check-timeout", "0.5")
    assert emu.call("GET", "/health_generate").status == 200
    emu.call("POST", "/pause_generation", {"mode": "abort"})
    assert emu.call("GET", "/ready").status == 503
    started = time.monotonic()
    assert emu.call("GET", "/health_generate").status == 503
    assert time.monotonic() - started >= 0.5
    assert emu.call("GET", "/ping").status == 503  # UnHealthy until a successful health check
    emu.call("POST", "/continue_generation", {})
    assert emu.call("GET", "/health").status == 200
    assert emu.call("GET", "/ping").status == 200 and emu.call("GET", "/ready").status == 200


@pytest.mark.parametrize("cpu_backup", [False, True])
def test_resumed_weights_are_garbage_without_cpu_backup(
    cpu_backup: bool, tmp_path: Path, start_emulator: Callable[..., Emulator]
) -> None:
    emu = start_emulator("0.5.23", *(["--enable-weights-cpu-backup"] if cpu_backup else []))
    before = _gen(emu, "p q r")["text"]  # type: ignore[index]
    _until_idle(emu)
    for path in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert emu.call("POST", path, {"tags": ["weights"]}).status == 200
    after = _gen(emu, "p q r")["text"]  # type: ignore[index]
    if cpu_backup:
        assert after == before
        return
    assert "GARBAGE" in after and not emu.weights()["valid"]
    ckpt = write_weights(tmp_path, "1")
    _until_idle(emu)  # the post-refit flush needs an idle scheduler too
    r = emu.call("POST", "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "1"})
    assert r.status == 200 and r.body["success"] and r.body["num_paused_requests"] == 0
    assert "GARBAGE" not in _gen(emu, "p q r")["text"]  # type: ignore[index]
    assert emu.weights()["checksum"] == sha256_file(ckpt)
    checker = emu.call("POST", "/weights_checker", {"action": "checksum"})
    assert checker.status == 200 and len(checker.body["per_engine_checksum"]) == 64
    assert emu.call("GET", "/model_info").body["model_path"] == str(ckpt)


def test_memory_accounting_by_region(start_emulator: Callable[..., Emulator]) -> None:
    plain = start_emulator("0.5.23", memory_saver=False)
    graphs = start_emulator(
        "0.5.23",
        "--gpus",
        "2",
        "--cuda-graph-backend-prefill",  # the breakable default refuses the variable (C-MEM-CUDAGRAPH-ENV)
        "disabled",
        env={"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"},
    )
    saver = start_emulator("0.5.23")
    for emu in (plain, graphs, saver):
        assert emu.call("POST", "/release_memory_occupation", {}).status == 200  # {} = every tag
    # without --enable-memory-saver release frees nothing (and says nothing)
    assert plain.memory()[0]["regions"] == {"kv_cache": 40 << 30, "weights": 16 << 30, "cuda_graph": 2 << 30}
    # cuda_graph only with SGLANG_MEMORY_SAVER_CUDA_GRAPH=1
    assert saver.memory()[0]["regions"] == {"kv_cache": 0, "weights": 0, "cuda_graph": 2 << 30}
    assert [g["regions"] for g in graphs.memory()] == [{"kv_cache": 0, "weights": 0, "cuda_graph": 0}] * 2
    assert graphs.memory()[1]["used_bytes"] == 2 << 30  # the baseline is never released
    assert plain.stats()["offload_tags"] == ["cuda_graph", "kv_cache", "weights"]


def test_prefix_cache_hit_rate_is_real(start_emulator: Callable[..., Emulator]) -> None:
    """C-METRIC-CACHE-HIT: the hit ratio of the last prefill batch; C-METRIC-PROM counters."""
    emu = start_emulator("0.5.23", "--enable-metrics")
    prefix = " ".join(f"w{i}" for i in range(40))
    first = _gen(emu, f"{prefix} one")
    assert first["meta_info"]["cached_tokens"] == 0  # type: ignore[index]
    batch = _gen(emu, [f"{prefix} two", f"{prefix} three"])
    assert [b["meta_info"]["cached_tokens"] for b in batch] == [40, 40]  # type: ignore[union-attr,index]
    rate = emu.call("GET", "/v1/loads").body["loads"][0]["cache_hit_rate"]
    assert rate == round(80 / 82, 4)  # the last batch: 40 of 41 prompt tokens cached, twice
    metrics = emu.call("GET", "/metrics").text
    for name in (
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
        "sglang:num_running_reqs",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cached_tokens_total",
    ):
        assert f"\n{name}{{" in "\n" + metrics, name
    assert 'moe_ep_rank="0"' in metrics
    _until_idle(emu)  # a flush empties the radix tree but the rate stays the last batch's
    assert emu.call("GET", "/v1/loads").body["loads"][0]["cache_hit_rate"] == round(80 / 82, 4)
    assert _gen(emu, f"{prefix} four")["meta_info"]["cached_tokens"] == 0  # type: ignore[index]
    assert emu.call("GET", "/v1/loads").body["loads"][0]["cache_hit_rate"] == 0


def test_weight_version_spans_across_a_version_change(start_emulator: Callable[..., Emulator]) -> None:
    emu = start_emulator("0.5.23", tps=100)
    out: list[object] = []
    threading.Thread(target=lambda: out.append(_gen(emu, "s t", 30)), daemon=True).start()
    wait_until(lambda: emu.stats()["running"] == 1, 5, "request running")
    time.sleep(0.1)
    r = emu.call("POST", "/update_weight_version", {"new_version": "9", "abort_all_requests": False})
    assert r.body == {"success": True, "message": "Weight version updated to 9", "new_version": "9"}
    wait_until(lambda: out, 5, "request to finish")
    meta = out[0]["meta_info"]  # type: ignore[index]
    spans = meta["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "9"] and spans[-1]["end"] == 30
    assert meta["weight_version"] == "9"


def test_validation_errors_and_auth(start_emulator: Callable[..., Emulator]) -> None:
    """C-ROUTE-VALIDATION, C-ROUTE-AUTH."""
    emu = start_emulator("0.5.23", "--api-key", "user", "--admin-api-key", "admin", "--not-a-flag")
    r = emu.call("POST", "/pause_generation", {"mode": "sideways"}, token="admin")
    assert r.status == 400 and r.body["object"] == "error" and r.body["code"] == 400
    assert emu.call("POST", "/flush_cache", token="user").status == 401  # admin key only
    assert emu.call("POST", "/flush_cache", token="admin").status == 200
    assert emu.call("GET", "/model_info").body == {"error": "Unauthorized"}
    assert emu.call("GET", "/model_info", token="user").status == 200
    assert emu.call("GET", "/health").status == 200  # always open
    assert "ignoring launch flags" in emu.log_text() and "--not-a-flag" in emu.log_text()
    old = start_emulator("0.5.6", "--api-key", "user")
    assert old.call("POST", "/flush_cache").status == 401
    assert old.call("POST", "/flush_cache", token="user").status == 200
