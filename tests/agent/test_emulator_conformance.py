"""One test per row of docs/sglang-conformance.md that the emulator reproduces, run on every emulated SGLang
version the row applies to, against real emulator processes. The row ID is in each test's name and
docstring. Where SGLang dies, the emulator must exit; where it survives, it must not; where it hangs
(0.5.6 without a watchdog), HTTP must stay up and the call must never answer. Both directions are tested.

Rows that keep the server serving share one emulator per version (`fleet`, started once for the module, in
parallel); rows that kill or hang it start their own emulators, all versions at once, then check each."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import Emulator, Reply, http, wait_until, write_weights

from rljob.emulator.config import parse_config, startup_error
from rljob.emulator.fatal import StartupError
from rljob.emulator.rendezvous import Rank0
from rljob.emulator.versions import SUPPORTED_VERSIONS as VERSIONS
from rljob.testing.ipc_stand_in import cuda_reduction
from rljob.trainer.engines.sglang import packing
from rljob.trainer.engines.sglang.packing import Call, Global, Instance

SESSION_VERSIONS = ("0.5.21", "0.5.23")  # tensor refits only inside begin/end (C-ROUTE-SESSION)
SHARED_FLAGS = ("--enable-metrics", "--health-check-timeout", "0.5", "--weight-update-group-timeout", "1")
STRICT_IDLE = ("0.5.15.post1", "0.5.20")  # is_fully_idle(): retracted (waiting) requests always count
GROUP = {"master_address": "127.0.0.1", "rank_offset": 1, "world_size": 2}


# --- helpers ---------------------------------------------------------------------------------------


def _start_all(
    start: Callable[..., Emulator], specs: dict[str, tuple[str, tuple[str, ...]]], **kw: Any
) -> dict[str, Emulator]:
    """name -> (version, flags): started at once, then waited for."""
    emus = {name: start(version, *flags, **kw) for name, (version, flags) in specs.items()}
    for emu in emus.values():
        emu.wait_ready(30)
    return emus


def _kill_all(emus: Any) -> None:
    """Stop emulators at once (SIGKILL): nothing of theirs is looked at any more."""
    procs = list(emus.values()) if isinstance(emus, dict) else list(emus)
    for e in procs:
        if e.alive():
            e.popen.kill()
    for e in procs:
        with contextlib.suppress(Exception):
            e.popen.wait(5)


def _background(call: Callable[[], Any]) -> dict[str, Any]:
    """Run `call` in a thread; the dict gets "result" or "error", and "thread"."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = call()
        except Exception as e:  # the call's failure is what some tests look at
            out["error"] = e

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def _generate(emu: Emulator, n: int, *, text: str = "a b c", timeout: float = 30, **extra: Any) -> Reply:
    body = {"text": text, "sampling_params": {"max_new_tokens": n}, **extra}
    return emu.call("POST", "/generate", body, timeout=timeout)


def _running(emu: Emulator, n: int = 500, **extra: Any) -> dict[str, Any]:
    """A request that runs for a while (n tokens), in the background, once it runs."""
    before = emu.stats()["running"]
    job = _background(lambda: _generate(emu, n, **extra))
    wait_until(lambda: emu.stats()["running"] > before, 5, "the request to run")
    return job


def _idle(emu: Emulator) -> None:
    wait_until(lambda: emu.stats()["fully_idle"], 10, "every request to leave the scheduler")


def _dropped(emu: Emulator, method: str, path: str, body: Any = None) -> None:
    """The server died under the call: the connection is dropped, never answered."""
    try:
        r = emu.call(method, path, body, timeout=10)
    except (ConnectionError, urllib.error.URLError, OSError) as e:
        assert not isinstance(e, TimeoutError), f"{path} hung instead of dropping the connection"
        return
    raise AssertionError(f"{path} answered {r.status} {r.text[:200]}; SGLang would have died")


def _dies(emu: Emulator, text: str) -> None:
    code = emu.wait_exit(10)
    assert code != 0, f"exit code {code}"
    assert text in emu.log_text(), emu.log_text()[-2000:]


def _hangs(emu: Emulator, method: str, path: str, body: Any = None, seconds: float = 0.5) -> None:
    """No answer within `seconds`, and the process is still up (0.5.6's dead scheduler)."""
    try:
        r = emu.call(method, path, body, timeout=seconds)
    except TimeoutError:
        assert emu.alive()
        return
    except urllib.error.URLError as e:
        assert isinstance(e.reason, (TimeoutError, socket.timeout)), e
        assert emu.alive()
        return
    raise AssertionError(f"{path} answered {r.status} {r.text[:200]}; it should hang")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Emulator]]:
    """One serving emulator per version for the rows that leave it serving (each test restores it)."""
    tmp = tmp_path_factory.mktemp("fleet")
    emus = {v: Emulator(tmp, v, *SHARED_FLAGS, tps=50) for v in VERSIONS}
    try:
        for emu in emus.values():
            emu.wait_ready(30)
        yield emus
    finally:
        _kill_all(emus)
        for emu in emus.values():
            emu.stop()


def _shared(e: Emulator) -> Iterator[Emulator]:
    """A shared emulator, checked alive before and after the test and left unpaused, idle, unreleased."""
    assert e.alive(), e.log_text()[-3000:]
    yield e
    assert e.alive(), "the shared emulator died:\n" + e.log_text()[-3000:]
    e.call("POST", "/continue_generation", {})
    _idle(e)
    st = e.stats()
    assert st["offload_tags"] == [] and not st["paused"], f"test left the emulator {st}"


@pytest.fixture
def emu(fleet: dict[str, Emulator], version: str) -> Iterator[Emulator]:
    yield from _shared(fleet[version])


def _params(versions: tuple[str, ...] = VERSIONS) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("version", versions)


# --- routes ----------------------------------------------------------------------------------------


@_params()
def test_c_route_pause_and_c_drain_abort(emu: Emulator, version: str) -> None:
    """C-ROUTE-PAUSE, C-DRAIN-ABORT, C-DRAIN-TIMING: the default mode is abort; it is tokenizer-only (the
    scheduler is not paused) and returns once every in-flight request was answered, aborted: after its
    1 s sleep when a request was in flight, at once when none was."""
    job = _running(emu)
    started = time.monotonic()
    r = emu.call("POST", "/pause_generation", {})
    assert time.monotonic() - started >= 1.0  # abort, model-update lock held, sleep 1 s, abort, free
    assert r.status == 200 and r.body == {"message": "Generation paused successfully.", "status": "ok"}
    assert emu.stats()["in_flight"] == 0  # every in-flight request was answered before the reply
    job["thread"].join(5)
    assert "result" in job and job["result"].body["meta_info"]["finish_reason"]["type"] == "abort"
    st = emu.stats()
    assert st["paused"] and st["pause_mode"] == "abort" and not st["scheduler_paused"], st
    blocked = _background(lambda: _generate(emu, 2))
    time.sleep(0.3)
    assert "result" not in blocked  # new requests wait while paused; they are not refused
    assert emu.call("POST", "/continue_generation", {}).status == 200
    blocked["thread"].join(5)
    assert blocked["result"].status == 200
    _idle(emu)
    started = time.monotonic()
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    assert time.monotonic() - started < 0.5  # nothing in flight: one abort-all, no sleep


@_params()
def test_c_drain_timing_continue_waits_for_the_abort_drain(emu: Emulator, version: str) -> None:
    """C-DRAIN-TIMING: the abort drain holds `is_pause_cond` through its sleeps, and continue_generation
    takes it: a continue sent during the drain answers only after the drain did."""
    _running(emu)
    drain = _background(lambda: emu.call("POST", "/pause_generation", {"mode": "abort"}))
    time.sleep(0.2)
    sent = time.monotonic()
    resumed = _background(lambda: emu.call("POST", "/continue_generation", {}))
    resumed["thread"].join(5)
    waited = time.monotonic() - sent
    drain["thread"].join(5)
    assert drain["result"].status == 200 and resumed["result"].status == 200
    assert waited >= 0.5, waited  # the drain's 1 s sleep, less the 0.2 s before the continue
    assert not emu.stats()["paused"]  # the continue ran second


