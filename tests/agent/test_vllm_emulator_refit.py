"""The vLLM emulator's refits against docs/vllm-conformance.md §4 and §7, at 0.26.0 and 0.34.0: the disk
reload through /collective_rpc, the native IPC weight transfer (pickled CUDA IPC handles read without a
GPU), its session rules, the NCCL rendezvous that blocks the engine core, and what a refit at the wrong
time does (fatal at the next forward, or silently mixed weights)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from agent_procs import wait_until
from vllm_procs import (
    GARBAGE,
    UUID0,
    VLLM_VERSIONS,
    Background,
    VllmEmulator,
    ipc_update,
    model_params,
    packed_handle_pickled,
    start_long_request,
    write_model,
)

from rljob.emulator.rendezvous import Rank0

NEW = "0.34.0"
IPC = ("--weight-transfer-config", '{"backend": "ipc"}')
INSECURE = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
StartVllm = Any


def _error(r: Any) -> dict[str, Any]:
    assert isinstance(r.body, dict) and "error" in r.body, r.text
    return dict(r.body["error"])


def _worker_error(message: str) -> str:
    """A worker's exception as a utility call through /collective_rpc reports it (V-TP-REPLY)."""
    return (
        f"Call to collective_rpc method failed: Worker failed with error '{message}', please check the stack "
        "trace above for the root cause"
    )


def _reload(emu: VllmEmulator, path: Path | str | None = None) -> Any:
    kwargs = {} if path is None else {"weights_path": str(path)}
    return emu.call("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": kwargs})


def _init_ipc(emu: VllmEmulator, packed: bool = False) -> None:
    info = {"packed": packed} if emu.version == NEW else {}
    r = emu.ok("POST", "/init_weight_transfer_engine", {"init_info": info})
    assert r.body == {"message": "Weight transfer initialized"}


# --- disk (V-REFIT-DISK) -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_disk_reload(version: str, start_vllm: StartVllm, tmp_path: Path) -> None:
    """V-REFIT-DISK, V-ROUTE-RPC: one null result per worker (TP 2); the weights change; the new path
    becomes the model's for good; the prefix cache is not reset."""
    emu = start_vllm(version, "-tp", "2")
    prompt = "p " * 48
    before = emu.complete(prompt, max_tokens=4).body["choices"][0]["text"]
    launch = emu.weights()["checksum"]
    v2 = write_model(tmp_path / "v2", "2")
    assert _reload(emu, v2).body == {"results": [None, None]}
    assert emu.weights()["source"] == "disk" and emu.weights()["checksum"] != launch
    assert emu.engine()["model_path"] == str(v2)
    hits = emu.metric("vllm:prefix_cache_hits_total")
    after = emu.complete(prompt, max_tokens=4).body["choices"][0]["text"]
    assert after != before
    assert emu.metric("vllm:prefix_cache_hits_total") > hits  # the old weights' KV still matched
    checksum = emu.weights()["checksum"]
    assert _reload(emu).status == 200 and emu.weights()["checksum"] == checksum  # no path: P again


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_failed_reload_then_forward(version: str, start_vllm: StartVllm, tmp_path: Path) -> None:
    """V-KILL-REFIT-FAILED: a reload from a path that is not there fails in the loader (500) with the layers
    on the meta device and the bad path kept as the model's; a later reload with a good path recovers,
    and without one the next forward kills the engine core."""
    recovers, dies = start_vllm(version), start_vllm(version)
    for emu in (recovers, dies):
        r = _reload(emu, tmp_path / "missing")
        assert r.status == 500 and "Repo id must be in the form" in _error(r)["message"]
        assert "<path>" in _error(r)["message"]  # sanitize_message hides file paths
        assert emu.engine()["layers_on_meta"] is True
    assert _reload(recovers).status == 500  # the model path is the bad one now
    assert _reload(recovers, write_model(tmp_path / "good", "3")).status == 200
    assert recovers.complete().status == 200
    queued = Background(lambda: dies.complete())
    dies.dies("meta")
    assert queued.dropped or queued.wait().status == 500