@_params()
def test_c_drain_abort_first(emu: Emulator, version: str) -> None:
    """C-DRAIN-ABORT-FIRST: abort_request(abort_all) answers at once and ends what runs without pausing;
    once a flush passes, pause(abort) answers at once, where with the same requests in flight it sleeps
    1 s (C-DRAIN-TIMING)."""
    jobs = [_running(emu) for _ in range(3)]
    started = time.monotonic()
    assert emu.call("POST", "/abort_request", {"abort_all": True}).status == 200
    assert time.monotonic() - started < 0.5
    wait_until(lambda: emu.call("POST", "/flush_cache").status == 200, 5, "the aborted requests to leave")
    assert not emu.stats()["paused"]
    started = time.monotonic()
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    assert time.monotonic() - started < 0.5, "the pause slept: a request was still in flight"
    for job in jobs:
        job["thread"].join(5)
        assert job["result"].body["meta_info"]["finish_reason"]["type"] == "abort"
    emu.call("POST", "/continue_generation", {})
    jobs = [_running(emu) for _ in range(3)]
    started = time.monotonic()
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    assert time.monotonic() - started >= 0.9  # in flight: the abort loop's 1 s
    for job in jobs:
        job["thread"].join(5)


@_params()
def test_c_pause_generate_waits(emu: Emulator, version: str) -> None:
    """C-PAUSE-GENERATE-WAITS: a /generate sent while paused waits in the tokenizer (the scheduler never
    sees it) and answers after continue_generation."""
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    job = _background(lambda: _generate(emu, 2))
    time.sleep(0.5)
    assert job["thread"].is_alive() and emu.stats()["running"] == 0 and emu.stats()["waiting"] == 0
    assert emu.call("POST", "/continue_generation", {}).status == 200
    job["thread"].join(5)
    assert job["result"].status == 200


@_params()
def test_c_idle_after_reply_release(emu: Emulator, version: str) -> None:
    """C-IDLE-AFTER-REPLY: a request is released and filtered out of the batch before its reply leaves
    the tokenizer, so a release sent as soon as /generate answered passes the idle assert on every
    version (SGLang's own test_release_memory_occupation does generate, then release)."""
    for _ in range(3):
        assert _generate(emu, 4).status == 200
        r = emu.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert r.status == 200 and emu.alive(), (r.status, r.text)
        assert emu.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200


@_params()
def test_c_idle_after_reply_disk_refit(emu: Emulator, version: str, tmp_path: Path) -> None:
    """C-IDLE-AFTER-REPLY: a disk refit with the default flush_cache=true sent as soon as /generate answered
    flushes (the post-refit flush is fatal on ≤0.5.21 and 400 on 0.5.23 when the rank is not idle)."""
    ckpt = str(write_weights(tmp_path, "21"))
    for _ in range(3):
        assert _generate(emu, 4).status == 200
        r = emu.call("POST", "/update_weights_from_disk", {"model_path": ckpt})
        assert r.status == 200 and r.body["success"] is True, r.text


@_params()
def test_c_drain_retract(emu: Emulator, version: str) -> None:
    """C-DRAIN-RETRACT: running requests go back to the waiting queue (KV freed) and the scheduler is
    paused; after continue they finish with every token."""
    job = _running(emu, 30)
    assert emu.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    st = emu.stats()
    assert (st["running"], st["waiting"], st["scheduler_paused"]) == (0, 1, True), st
    assert emu.call("POST", "/continue_generation", {}).status == 200
    job["thread"].join(10)
    assert job["result"].body["meta_info"]["completion_tokens"] == 30


@_params()
def test_c_drain_in_place(emu: Emulator, version: str) -> None:
    """C-DRAIN-INPLACE: the running batch and its KV stay; the server is not idle, so a flush is refused."""
    job = _running(emu)
    assert emu.call("POST", "/pause_generation", {"mode": "in_place"}).status == 200
    st = emu.stats()
    assert (st["running"], st["waiting"], st["scheduler_paused"], st["idle"]) == (1, 0, True, False), st
    assert emu.call("POST", "/flush_cache").status == 400
    emu.call("POST", "/abort_request", {"abort_all": True})
    emu.call("POST", "/continue_generation", {})
    job["thread"].join(10)


@_params()
def test_c_idle_flush_after_retract(emu: Emulator, version: str) -> None:
    """C-IDLE-FLUSH: the plain flush after a retract with a request waiting: 0.5.6 never counts the waiting
    queue, 0.5.15.post1-0.5.20 always do, 0.5.21+ ignore it while the scheduler is paused."""
    _running(emu)
    emu.call("POST", "/pause_generation", {"mode": "retract"})
    r = emu.call("POST", "/flush_cache")
    if version in STRICT_IDLE:
        assert r.status == 400 and r.text == "Flush cache failed.\n", r.text
    else:
        assert r.status == 200 and r.text.startswith("Cache flushed."), r.text
    emu.call("POST", "/abort_request", {"abort_all": True})


@_params()
def test_c_idle_flush_deferred(emu: Emulator, version: str) -> None:
    """C-IDLE-FLUSH-DEFERRED, C-ROUTE-FLUSH: `?timeout=` (from 0.5.10) parks the flush until the scheduler is
    fully idle, counting waiting requests even while paused, so after a retract with a request it always
    times out; a second flush waits behind the parked one (FIFO communicator). 0.5.6 ignores the parameter."""
    _running(emu)
    emu.call("POST", "/pause_generation", {"mode": "retract"})
    started = time.monotonic()
    deferred = _background(lambda: (emu.call("POST", "/flush_cache?timeout=0.6"), time.monotonic() - started))
    time.sleep(0.1)
    second = emu.call("POST", "/flush_cache")
    second_done = time.monotonic() - started
    deferred["thread"].join(5)
    r, elapsed = deferred["result"]
    if version == "0.5.6":
        assert r.status == 200 and r.text.startswith("Cache flushed.") and elapsed < 0.5
        assert second.status == 200
    else:
        assert r.status == 400 and r.text == "Timed out waiting for idle state.", r.text
        assert elapsed >= 0.6 and second_done >= 0.6  # the plain flush waited behind the parked one
        assert second.status == (400 if version in STRICT_IDLE else 200)
    emu.call("POST", "/abort_request", {"abort_all": True})
    emu.call("POST", "/continue_generation", {})
    _idle(emu)
    if version != "0.5.6":  # not paused, running: the deferred flush answers once the request finished
        _running(emu, 10)
        started = time.monotonic()
        r = emu.call("POST", "/flush_cache?timeout=5")
        assert r.status == 200 and 0.05 < time.monotonic() - started < 5


@_params()
def test_c_route_release_resume_and_c_mem_dup_tag_release(emu: Emulator, version: str) -> None:
    """C-ROUTE-RELEASE / C-ROUTE-RESUME: null or [] means every tag, the reply is `null`.
    C-MEM-DUP-TAG-RELEASE: a tag repeated in one release is paused once; nothing dies."""
    _idle(emu)
    r = emu.call("POST", "/release_memory_occupation", {"tags": None})
    assert (r.status, r.text) == (200, "null")
    assert emu.stats()["offload_tags"] == ["cuda_graph", "kv_cache", "weights"]
    assert emu.call("POST", "/resume_memory_occupation", {"tags": []}).status == 200
    r = emu.call("POST", "/release_memory_occupation", {"tags": ["kv_cache", "kv_cache"]})
    assert r.status == 200 and emu.memory()[0]["regions"]["kv_cache"] == 0
    assert emu.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    assert emu.alive() and emu.memory()[0]["regions"]["kv_cache"] > 0


@_params()
def test_c_route_validation(emu: Emulator, version: str) -> None:
    """C-ROUTE-VALIDATION: every body route requires a body: empty or null is 400 in SGLang's error shape,
    as is an invalid field; never 422."""
    for raw in (b"", b"null"):
        for path in ("/pause_generation", "/continue_generation", "/release_memory_occupation"):
            r = http("POST", emu.url + path, raw=raw)
            assert r.status == 400 and r.body["object"] == "error" and r.body["code"] == 400, (path, r.text)
    r = emu.call("POST", "/pause_generation", {"mode": "sideways"})
    assert r.status == 400 and r.body["type"] == "Bad Request"
    assert not emu.stats()["paused"]


@_params()
def test_c_route_checker(emu: Emulator, version: str) -> None:
    """C-ROUTE-CHECKER: 0.5.6 is POST only with `action` required; later GET|POST, action defaults (to
    checksum, which 0.5.6 does not know: C-CHECKER-CHECKSUM)."""
    r = emu.call("POST", "/weights_checker", {"action": "snapshot"})
    assert r.status == 200 and r.body["success"] is True
    get, empty = emu.call("GET", "/weights_checker"), emu.call("POST", "/weights_checker", {})
    if version == "0.5.6":
        assert get.status == 405 and empty.status == 400
    else:
        assert get.status == 200 and empty.status == 200