# --- tensors (V-REFIT-IPC) ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_ipc_refit(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-WT-INIT, V-ROUTE-WT-SESSION, V-ROUTE-WT-UPDATE, V-REFIT-IPC: init, start, an update with
    pickled handles for this GPU's UUID, finish (0.34: with the version); the served weights change."""
    emu = start_vllm(version, *IPC, env=INSECURE)
    before = emu.complete().body["choices"][0]["text"]
    r = emu.call("POST", "/init_weight_transfer_engine", {"init_info": {"bogus": 1}})
    assert r.status == 500
    assert _error(r)["message"] == _worker_error(
        "Invalid init_info for IPCWeightTransferEngine: IPCWeightTransferInitInfo.__init__() got an "
        "unexpected keyword argument 'bogus'"
    )
    _init_ipc(emu)
    assert emu.ok("POST", "/start_weight_update").body == {"message": "Weight update started"}
    r = emu.ok("POST", "/update_weights", {"update_info": ipc_update(model_params())})
    assert r.body == {"message": "Weights updated"}
    finish = {"weight_version": "v2"} if version == NEW else None
    assert emu.ok("POST", "/finish_weight_update", finish).body == {"message": "Weight update finished"}
    assert emu.weights()["source"] == "tensor" and emu.weights()["tensors"] == 4
    after = emu.complete().body["choices"][0]["text"]
    assert after != before and GARBAGE not in after
    if version == NEW:
        assert emu.ok("GET", "/weight_info").body == {"weight_version": "v2"}
        assert emu.metric("vllm:rl_weight_update_operation_duration_seconds_count", operation="update") == 1.0


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_ipc_needs_insecure_serialization(version: str, start_vllm: StartVllm) -> None:
    """V-REFIT-IPC-INSECURE, V-REFIT-SESSION, V-KILL-REFIT-FAILED: without the env the pickled handles are
    refused (500: 0.26 checks it before building the update info, so even before an unknown field; 0.34
    after); the failed update ended the session (finish: 500) and left the layers on meta until a reload
    succeeds."""
    emu = start_vllm(version, *IPC)
    _init_ipc(emu)
    emu.ok("POST", "/start_weight_update")
    r = emu.call("POST", "/update_weights", {"update_info": {**ipc_update(model_params()), "bogus": 1}})
    first = "Invalid update_info" if version == NEW else "Refusing to deserialize"
    assert r.status == 500 and first in _error(r)["message"]
    emu.ok("POST", "/start_weight_update")
    r = emu.call("POST", "/update_weights", {"update_info": ipc_update(model_params())})
    assert (r.status, _error(r)["message"]) == (
        500,
        _worker_error(
            "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
        ),
    )
    assert emu.engine()["layers_on_meta"] is True and emu.engine()["weight_update_active"] is False
    r = emu.call("POST", "/finish_weight_update")
    assert _error(r)["message"] == _worker_error(
        "finish_weight_update called without a matching start_weight_update."
    )
    assert _reload(emu).status == 200
    assert emu.engine()["layers_on_meta"] is False and emu.complete().status == 200


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_session_order(version: str, start_vllm: StartVllm) -> None:
    """V-REFIT-SESSION: update or finish outside a session, a second start: 500 each; 0.34 flags an
    incomplete update from start to a successful finish."""
    emu = start_vllm(version, *IPC, env=INSECURE)
    _init_ipc(emu)
    r = emu.call("POST", "/update_weights", {"update_info": ipc_update(model_params())})
    assert _error(r)["message"] == _worker_error("start_weight_update must be called before update_weights.")
    r = emu.call("POST", "/finish_weight_update")
    assert r.status == 500
    emu.ok("POST", "/start_weight_update")
    r = emu.call("POST", "/start_weight_update")
    assert _error(r)["message"] == _worker_error(
        "start_weight_update called while a weight update is already active. Call finish_weight_update first."
    )
    flag = emu.call("POST", "/collective_rpc", {"method": "has_incomplete_weight_update"})
    if version == NEW:
        assert flag.body == {"results": ["True"]}  # not null, a dict or a list: str() (V-ROUTE-RPC)
    else:
        assert "Method 'has_incomplete_weight_update' is not implemented." in _error(flag)["message"]
    if version == NEW:  # V-ROUTE-WT-SHUTDOWN: refused during an update
        r = emu.call("POST", "/shutdown_weight_transfer_engine")
        assert _error(r)["message"] == _worker_error(
            "Cannot release a trainer connection during a weight update"
        )
    emu.ok("POST", "/finish_weight_update")  # nothing received: the layers get their old tensors back
    assert emu.weights()["source"] == "launch"
    if version == NEW:
        r = emu.ok("POST", "/shutdown_weight_transfer_engine")
        assert r.body == {"message": "Weight transfer shut down"}
        assert emu.ok("POST", "/collective_rpc", {"method": "has_incomplete_weight_update"}).body == {
            "results": ["False"]
        }


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_ipc_packed(version: str, start_vllm: StartVllm) -> None:
    """V-REFIT-IPC: packed buffers. 0.26 reads `packed` and `tensor_sizes` from the update info; 0.34 takes
    `packed` at init and refuses it in an update (an unknown field); sizes that do not fit the shapes are
    torch's view error."""
    emu = start_vllm(version, *IPC, env=INSECURE)
    params = model_params()
    sizes = [4 * n for n in (s[0] * s[1] for s in params.values())]
    update: dict[str, Any] = {
        "names": list(params),
        "dtype_names": ["float32"] * 4,
        "shapes": [list(s) for s in params.values()],
        "ipc_handles_pickled": packed_handle_pickled(UUID0, sum(sizes)),
        "tensor_sizes": sizes,
    }
    _init_ipc(emu, packed=True)
    emu.ok("POST", "/start_weight_update")
    if version == NEW:
        emu.ok("POST", "/update_weights", {"update_info": update})
        r = emu.call("POST", "/update_weights", {"update_info": {**update, "packed": True}})
        assert _error(r)["message"] == _worker_error(
            "Invalid update_info for IPCWeightTransferEngine: IPCWeightTransferUpdateInfo.__init__() got an "
            "unexpected keyword argument 'packed'"
        )
    else:
        r = emu.call(
            "POST", "/update_weights", {"update_info": {**update, "packed": True, "tensor_sizes": None}}
        )
        assert _error(r)["message"] == _worker_error("`tensor_sizes` is required when packed=True")
        emu.ok("POST", "/start_weight_update")
        emu.ok("POST", "/update_weights", {"update_info": {**update, "packed": True}})
    bad = {**update, "tensor_sizes": [sizes[0] - 4, *sizes[1:]]}
    if version != NEW:
        bad["packed"] = True
    emu.call("POST", "/start_weight_update")
    r = emu.call("POST", "/update_weights", {"update_info": bad})
    assert r.status == 500 and "is invalid for input of size" in _error(r)["message"]


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_update_checked_against_the_model(version: str, start_vllm: StartVllm) -> None:
    """V-KILL-REFIT-FAILED (bad shapes): load_weights refuses a tensor the model does not have or of another
    shape (500)."""
    emu = start_vllm(version, *IPC, env=INSECURE)
    _init_ipc(emu)
    emu.ok("POST", "/start_weight_update")
    name, shape = next(iter(model_params().items()))
    r = emu.call("POST", "/update_weights", {"update_info": ipc_update({name: (2, 2)})})
    assert _error(r)["message"] == _worker_error(
        f"Attempted to load weight (torch.Size([2, 2])) into parameter (torch.Size({list(shape)}))"
    )
    emu.ok("POST", "/start_weight_update")
    r = emu.call("POST", "/update_weights", {"update_info": ipc_update({"lm_head.bogus": shape})})
    assert _error(r)["message"] == _worker_error("'lm_head.bogus'")


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_wrong_gpu_uuid_then_forward_is_fatal(version: str, start_vllm: StartVllm) -> None:
    """V-REFIT-IPC, V-KILL-REFIT-FAILED: handles for another GPU: 500 naming the UUIDs; nothing stops the
    scheduler, and the next forward runs layers on the meta device: the engine core dies."""
    emu = start_vllm(version, *IPC, env=INSECURE)
    _init_ipc(emu)
    emu.ok("POST", "/start_weight_update")
    other = "GPU-00000000-0000-0000-0000-000000000009"
    r = emu.call("POST", "/update_weights", {"update_info": ipc_update(model_params(), uuid=other)})
    assert _error(r)["message"] == _worker_error(
        f"IPC handle not found for GPU UUID {UUID0}. Available UUIDs: ['{other}']"
    )
    queued = Background(lambda: emu.complete())
    emu.dies("meta")
    assert queued.dropped or queued.wait().status == 500


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_update_info_per_rank(version: str, start_vllm: StartVllm) -> None:
    """V-ROUTE-WT-UPDATE: 0.34 takes a list indexed by global worker rank (here DP 2: each engine finds
    its own GPU's handles); 0.26 takes a dict only."""
    emu = start_vllm(version, "-dp", "2", *IPC, env=INSECURE)
    _init_ipc(emu)
    emu.ok("POST", "/start_weight_update")
    gpu1 = "GPU-00000000-0000-0000-0000-000000000001"
    per_rank = [ipc_update(model_params()), ipc_update(model_params(), uuid=gpu1)]
    r = emu.call("POST", "/update_weights", {"update_info": per_rank})
    if version == NEW:
        assert r.status == 200
        emu.ok("POST", "/finish_weight_update")
        assert emu.weights()["source"] == "tensor"
    else:
        assert _error(r)["message"] == _worker_error("'list' object has no attribute 'pop'")