@_params()
def test_c_checker_checksum_and_c_checker_hash(emu: Emulator, version: str, tmp_path: Path) -> None:
    """C-CHECKER-CHECKSUM: the checksum action from 0.5.15.post1, one entry per GPU with each parameter's
    hash (C-CHECKER-HASH: SGLang's tensor_hash of what was loaded) and the sha256 over sorted (name, hash);
    0.5.6 answers 400 "Unsupported action='checksum'". An action no version knows is the same 400."""
    import hashlib

    from rljob.trainer.engines.sglang.digest import checkpoint_digest

    unknown = emu.call("POST", "/weights_checker", {"action": "audit"})
    assert unknown.status == 400 and unknown.body == {
        "success": False,
        "message": "Unsupported action='audit'",
    }
    r = emu.call("POST", "/weights_checker", {"action": "checksum"})
    if version == "0.5.6":
        assert r.status == 400 and r.body == {"success": False, "message": "Unsupported action='checksum'"}
        return
    ckpt = write_weights(tmp_path, "7")
    assert emu.call("POST", "/update_weights_from_disk", {"model_path": str(ckpt)}).status == 200
    r = emu.call("POST", "/weights_checker", {"action": "checksum"})
    assert r.status == 200 and r.body["success"] is True and r.body["message"] == "Success."
    (rank,) = r.body["ranks"]
    assert list(rank) == ["checksums", "per_gpu_checksum", "parallelism_info"]
    assert rank["checksums"] == checkpoint_digest(ckpt).parameters
    h = hashlib.sha256()
    for name in sorted(rank["checksums"]):
        h.update(name.encode() + rank["checksums"][name].encode())
    assert rank["per_gpu_checksum"] == h.hexdigest()
    assert r.body["per_engine_checksum"] == hashlib.sha256(h.hexdigest().encode()).hexdigest()
    place = rank["parallelism_info"]
    if version in ("0.5.21", "0.5.23"):  # a list, one entry per role
        (place,) = place
        assert place.pop("role") == "target"
    assert place == {"tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
                     "rank": 0, "size": 1}  # fmt: skip


@_params()
def test_c_checker_layout(dp: Emulator, version: str) -> None:
    """C-CHECKER-LAYOUT: every DP rank answers with its own entry (whole replicas: the same hashes)."""
    r = dp.call("POST", "/weights_checker", {"action": "checksum"})
    if version == "0.5.6":
        assert r.status == 400 and r.body["message"] == " | ".join(["Unsupported action='checksum'"] * 2)
        return
    assert r.status == 200 and r.body["message"] == "Success. | Success."
    ranks = r.body["ranks"]
    places = [x["parallelism_info"][0] if isinstance(x["parallelism_info"], list) else x["parallelism_info"]
              for x in ranks]  # fmt: skip
    assert [(p["dp_rank"], p["dp_size"]) for p in places] == [(0, 2), (1, 2)]
    assert ranks[0]["per_gpu_checksum"] == ranks[1]["per_gpu_checksum"]


@_params()
def test_c_route_wv_set(emu: Emulator, version: str, tmp_path: Path) -> None:
    """C-ROUTE-WV-SET: /update_weight_version exists on every version and sets what /model_info serves."""
    r = emu.call("POST", "/update_weight_version", {"new_version": "set-7", "abort_all_requests": False})
    assert r.status == 200
    assert r.body == {"success": True, "message": "Weight version updated to set-7", "new_version": "set-7"}
    assert emu.call("GET", "/model_info").body["weight_version"] == "set-7"