# --- refits at the wrong time (§7) -------------------------------------------------------------------


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_refit_while_serving_is_fatal(version: str, start_vllm: StartVllm) -> None:
    """V-KILL-REFIT-SERVING, V-REFIT-LAYERWISE: a start while a request runs moves the layers to the meta
    device; the next step faults and the engine core dies; the running request fails."""
    emu = start_vllm(version, *IPC, env=INSECURE, tps=50)
    _init_ipc(emu)
    running = start_long_request(emu)
    emu.call("POST", "/start_weight_update")
    emu.dies("meta")
    assert running.dropped or running.wait().status == 500


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_refit_while_asleep_is_fatal(version: str, start_vllm: StartVllm) -> None:
    """V-KILL-REFIT-ASLEEP: a reload while the weights sleep writes into unmapped memory: 500, the CUDA
    context is poisoned (the wake fails too), and the next forward kills the engine core."""
    emu = start_vllm(version)
    emu.ok("POST", "/sleep?level=2")
    r = _reload(emu)
    assert _error(r)["message"] == _worker_error("CUDA error: an illegal memory access was encountered")
    r = emu.call("POST", "/wake_up")
    assert r.status == 500 and "illegal memory access" in _error(r)["message"]
    queued = Background(lambda: emu.complete())
    wait_until(lambda: emu.stats()["waiting"] == 1, 10, "the request to queue")
    emu.ok("POST", "/resume")
    emu.dies("illegal memory access")
    assert queued.dropped or queued.wait().status == 500


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_reload_while_serving_mixes_weights(version: str, start_vllm: StartVllm, tmp_path: Path) -> None:
    """V-KILL-RELOAD-SERVING (silent): a reload between two steps changes the weights under a running
    request: its first tokens are the old weights', the rest the new ones', and it answers 200."""
    v2 = write_model(tmp_path / "v2", "2")
    emu = start_vllm(version, tps=20)
    old = emu.complete("q r s", max_tokens=30).body["choices"][0]["text"].split()
    mixed = Background(lambda: emu.complete("q r s", max_tokens=30))
    wait_until(lambda: emu.metric("vllm:generation_tokens_total") >= 35, 20, "5 tokens of the request")
    assert _reload(emu, v2).status == 200
    reply = mixed.wait()
    assert reply.status == 200
    tokens = reply.body["choices"][0]["text"].split()
    assert tokens[:5] == old[:5] and tokens != old