@_params()
def test_c_refit_wv_paused(emu: Emulator, version: str, tmp_path: Path) -> None:
    """C-REFIT-WV-PAUSED: on 0.5.6 a refit while paused does not record weight_version (no "Weight version
    updated" in the message); /update_weight_version then sets it. Not paused, or on later versions, the
    refit records it."""
    _idle(emu)
    ckpt = write_weights(tmp_path, "31")
    emu.call("POST", "/pause_generation", {"mode": "abort"})
    r = emu.call("POST", "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "p31"})
    assert r.status == 200 and r.body["success"], r.text
    served = emu.call("GET", "/model_info").body["weight_version"]
    if version == "0.5.6":
        assert "Weight version updated" not in r.body["message"] and served != "p31"
        fixed = emu.call(
            "POST", "/update_weight_version", {"new_version": "p31", "abort_all_requests": False}
        )
        assert fixed.status == 200
        assert emu.call("GET", "/model_info").body["weight_version"] == "p31"
    else:
        assert r.body["message"].endswith("Weight version updated to p31.") and served == "p31"
    emu.call("POST", "/continue_generation", {})
    r = emu.call("POST", "/update_weights_from_disk", {"model_path": str(ckpt), "weight_version": "u31"})
    assert r.status == 200 and r.body["message"].endswith("Weight version updated to u31.")
    assert emu.call("GET", "/model_info").body["weight_version"] == "u31"


@_params()
def test_c_route_continue_and_c_route_disk(emu: Emulator, version: str, tmp_path: Path) -> None:
    """C-ROUTE-CONTINUE: `torch_empty_cache` (0.5.15.post1+) is accepted everywhere (0.5.6 ignores it).
    C-ROUTE-DISK: reply {success, message, num_paused_requests}, on 400 too; a path that does not load is
    400 and the old weights stay."""
    emu.call("POST", "/pause_generation", {"mode": "abort"})
    assert emu.call("POST", "/continue_generation", {"torch_empty_cache": False}).status == 200
    _idle(emu)
    before = emu.weights()["checksum"]
    r = emu.call("POST", "/update_weights_from_disk", {"model_path": str(tmp_path / "missing")})
    assert r.status == 400 and r.body["success"] is False and "Failed to update weights" in r.body["message"]
    assert set(r.body) == {"success", "message", "num_paused_requests"}  # the 400 has the same fields
    assert emu.weights()["checksum"] == before
    r = emu.call("POST", "/update_weights_from_disk", {"model_path": str(write_weights(tmp_path, "8"))})
    assert r.status == 200 and set(r.body) == {"success", "message", "num_paused_requests"}


@_params()
def test_c_refit_lock(emu: Emulator, version: str, tmp_path: Path) -> None:
    """C-REFIT-LOCK: a refit while not paused takes the model-update writer lock, so it waits for the
    in-flight requests; while paused it runs at once."""
    ckpt = str(write_weights(tmp_path, "9"))
    job = _running(emu, 25)  # 0.5 s at 50 tokens/s
    started = time.monotonic()
    # the post-refit flush passes: the request left the scheduler before its reply (C-IDLE-AFTER-REPLY)
    r = emu.call("POST", "/update_weights_from_disk", {"model_path": ckpt})
    assert r.status == 200 and time.monotonic() - started > 0.2
    # The request's reply went out before the refit ran; its client thread may store it a little later.
    job["thread"].join(10)
    reply = job["result"]
    assert reply.status == 200 and reply.body["meta_info"]["finish_reason"]["type"] == "length"
    _idle(emu)
    emu.call("POST", "/pause_generation", {"mode": "abort"})
    started = time.monotonic()
    assert (
        emu.call("POST", "/update_weights_from_disk", {"model_path": ckpt, "flush_cache": False}).status
        == 200
    )
    assert time.monotonic() - started < 0.5


# --- tensor pushes (C-REFIT-TENSOR-*) ---------------------------------------------------------------


def _cuda_reduction(nbytes: int) -> Call:
    """Shaped as torch's reduce_tensor of a 1-D uint8 CUDA tensor (its 15 rebuild arguments)."""
    return cuda_reduction(nbytes, device="GPU-0", handle=b"h" * 64, ref_counter=b"/torch_1", event=b"e" * 64)


def local_serialized_push(version: str, names: tuple[str, ...] = ("w", "b")) -> str:
    """verl's push (sglang/srt/weight_sync/utils.py:31-99@0.5.6): [(name, LocalSerializedTensor(values=[the
    tensor pickled for TP rank 0]))], pickled and base64-encoded, with the class at the version's path."""
    module = (
        "sglang.srt.model_executor.model_runner"
        if version in ("0.5.6", "0.5.15.post1")
        else "sglang.srt.model_executor.model_runner_components.weight_updater"
    )
    local = Global(module, "LocalSerializedTensor")
    items = [(n, Instance(local, {"values": [packing.dumps(_cuda_reduction(8))]})) for n in names]
    return packing.to_wire(packing.dumps(items))


def _tensor_push(emu: Emulator, version: str, body: dict[str, Any]) -> Reply:
    """One update_weights_from_tensor, in a weight-update session where the version needs one."""
    session = version in SESSION_VERSIONS
    if session:
        assert emu.call("POST", "/begin_weight_update", {}).status == 200
    try:
        return emu.call("POST", "/update_weights_from_tensor", body)
    finally:
        if session and emu.alive():
            emu.call("POST", "/end_weight_update", {})


@_params()
def test_c_refit_tensor_local(emu: Emulator, version: str) -> None:
    """C-REFIT-TENSOR-LOCAL: a LocalSerializedTensor push (verl's format) is unwrapped per TP rank and
    loaded: 200 on every version."""
    body = {"serialized_named_tensors": [local_serialized_push(version)], "weight_version": "L1"}
    r = _tensor_push(emu, version, body)
    assert r.status == 200 and r.body["success"] is True, r.text
    w = emu.weights()
    assert (w["source"], w["tensors"]) == ("tensor", 2)


@_params(tuple(v for v in VERSIONS if v != "0.5.6"))
def test_c_refit_tensor_b64_is_a_validation_error(emu: Emulator, version: str) -> None:
    """C-REFIT-TENSOR-B64: from 0.5.15.post1 the body's `Base64Bytes` field decodes the payloads, so text
    that is not base64 is a validation error: 400 in the ErrorResponse shape, and the server lives (0.5.6
    dies: test_emulator_dies.py)."""
    r = _tensor_push(emu, version, {"serialized_named_tensors": ["not base64!"], "flush_cache": False})
    assert r.status == 400, r.text
    assert set(r.body) == {"object", "message", "type", "param", "code"} and r.body["code"] == 400
    assert "base64" in r.body["message"]


# --- refit groups ----------------------------------------------------------------------------------


@_params()
def test_c_refit_group_block(emu: Emulator, version: str) -> None:
    """C-REFIT-GROUP-BLOCK: init_weights_update_group answers only once the trainer side (group rank 0)
    hosts the store and every rank joined; meanwhile the scheduler is stuck, so other scheduler calls wait
    (tokenizer-only ones answer). Nobody at master_port: 400 "Failed to initialize custom process group"
    after the timeout (1 s here)."""
    started = time.monotonic()
    r = emu.call("POST", "/init_weights_update_group", {**GROUP, "master_port": 1})
    assert r.status == 400 and r.body["message"].startswith("Failed to initialize custom process group: ")
    assert time.monotonic() - started >= 1.0
    with Rank0(0, world_size=2) as rank0:
        init = _background(
            lambda: emu.call("POST", "/init_weights_update_group", {**GROUP, "master_port": rank0.port})
        )
        time.sleep(0.15)
        flush = _background(lambda: emu.call("POST", "/flush_cache"))
        time.sleep(0.2)
        assert "result" not in init and "result" not in flush  # both wait for the group
        assert emu.call("GET", "/model_info", timeout=2).status == 200  # the tokenizer alone answers
        assert rank0.wait(5) == [1]
    init["thread"].join(5)
    flush["thread"].join(5)
    assert init["result"].status == 200 and init["result"].body["success"] is True
    assert flush["result"].status == 200
    # C-ROUTE-DIST: with the group formed, a distributed refit (in a session from 0.5.21)
    session = emu.call("POST", "/begin_weight_update", {}).status == 200
    assert session == (version in ("0.5.21", "0.5.23"))
    dist = {
        "names": ["w"],
        "dtypes": ["float32"],
        "shapes": [[2]],
        "flush_cache": False,
        "weight_version": "g1",
    }
    r = emu.call("POST", "/update_weights_from_distributed", dist)
    assert r.status == 200 and r.body["success"] is True, r.text
    if session:
        assert emu.call("POST", "/end_weight_update", {}).status == 200
    assert emu.call("POST", "/destroy_weights_update_group", {}).status == 200


# --- health ----------------------------------------------------------------------------------------


@_params()
def test_c_health_generate_and_c_health_ping(emu: Emulator, version: str) -> None:
    """C-HEALTH-GENERATE: /health is 200 when the scheduler answers; while paused the probe waits in the
    tokenizer and /health is 503 after the health timeout, unless other scheduler output (a control reply)
    arrives in the window. C-HEALTH-PING: /ping stays 200 through 0.5.22 after a failed /health; 0.5.23
    answers is_healthy() and is 503 until a /health passes."""
    assert emu.call("GET", "/health").status == 200
    emu.call("POST", "/pause_generation", {"mode": "abort"})
    started = time.monotonic()
    assert emu.call("GET", "/health").status == 503
    assert time.monotonic() - started >= 0.5
    assert emu.call("GET", "/ping").status == (503 if version == "0.5.23" else 200)
    probe = _background(lambda: emu.call("GET", "/health_generate"))
    time.sleep(0.1)
    assert emu.call("POST", "/flush_cache").status == 200  # a control reply: scheduler output
    probe["thread"].join(5)
    assert probe["result"].status == 200
    assert emu.call("GET", "/ping").status == 200
    emu.call("POST", "/continue_generation", {})
    assert emu.call("GET", "/health").status == 200


@_params()
def test_c_health_ready(emu: Emulator, version: str) -> None:
    """C-HEALTH-READY: /ready from 0.5.20, 200 only when not paused and healthy."""
    if version in ("0.5.6", "0.5.15.post1"):
        assert emu.call("GET", "/ready").status == 404
        return
    assert emu.call("GET", "/ready").status == 200
    emu.call("POST", "/pause_generation", {"mode": "abort"})
    assert emu.call("GET", "/ready").status == 503
    emu.call("POST", "/continue_generation", {})
    assert emu.call("GET", "/ready").status == 200


@_params(("0.5.6",))
def test_c_health_released_0_5_6_drops_the_probe(emu: Emulator, version: str) -> None:
    """C-HEALTH-RELEASED: 0.5.6's scheduler drops the health probe while a tag is released: 503 after the
    timeout, and the server lives on (from 0.5.15.post1 the probe runs: test_c_health_released_later)."""
    _idle(emu)
    assert emu.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    assert emu.call("GET", "/health").status == 503
    assert emu.alive()
    assert emu.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    assert emu.call("GET", "/health").status == 200


# --- metrics ---------------------------------------------------------------------------------------


@_params()
def test_c_metric_utilization(emu: Emulator, version: str) -> None:
    """C-METRIC-UTILIZATION: never computed (max_running_requests_under_SLO is never set): 0.0, also with
    a request running."""
    _running(emu, 100)
    metrics = emu.call("GET", "/metrics").text
    assert "\nsglang:utilization{" in metrics and all(
        line.endswith(" 0.0") for line in metrics.splitlines() if line.startswith("sglang:utilization{")
    )
    if version != "0.5.6":
        load = emu.call("GET", "/v1/loads").body["loads"][0]
        assert load["num_running_reqs"] == 1 and load["utilization"] == 0.0
    emu.call("POST", "/abort_request", {"abort_all": True})


def _gauge(metrics: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{")]
    assert len(values) == 1, (name, values)
    return values[0]


@_params()
def test_c_metric_cache_hit(emu: Emulator, version: str) -> None:
    """C-METRIC-CACHE-HIT: cache_hit_rate is hit / (input + hit) of the last prefill batch, not a running
    ratio; a flush does not reset it, the next batch does."""
    emu.call("POST", "/flush_cache")
    prefix = " ".join(f"h{i}" for i in range(30))
    assert _generate(emu, 1, text=f"{prefix} x").status == 200  # 31 tokens, none cached
    batch = _generate(emu, 1, text=[f"{prefix} y", f"{prefix} z"])  # type: ignore[arg-type]
    assert [b["meta_info"]["cached_tokens"] for b in batch.body] == [30, 30]
    rate = round(60 / 62, 4)

    def current() -> float:
        if version == "0.5.6":  # no /v1/loads: the scheduler gauge (--enable-metrics)
            return round(_gauge(emu.call("GET", "/metrics").text, "sglang:cache_hit_rate"), 4)
        return float(emu.call("GET", "/v1/loads").body["loads"][0]["cache_hit_rate"])

    assert current() == rate
    _idle(emu)
    assert emu.call("POST", "/flush_cache").status == 200
    assert current() == rate
    assert _generate(emu, 1, text="fresh words only").status == 200
    assert current() == 0.0


@_params()
def test_c_metric_prom(emu: Emulator, version: str) -> None:
    """C-METRIC-PROM: the cumulative counters and gauges by name, with each version's labels."""
    before = emu.call("GET", "/metrics").text
    prompt = " ".join(f"p{i}" for i in range(12))
    for _ in range(2):  # the second is a prefix-cache hit
        assert _generate(emu, 3, text=prompt).status == 200
    metrics = emu.call("GET", "/metrics").text
    for gauge in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "cache_hit_rate", "token_usage"):
        assert f"\nsglang:{gauge}{{" in metrics, gauge
    lines = {line.split("{", 1)[0]: line for line in metrics.splitlines() if line.startswith("sglang:")}
    counters = {
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:cached_tokens_total",
        "sglang:num_requests_total",
    }
    assert counters <= set(lines), sorted(lines)
    streaming = 'is_streaming="false"' in lines["sglang:prompt_tokens_total"]
    assert streaming == (version not in ("0.5.6", "0.5.15.post1"))
    assert ('cache_source="device"' in lines["sglang:cached_tokens_total"]) == (version != "0.5.6")
    assert ('engine_type="unified"' in lines["sglang:num_requests_total"]) == (version != "0.5.6")
    assert ('moe_ep_rank="0"' in lines["sglang:num_running_reqs"]) == (version != "0.5.6")

    def total(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    assert total(metrics, "sglang:num_requests_total") - total(before, "sglang:num_requests_total") == 2
    assert (
        total(metrics, "sglang:generation_tokens_total") - total(before, "sglang:generation_tokens_total")
        == 6
    )
    grew = total(metrics, "sglang:cached_tokens_total") - total(before, "sglang:cached_tokens_total")
    assert grew >= 12  # the second request's prompt came from the radix cache


@_params()
def test_c_metric_load_route(emu: Emulator, version: str) -> None:
    """C-METRIC-LOAD-ROUTE: 0.5.6 /get_load (exact fields, from the scheduler); 0.5.15.post1-0.5.20 the
    shim over /v1/loads; /v1/loads from 0.5.15.post1 with dp_rank and include filters."""
    _running(emu, 100)
    load, loads = emu.call("GET", "/get_load"), emu.call("GET", "/v1/loads?include=core")
    if version == "0.5.6":
        assert load.status == 200 and load.body == [
            {"dp_rank": 0, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": load.body[0]["num_tokens"]}
        ]
        assert loads.status == 404
    else:
        assert loads.status == 200 and [x["num_running_reqs"] for x in loads.body["loads"]] == [1]
        assert emu.call("GET", "/v1/loads?dp_rank=1").body["loads"] == []
        assert emu.call("GET", "/v1/loads?include=bogus").status == 400
        shim = version in ("0.5.15.post1", "0.5.20")
        assert load.status == (200 if shim else 404)
        if shim:
            assert set(load.body[0]) == {
                "dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens", "num_pending_tokens", "ts_tic",
            }  # fmt: skip
    emu.call("POST", "/abort_request", {"abort_all": True})


def test_c_metric_device_timer(start_emulator: Callable[..., Emulator]) -> None:
    """C-METRIC-DEVICE-TIMER: with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1 and --enable-metrics, /metrics counts
    forward-pass GPU seconds by category once a pass ran (0.5.10.post1 under its own name and category);
    0.5.6 has no device timer; without the env no version serves the counter."""
    flags = ("--enable-metrics", "--saturation-batch", "1")  # one running request keeps the GPU busy
    on = {"SGLANG_ENABLE_METRICS_DEVICE_TIMER": "1"}
    emus = _start_all(start_emulator, {v: (v, flags) for v in (*VERSIONS, V10)}, env=on, tps=200)
    emus |= _start_all(start_emulator, {"off": ("0.5.15.post1", flags)}, tps=200)
    want = {
        "0.5.6": None,
        V10: ("sglang:gpu_execution_seconds_total{", 'category="forward_decode"'),
        "off": None,
    }
    for name, emu in emus.items():
        assert "execution_seconds_total{" not in emu.call("GET", "/metrics").text, name  # no pass timed yet
        assert _generate(emu, 20).status == 200
        lines = [x for x in emu.call("GET", "/metrics").text.splitlines() if "execution_seconds_total{" in x]
        expected = want.get(name, ("sglang:forward_execution_seconds_total{", 'category="decode"'))
        if expected is None:
            assert lines == [], (name, lines)
            continue
        assert len(lines) == 1 and lines[0].startswith(expected[0]) and expected[1] in lines[0], (name, lines)
        assert 'tp_rank="0"' in lines[0]
        assert 0.05 < float(lines[0].rsplit(" ", 1)[1]) < 10, lines  # 20 tokens at 200/s: about 0.1 s


# --- auth ------------------------------------------------------------------------------------------


def test_c_metric_load_asgi(start_emulator: Callable[..., Emulator]) -> None:
    """C-METRIC-LOAD-ASGI: under FastAPI >= 0.137 (`--fastapi-lazy-routers`) with --enable-metrics,
    0.5.15.post1 answers /v1/loads with 500 and /get_load with 200; 0.5.20 on read the route's path with a
    default (200); 0.5.6 has no /v1/loads. Without --enable-metrics the middleware is not there: 200."""
    flags = ("--enable-metrics", "--fastapi-lazy-routers")
    specs = {v: (v, flags) for v in VERSIONS} | {"off": ("0.5.15.post1", flags[1:])}
    emus = _start_all(start_emulator, specs)
    want = {"0.5.6": 404, "0.5.15.post1": 500, "off": 200}
    for name, emu in emus.items():
        r = emu.call("GET", "/v1/loads?include=core")
        assert r.status == want.get(name, 200), (name, r.status, r.text[:200])
        if r.status == 500:
            assert r.text == "Internal Server Error" and emu.call("GET", "/get_load").status == 200


def test_c_route_auth(start_emulator: Callable[..., Emulator]) -> None:
    """C-ROUTE-AUTH on every version: 0.5.6 has one key, required everywhere but /health* and /metrics*
    (so /ping needs it); from 0.5.15.post1 control routes take only the admin key when one is set, other
    routes the api key; /ready* is open from 0.5.20."""
    keys = ("--api-key", "user", "--admin-api-key", "admin", "--enable-metrics")
    emus = _start_all(start_emulator, {v: (v, keys) for v in VERSIONS})
    for version, e in emus.items():
        assert e.call("GET", "/health").status == 200, version
        assert e.call("GET", "/metrics").status == 200, version
        assert e.call("GET", "/ping").status == 401, version
        assert e.call("GET", "/ping", token="user").status == 200, version
        assert e.call("GET", "/model_info").status == 401, version
        assert e.call("GET", "/model_info", token="user").status == 200, version
        user_flush = e.call("POST", "/flush_cache", token="user").status
        admin_flush = e.call("POST", "/flush_cache", token="admin").status
        ready = e.call("GET", "/ready").status
        if version == "0.5.6":  # --admin-api-key does not exist: ignored
            assert (user_flush, admin_flush, ready) == (200, 401, 401), version
        else:
            assert (user_flush, admin_flush) == (401, 200), version
            assert ready == (401 if version == "0.5.15.post1" else 200), version


# --- where SGLang dies, survives or hangs ---------------------------------------------------------


@pytest.mark.emulator_may_die
def test_c_idle_release_after_retract(start_emulator: Callable[..., Emulator]) -> None:
    """C-IDLE-RELEASE: a release after a retract with a request waiting asserts idleness with the plain
    flush's predicate: fatal on 0.5.15.post1 and 0.5.20 (waiting counts), survived on 0.5.6 (never counts),
    0.5.21 and 0.5.23 (ignored while paused)."""
    emus = _start_all(start_emulator, {v: (v, ()) for v in VERSIONS}, tps=50)
    for e in emus.values():
        _running(e)
        assert e.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    for version, e in emus.items():
        if version in STRICT_IDLE:
            _dropped(e, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
            _dies(e, "release_memory_occupation should be called only when server is idle.")
        else:
            r = e.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
            assert r.status == 200, (version, r.text)
            assert e.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}).status == 200
            e.call("POST", "/continue_generation", {})
            wait_until(lambda e=e: e.stats()["running"] == 1, 5, "the retracted request to run again")
            assert e.alive(), version
    _kill_all(emus)


@pytest.mark.emulator_may_die
def test_c_refit_flush_retract(start_emulator: Callable[..., Emulator], tmp_path: Path) -> None:
    """C-REFIT-FLUSH-RETRACT: a refit with flush_cache:true after a retract with a request waiting flushes
    with the plain predicate: the assert kills 0.5.15.post1 and 0.5.20; 0.5.6, 0.5.21, 0.5.23 flush."""
    emus = _start_all(start_emulator, {v: (v, ()) for v in VERSIONS}, tps=50)
    ckpt = str(write_weights(tmp_path, "5"))
    for e in emus.values():
        _running(e)
        assert e.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    for version, e in emus.items():
        body = {"model_path": ckpt, "weight_version": "5", "flush_cache": True}
        if version in STRICT_IDLE:
            _dropped(e, "POST", "/update_weights_from_disk", body)
            _dies(e, "Cache flush failed after updating weights")
        else:
            r = e.call("POST", "/update_weights_from_disk", body)
            assert r.status == 200 and r.body["success"] is True, (version, r.text)
            assert e.alive()
    _kill_all(emus)


@pytest.mark.emulator_may_die
def test_c_checker_released(start_emulator: Callable[..., Emulator]) -> None:
    """C-CHECKER-RELEASED: a checksum with the weights released reads unmapped memory: fatal."""
    emu = start_emulator("0.5.23", wait_ready=True)
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    assert emu.call("POST", "/release_memory_occupation", {"tags": ["weights"]}).status == 200
    _dropped(emu, "POST", "/weights_checker", {"action": "checksum"})
    _dies(emu, "an illegal memory access was encountered")


@pytest.mark.emulator_may_die
def test_c_mem_double_release_and_c_death_hard(start_emulator: Callable[..., Emulator]) -> None:
    """C-MEM-DOUBLE-RELEASE: a second release of a released tag makes torch_memory_saver exit(1) in the
    scheduler. From 0.5.10 the watchdog takes the server down; on 0.5.6 (C-DEATH-HARD) HTTP stays up,
    /ping answers 200, every call that needs the scheduler hangs and /health fails. Without the memory
    saver the second release does nothing."""
    specs: dict[str, tuple[str, tuple[str, ...]]] = {
        v: (v, ("--health-check-timeout", "0.5")) for v in VERSIONS
    }
    emus = _start_all(start_emulator, specs)
    plain = _start_all(
        start_emulator, {f"plain-{v}": (v, ()) for v in ("0.5.6", "0.5.23")}, memory_saver=False
    )
    for e in [*emus.values(), *plain.values()]:
        assert e.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    for name, e in plain.items():
        assert e.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200, name
        assert e.alive()
    for version, e in emus.items():
        if version != "0.5.6":
            _dropped(e, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
            _dies(e, "Cannot pause allocation that is not active")
            assert "Triggering SIGQUIT" in e.log_text()
            continue
        _hangs(e, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
        assert "Cannot pause allocation that is not active" in e.log_text()
        assert e.call("GET", "/ping").status == 200
        assert e.call("GET", "/model_info").status == 200  # tokenizer-only
        for method, path, body in (
            ("POST", "/flush_cache", None),
            ("GET", "/get_load", None),
            ("GET", "/server_info", None),
            ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
            ("POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}}),
        ):
            _hangs(e, method, path, body)
        assert e.call("GET", "/health").status == 503
        assert e.call("GET", "/ping").status == 200  # 0.5.6: /ping never follows health
        assert e.alive()
    _kill_all([*emus.values(), *plain.values()])


@pytest.mark.emulator_may_die
def test_c_death_hard_scheduler_killed(start_emulator: Callable[..., Emulator]) -> None:
    """C-DEATH-HARD: the scheduler process killed (SIGKILL, OOM-kill: --fault-scheduler-kill-after, or
    /_emulator/kill_scheduler). 0.5.6 keeps HTTP up with /ping 200 and hanging scheduler calls; from 0.5.10
    the watchdog exits the server."""
    emus = {v: start_emulator(v, "--fault-scheduler-kill-after", "1") for v in VERSIONS}
    by_route = start_emulator("0.5.6")
    by_route.wait_ready(30)
    assert by_route.call("POST", "/_emulator/kill_scheduler").status == 200
    _hangs(by_route, "POST", "/flush_cache")
    assert by_route.call("GET", "/ping").status == 200
    for version, e in emus.items():
        if version != "0.5.6":
            _dies(e, "Triggering SIGQUIT")  # after "ready to roll": it did start
            assert "ready to roll" in e.log_text()
            continue
        e.wait_ready(30)
        wait_until(lambda e=e: e.stats()["scheduler_dead"], 10, "the scheduler to be killed")
        assert e.alive() and e.call("GET", "/ping").status == 200
        _hangs(e, "POST", "/generate", {"text": "x", "sampling_params": {"max_new_tokens": 1}})
        _hangs(e, "GET", "/server_info")
    _kill_all([*emus.values(), by_route])


@pytest.mark.emulator_may_die
def test_c_health_released_later(start_emulator: Callable[..., Emulator]) -> None:
    """C-HEALTH-RELEASED from 0.5.15.post1: nothing drops the probe while a tag is released, so an idle,
    unpaused scheduler runs it on unmapped memory and dies (expected, not run on a GPU: the table's
    "left unconfirmed"). 0.5.6: test_c_health_released_0_5_6_drops_the_probe."""
    emus = _start_all(start_emulator, {v: (v, ()) for v in VERSIONS if v != "0.5.6"})
    for e in emus.values():
        assert e.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200
        _dropped(e, "GET", "/health")
    for e in emus.values():
        _dies(e, "illegal memory access")


# --- launch ----------------------------------------------------------------------------------------

GRAPHS_IN_SAVER = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
CUDAGRAPH_MESSAGE = "Breakable CUDA graph is not compatible with memory saver mode"


@pytest.mark.emulator_may_die
def test_c_mem_cudagraph_env_launch(start_emulator: Callable[..., Emulator]) -> None:
    """C-MEM-CUDAGRAPH-ENV: with --enable-memory-saver and SGLANG_MEMORY_SAVER_CUDA_GRAPH=1 the default
    (breakable) prefill graph backend raises in the scheduler at startup from 0.5.15.post1: launch fails.
    0.5.6 starts; `--cuda-graph-backend-prefill disabled` starts."""
    specs: dict[str, tuple[str, tuple[str, ...]]] = {v: (v, ()) for v in VERSIONS}
    specs["disabled"] = ("0.5.23", ("--cuda-graph-backend-prefill", "disabled"))
    emus = {name: start_emulator(v, *flags, env=GRAPHS_IN_SAVER) for name, (v, flags) in specs.items()}
    for name, e in emus.items():
        if name in ("0.5.6", "disabled"):
            e.wait_ready(30)
            assert e.call("GET", "/model_info").status == 200
        else:
            assert e.wait_exit(30) != 0, name
            assert CUDAGRAPH_MESSAGE in e.log_text(), e.log_text()[-1500:]
            assert "ready to roll" not in e.log_text()


@pytest.mark.parametrize(
    ("version", "flags", "env", "fails"),
    [
        *[(v, [], True, v != "0.5.6") for v in VERSIONS],
        *[(v, ["--cuda-graph-backend-prefill", "disabled"], True, False) for v in VERSIONS if v != "0.5.6"],
        ("0.5.15.post1", ["--cuda-graph-backend-prefill", "tc_piecewise"], True, False),
        ("0.5.23", ["--cuda-graph-backend-prefill", "full"], True, False),
        ("0.5.21", ["--cuda-graph-backend-prefill", "breakable"], True, True),
        ("0.5.20", ["--disable-prefill-cuda-graph"], True, False),
        ("0.5.21", ["--disable-cuda-graph"], True, False),
        ("0.5.21", ["--disable-cuda-graph", "--cuda-graph-backend-prefill", "breakable"], True, True),
        ("0.5.23", ["--cuda-graph-config", '{"prefill": {"backend": "disabled"}}'], True, False),
        ("0.5.23", [], False, False),
        ("0.5.6", ["--cuda-graph-backend-prefill", "disabled"], True, False),  # no such flag: ignored
    ],
)
def test_c_mem_cudagraph_env_resolution(
    version: str, flags: list[str], env: bool, fails: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """C-MEM-CUDAGRAPH-ENV, the backend resolution: --disable-cuda-graph, then --disable-prefill-cuda-graph,
    then --cuda-graph-backend-prefill, then --cuda-graph-config, each overriding the one before."""
    if env:
        monkeypatch.setenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", "1")
    else:
        monkeypatch.delenv("SGLANG_MEMORY_SAVER_CUDA_GRAPH", raising=False)
    cfg = parse_config(["--sglang-version", version, "--enable-memory-saver", *flags])
    error = startup_error(cfg)
    assert (error is not None and CUDAGRAPH_MESSAGE in error) == fails, (cfg.prefill_graph_backend, error)
    without_saver = parse_config(["--sglang-version", version, *flags])
    assert startup_error(without_saver) is None


def test_only_recorded_versions_start() -> None:
    """`--sglang-version` takes only the versions this table records (listed in --help); any other is a
    startup error naming the nearest recorded ones."""
    for v in VERSIONS:
        assert parse_config(["--sglang-version", v]).profile.version == v
    for asked, nearest in (
        ("0.5.10", "0.5.6 and 0.5.10.post1"),
        ("0.5.6.post2", "0.5.6 and 0.5.10.post1"),
        ("0.5.22", "0.5.21 and 0.5.23"),
        ("0.6.0", "0.5.23;"),
        ("0.5.4", "0.5.6;"),
    ):
        with pytest.raises(StartupError, match=f"nearest recorded: {nearest}"):
            parse_config(["--sglang-version", asked])
    with pytest.raises(StartupError, match="not an SGLang version"):
        parse_config(["--sglang-version", "latest"])


def test_c_mem_cudagraph_env_choices_by_version() -> None:
    """C-MEM-CUDAGRAPH-ENV: tc_piecewise is no prefill choice on 0.5.23 (full|breakable|disabled)."""
    with pytest.raises(StartupError, match="invalid choice 'tc_piecewise'"):
        parse_config(["--sglang-version", "0.5.23", "--cuda-graph-backend-prefill", "tc_piecewise"])


# --- data parallelism ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dp_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Emulator]]:
    tmp = tmp_path_factory.mktemp("dp")
    emus = {
        v: Emulator(tmp, v, "--dp-size", "2", "--weight-update-group-timeout", "1", tps=50) for v in VERSIONS
    }
    emus["attn-0.5.21"] = Emulator(
        tmp, "0.5.21", "--dp-size", "2", "--enable-dp-attention", "--weight-update-group-timeout", "1"
    )
    emus["attn-0.5.23"] = Emulator(tmp, "0.5.23", "--dp-size", "2", "--enable-dp-attention")
    try:
        for e in emus.values():
            e.wait_ready(30)
        yield emus
    finally:
        _kill_all(emus)
        for e in emus.values():
            e.stop()


@pytest.fixture
def dp(dp_fleet: dict[str, Emulator], version: str) -> Iterator[Emulator]:
    e = dp_fleet[version]
    assert e.alive(), e.log_text()[-3000:]
    yield e
    assert e.alive(), e.log_text()[-3000:]
    e.call("POST", "/abort_request", {"abort_all": True})
    _idle(e)


@_params()
def test_c_dp_fanout_and_c_dp_flush_first(dp: Emulator, version: str) -> None:
    """C-DP-FANOUT: --dp-size 2 is two schedulers: a request routed to rank 1 loads rank 1 only, the load
    routes report one entry per rank. C-DP-FLUSH-FIRST: /flush_cache answers with the first rank's reply,
    so it is 200 although rank 1 is busy (and flushed nothing)."""
    _running(dp, data_parallel_rank=1)
    ranks = dp.stats()["ranks"]
    assert [(r["running"], r["idle"]) for r in ranks] == [(0, True), (1, False)], ranks
    if version == "0.5.6":
        assert [x["num_reqs"] for x in dp.call("GET", "/get_load").body] == [0, 1]
    else:
        loads = dp.call("GET", "/v1/loads").body["loads"]
        assert [(x["dp_rank"], x["num_running_reqs"]) for x in loads] == [(0, 0), (1, 1)]
        assert [x["dp_rank"] for x in dp.call("GET", "/v1/loads?dp_rank=1").body["loads"]] == [1]
    assert len(dp.call("GET", "/server_info").body["internal_states"]) == 2
    assert dp.call("GET", "/metrics").status == 404  # C-METRIC-PROM: only with --enable-metrics
    assert dp.call("POST", "/flush_cache").status == 200


@_params()
def test_c_dp_loads_paused(dp: Emulator, version: str) -> None:
    """C-DP-LOADS-PAUSED: from 0.5.15 the load route reads the snapshots each scheduler publishes from its
    loop, which a paused scheduler skips: after a retract the running request shows as running until
    continue, though it waits. 0.5.6's /get_load asks the schedulers: live. An abort drain never pauses the
    scheduler, so the counts stay live there."""
    job = _running(dp, data_parallel_rank=1)
    assert dp.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    wait_until(lambda: dp.stats()["ranks"][1]["waiting"] == 1, 5, "the retract")
    assert dp.stats()["ranks"][1]["running"] == 0
    if version == "0.5.6":
        assert [(x["num_reqs"], x["num_waiting_reqs"]) for x in dp.call("GET", "/get_load").body] == [
            (0, 0),
            (1, 1),
        ]
    else:
        loads = dp.call("GET", "/v1/loads").body["loads"]
        assert [(x["num_running_reqs"], x["num_waiting_reqs"]) for x in loads] == [(0, 0), (1, 0)], loads
        if version in ("0.5.15.post1", "0.5.20"):  # the /get_load shim reads the same snapshots
            assert [x["num_waiting_reqs"] for x in dp.call("GET", "/get_load").body] == [0, 0]
    assert dp.call("POST", "/continue_generation", {}).status == 200
    wait_until(lambda: dp.stats()["ranks"][1]["running"] == 1, 5, "the request to run again")
    if version != "0.5.6":
        loads = dp.call("GET", "/v1/loads").body["loads"]
        assert [(x["num_running_reqs"], x["num_waiting_reqs"]) for x in loads] == [(0, 0), (1, 0)], loads
    assert dp.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    job["thread"].join(10)
    if version != "0.5.6":  # abort: the scheduler is not paused, its snapshot follows
        wait_until(
            lambda: all(x["num_running_reqs"] == 0 for x in dp.call("GET", "/v1/loads").body["loads"]),
            5,
            "the live snapshot after an abort",
        )
    assert dp.call("POST", "/continue_generation", {}).status == 200


@_params()
def test_c_refit_dp(dp: Emulator, version: str, tmp_path: Path, dp_fleet: dict[str, Emulator]) -> None:
    """C-REFIT-DP: with dp_size > 1 the tokenizer asserts before a tensor or distributed refit or a group
    init: HTTP 500, the server survives; allowed with --enable-dp-attention up to 0.5.21, never on 0.5.23.
    A disk refit fans out: messages joined with " | ", num_paused_requests a list."""
    tensor = {"serialized_named_tensors": ["AAAA"], "flush_cache": False}
    dist = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "flush_cache": False}
    for path, body in (
        ("/update_weights_from_tensor", tensor),
        ("/update_weights_from_distributed", dist),
        ("/init_weights_update_group", {**GROUP, "master_port": 1}),
    ):
        r = dp.call("POST", path, body)
        assert r.status == 500, (path, r.status, r.text)
    _idle(dp)
    r = dp.call("POST", "/update_weights_from_disk", {"model_path": str(write_weights(tmp_path, "3"))})
    assert r.status == 200 and r.body["num_paused_requests"] == [0, 0]
    assert r.body["message"] == " | ".join(["Succeeded to update model weights."] * 2)
    if version == "0.5.21":  # the assert passes with DP attention: SGLang goes on to the rendezvous
        r = dp_fleet["attn-0.5.21"].call("POST", "/init_weights_update_group", {**GROUP, "master_port": 1})
        assert r.status == 400 and "Failed to initialize custom process group" in r.text
    if version == "0.5.23":
        r = dp_fleet["attn-0.5.23"].call("POST", "/init_weights_update_group", {**GROUP, "master_port": 1})
        assert r.status == 500


# --- last: these kill the module's shared emulators --------------------------------------------


def test_c_dp_release_all(dp_fleet: dict[str, Emulator]) -> None:
    """C-DP-RELEASE-ALL: release goes to every DP rank and each asserts idleness: rank 0 idle (its flush
    said 200) and rank 1 busy kills the server on every version. Both ranks idle: released."""
    emus = {v: dp_fleet[v] for v in VERSIONS}
    for e in emus.values():
        _idle(e)
        _running(e, data_parallel_rank=1)
        assert e.call("POST", "/pause_generation", {"mode": "in_place"}).status == 200
        assert e.call("POST", "/flush_cache").status == 200  # rank 0's answer
    for e in emus.values():
        _dropped(e, "POST", "/release_memory_occupation", {})
        _dies(e, "release_memory_occupation should be called only when")
    idle = dp_fleet["attn-0.5.23"]
    _idle(idle)
    assert idle.call("POST", "/release_memory_occupation", {}).status == 200
    assert idle.alive() and idle.stats()["offload_tags"] == ["cuda_graph", "kv_cache", "weights"]


def test_c_mem_resume_unreleased(fleet: dict[str, Emulator]) -> None:
    """C-MEM-RESUME-UNRELEASED: resume removes tags one by one; a tag repeated in the list raises KeyError
    on its second removal: fatal on every version (a never-released tag: test_emulator_dies.py)."""
    for e in fleet.values():
        _idle(e)
        assert e.call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}).status == 200
    for e in fleet.values():
        _dropped(e, "POST", "/resume_memory_occupation", {"tags": ["kv_cache", "kv_cache"]})
    for e in fleet.values():
        _dies(e, "KeyError: 'kv_cache'")


# --- 0.5.10.post1 (AReaL's pin): the rows where it is not simply 0.5.6 or 0.5.15.post1, and the moved
# boundaries (docs/sglang-conformance.md, "### 0.5.10.post1"). Not in the fleet: targeted, one version. --

V10 = "0.5.10.post1"


@pytest.fixture(scope="module")
def v10_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Emulator]:
    e = Emulator(tmp_path_factory.mktemp("v10"), V10, *SHARED_FLAGS, tps=50)
    try:
        e.wait_ready(30)
        yield e
    finally:
        _kill_all([e])
        e.stop()


@pytest.fixture
def v10(v10_server: Emulator) -> Iterator[Emulator]:
    """The shared 0.5.10.post1 emulator, checked as `emu` is."""
    yield from _shared(v10_server)


def test_v10_is_recorded() -> None:
    """0.5.10.post1 starts; its profile takes each side of the boundaries the subsection records."""
    profile = parse_config(["--sglang-version", V10]).profile
    assert profile.version == V10
    assert (profile.get_weight_version, profile.get_load) == ("deprecated", "list")
    assert profile.has_v1_loads is True
    assert (profile.has_admin_api_key, profile.checker_get_and_default_action) == (True, False)
    assert (profile.loads_frozen_while_paused, profile.tensor_bad_base64_is_fatal) == (False, True)
    assert (profile.idle_predicate, profile.flush_cache_takes_timeout) == ("strict", True)


def test_v10_routes(v10: Emulator) -> None:
    """C-ROUTE-WV-READ as 0.5.15.post1 (404 naming /model_info); C-ROUTE-CHECKER as 0.5.6 (POST only,
    `action` required); C-HEALTH-READY: no /ready; C-REFIT-TENSOR-LOCAL as 0.5.6 (the class in
    model_runner.py, so 0.5.6's push loads)."""
    old = v10.call("GET", "/get_weight_version")
    assert old.status == 404 and "deprecated" in old.body["message"] and "/model_info" in old.body["message"]
    assert "weight_version" in v10.call("GET", "/model_info").body
    assert v10.call("GET", "/weights_checker").status == 405
    assert v10.call("POST", "/weights_checker", {}).status == 400
    assert v10.call("POST", "/weights_checker", {"action": "snapshot"}).status == 200
    assert v10.call("POST", "/weights_checker", {"action": "checksum"}).status == 400  # C-CHECKER-CHECKSUM
    assert v10.call("GET", "/ready").status == 404
    push = {"serialized_named_tensors": [local_serialized_push("0.5.6")], "flush_cache": False}
    r = v10.call("POST", "/update_weights_from_tensor", push)
    assert r.status == 200 and r.body["success"] is True, r.text


def test_v10_idle_flush_strict_and_deferred(v10: Emulator) -> None:
    """C-IDLE-FLUSH and C-IDLE-FLUSH-DEFERRED as 0.5.15.post1: after a retract with a request waiting the
    plain flush is refused and `?timeout=` times out; unpaused, the deferred flush answers once the request
    finished."""
    _running(v10)
    assert v10.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    r = v10.call("POST", "/flush_cache")
    assert r.status == 400 and r.text == "Flush cache failed.\n", r.text
    r = v10.call("POST", "/flush_cache?timeout=0.3")
    assert r.status == 400 and r.text == "Timed out waiting for idle state.", r.text
    v10.call("POST", "/abort_request", {"abort_all": True})
    v10.call("POST", "/continue_generation", {})
    _idle(v10)
    _running(v10, 10)
    started = time.monotonic()
    r = v10.call("POST", "/flush_cache?timeout=5")
    assert r.status == 200 and 0.05 < time.monotonic() - started < 5


def test_v10_loads_live_while_paused(v10: Emulator) -> None:
    """C-METRIC-LOAD-ROUTE (own): `/v1/loads` exists and `/get_load` is still the scheduler call.
    C-DP-LOADS-PAUSED as 0.5.6: both ask the scheduler, so after a retract they show the request waiting
    (snapshots frozen at the pause would still show it running)."""
    _running(v10)
    assert [x["num_running_reqs"] for x in v10.call("GET", "/v1/loads?include=core").body["loads"]] == [1]
    assert v10.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    load = v10.call("GET", "/v1/loads?include=core").body["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (0, 1), load
    old = v10.call("GET", "/get_load")
    assert old.status == 200 and [(x["dp_rank"], x["num_reqs"], x["num_waiting_reqs"]) for x in old.body] == [
        (0, 1, 1)
    ]
    v10.call("POST", "/abort_request", {"abort_all": True})


def test_v10_metric_prom(v10: Emulator) -> None:
    """C-METRIC-PROM (own): `cached_tokens_total` has `cache_source` and scheduler gauges `moe_ep_rank`, but
    the tokenizer labels have no `engine_type`, the request counters no `is_streaming`, and there is no
    `sglang:weight_load_duration_seconds`."""
    prompt = " ".join(f"v{i}" for i in range(12))
    for _ in range(2):  # the second is a prefix-cache hit
        assert _generate(v10, 2, text=prompt).status == 200
    metrics = v10.call("GET", "/metrics").text
    lines = {line.split("{", 1)[0]: line for line in metrics.splitlines() if line.startswith("sglang:")}
    assert 'cache_source="device"' in lines["sglang:cached_tokens_total"]
    assert 'moe_ep_rank="0"' in lines["sglang:num_running_reqs"]
    assert "engine_type" not in lines["sglang:num_requests_total"]
    assert "is_streaming" not in lines["sglang:prompt_tokens_total"]
    assert "sglang:weight_load_duration_seconds" not in metrics


def test_v10_route_auth(start_emulator: Callable[..., Emulator]) -> None:
    """C-ROUTE-AUTH as 0.5.15.post1: with an admin key control routes take only it; /ready is not open."""
    e = start_emulator(V10, "--api-key", "user", "--admin-api-key", "admin")
    e.wait_ready(30)
    assert e.call("POST", "/flush_cache", token="user").status == 401
    assert e.call("POST", "/flush_cache", token="admin").status == 200
    assert e.call("GET", "/model_info", token="user").status == 200
    assert (e.call("GET", "/health").status, e.call("GET", "/ready").status) == (200, 401)


@pytest.mark.emulator_may_die
def test_v10_fatal_rows(start_emulator: Callable[..., Emulator]) -> None:
    """C-IDLE-RELEASE as 0.5.15.post1: a release after a retract with a request waiting is fatal.
    C-REFIT-TENSOR-B64 as 0.5.6: text that is not base64 is decoded in the scheduler, fatal.
    C-DEATH-HARD as 0.5.15.post1: a killed scheduler takes the server down (SubprocessWatchdog)."""
    killed = start_emulator(V10, "--fault-scheduler-kill-after", "1")
    emus = _start_all(start_emulator, {"release": (V10, ()), "b64": (V10, ())}, tps=50)
    release, b64 = emus["release"], emus["b64"]
    _running(release)
    assert release.call("POST", "/pause_generation", {"mode": "retract"}).status == 200
    _dropped(release, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    _dies(release, "release_memory_occupation should be called only when server is idle.")
    _dropped(b64, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]})
    _dies(b64, "binascii.Error")
    _dies(killed, "Triggering SIGQUIT")
    assert "ready to roll" in killed.log_text()
    _kill_all([killed, *emus.values()])