# --- NCCL (V-REFIT-NCCL, V-HANG) ---------------------------------------------------------------------


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_nccl_init_blocks_the_engine_core(version: str, start_vllm: StartVllm) -> None:
    """V-REFIT-NCCL, V-HANG, V-KILL-NCCL-ALONE: the init answers only once every worker joined the
    trainer's store (rank_offset + rank); meanwhile other utility calls wait behind it and /health still
    answers; an abort waits behind it too. Then an update without bytes (the metadata stands in for the
    broadcast) and a finish."""
    emu = start_vllm(version, "-tp", "2", "--weight-transfer-config", '{"backend": "nccl"}', tps=50)
    r = emu.call("POST", "/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1"}})
    missing = "master_port" if version != NEW else "rank_offset"
    assert r.status == 500 and missing in _error(r)["message"]
    emu.ok("POST", "/start_weight_update")
    r = emu.call("POST", "/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}})
    assert _error(r)["message"] == _worker_error(
        "NCCL weight transfer not initialized. Call init_transfer_engine() first."
    )
    assert _reload(emu).status == 200  # the failed update left the layers on meta
    rank0 = Rank0(0, world_size=3)
    info = {"master_address": "127.0.0.1", "master_port": rank0.port, "rank_offset": 1, "world_size": 3}
    running = start_long_request(emu)
    init = Background(
        lambda: emu.call("POST", "/init_weight_transfer_engine", {"init_info": info}, timeout=60)
    )
    wait_until(lambda: emu.engine()["in_utility"], 10, "the init to block the engine core")
    behind = Background(lambda: emu.call("GET", "/is_paused", timeout=60))
    assert emu.call("GET", "/health").status == 200
    assert emu.ok("POST", "/abort_requests", {}).body == {"status": "aborted", "aborted": 1}
    behind._thread.join(0.5)
    assert not behind.done() and not init.done() and not running.done()
    joined: list[int] = []
    waiter = threading.Thread(target=lambda: joined.extend(rank0.wait(30)), daemon=True)
    waiter.start()
    assert init.wait().body == {"message": "Weight transfer initialized"}
    waiter.join(30)  # the init may answer before this thread stored what rank 0 saw
    assert joined == [1, 2]
    assert behind.wait().body == {"is_paused": False}
    assert running.wait().body["choices"][0]["finish_reason"] == "abort"
    emu.ok("POST", "/start_weight_update")
    params = model_params()
    update = {
        "names": list(params),
        "dtype_names": ["float32"] * 4,
        "shapes": [list(s) for s in params.values()],
    }
    emu.ok("POST", "/update_weights", {"update_info": update})
    emu.ok("POST", "/finish_weight_update")
    assert emu.weights()["source"] == "distributed"


@pytest.mark.parametrize("version", VLLM_VERSIONS)
def test_weight_routes_without_transfer_config(version: str, start_vllm: StartVllm) -> None:
    """V-LAUNCH-WEIGHT-TRANSFER, V-ROUTE-WT-INIT: without --weight-transfer-config every weight route
    answers 500; a missing init_info is 400 (0.26: the route's own check; 0.34: body validation)."""
    emu = start_vllm(version)
    not_configured = _worker_error(
        "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
    )
    for path, body in (
        ("/init_weight_transfer_engine", {"init_info": {}}),
        ("/start_weight_update", None),
        ("/update_weights", {"update_info": {}}),
        ("/finish_weight_update", None),
    ):
        r = emu.call("POST", path, body)
        assert (r.status, _error(r)["message"]) == (500, not_configured), path
    r = emu.call("POST", "/init_weight_transfer_engine", {})
    err = _error(r)
    assert (r.status, err["type"]) == (400, "Bad Request")
    if version == NEW:
        assert err["param"] == "body.init_info"
    else:
        assert err["message"] == "Missing 'init_info' in request body"
