"""Tensor/distributed refits through the agent's refit window, with the trainer SDK: sessions by version,
the final push carrying the version, and every way a window can fail without leaving SGLang inconsistent.
Tensor pushes are real flattened-bucket payloads (rljob.trainer.engines.sglang.packing's writer, with a
stand-in for the CUDA IPC reduction: no torch here), which the emulator's accounting backend reads as SGLang
would."""

from __future__ import annotations

import hashlib
import importlib.abc
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from agent_procs import ALL_TAGS, Agent, AgentDriver, Emulator

from rljob.emulator.rendezvous import Rank0
from rljob.testing.ipc_stand_in import cuda_reduction
from rljob.trainer import AgentError, Handoff
from rljob.trainer.engines.sglang import packing
from rljob.trainer.engines.sglang.packing import Call, TensorSpec, plan_buckets

ITEMSIZE = {"bfloat16": 2, "float32": 4}


def _ipc_stand_in(nbytes: int) -> Call:
    """Shaped as reduced_tensor(<1-D uint8 CUDA tensor>) (checked against a real one in tests/unit)."""
    return cuda_reduction(nbytes, device="GPU-0", handle=b"h" * 64, ref_counter=b"/torch_1", event=b"e" * 64)


def bucket_payloads(
    named: list[tuple[str, str, tuple[int, ...]]], bucket_bytes: int = 1 << 20
) -> list[bytes]:
    """Flattened-bucket payloads (pickle bytes, one per bucket) for (name, dtype, shape) tensors."""
    specs = [TensorSpec(n, d, shape, math.prod(shape) * ITEMSIZE[d]) for n, d, shape in named]
    out = []
    for plan in plan_buckets(specs, bucket_bytes):
        entries = [
            packing.metadata_entry(specs[p.index].name, specs[p.index].shape, plan.dtype, p.start, p.end)
            for p in plan.placements
        ]
        out.append(packing.bucket_payload(_ipc_stand_in(plan.nbytes), entries))
    return out


def _small_bucket(name: str) -> str:
    """One float32 [2] tensor as a flattened bucket, on the wire."""
    return packing.to_wire(bucket_payloads([(name, "float32", (2,))])[0])


def _to_trained(c: AgentDriver, version: str) -> None:
    c.iteration_to_trained(version, None)


def _refit_async(agent: Agent, c: AgentDriver, **fields: Any) -> None:
    """Start a refit without waiting: the window needs the trainer to act before it can finish."""
    c.epoch += 1
    r = agent.command("refit", c.epoch, wait=0, **fields)
    assert r.status == 202, r.text


def _outcome(agent: Agent, timeout: float = 15) -> dict[str, Any]:
    st = agent.wait_state(lambda s: s["lastCommand"]["state"] != "Running", timeout, "refit to finish")
    return dict(st["lastCommand"])


@pytest.mark.parametrize("version", ["0.5.15.post1", "0.5.21", "0.5.23"])
def test_tensor_window_pushes_in_order_and_last_carries_version(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator(version)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    _to_trained(c, "1")
    _refit_async(agent, c, version="1", source="tensor")
    handoff = Handoff(agent.trainer_url)
    named = [("embed", "bfloat16", (256, 64)), ("norm", "float32", (64,)), ("w", "bfloat16", (64, 64))]
    chunks = bucket_payloads(named, bucket_bytes=40_000)  # embed | w | norm
    assert len(chunks) == 3
    with handoff.refit_window(timeout=10) as w:
        assert (w.version, w.source) == ("1", "tensor")
        assert agent.state()["trainer"]["refitWindowVersion"] == "1"
        for chunk in chunks:
            w.push_tensors([packing.to_wire(chunk)], load_format="flattened_bucket")
        # held back until the next push shows it was not the last: SGLang saw 2 of 3 so far
        assert emu.stats()["calls"]["/update_weights_from_tensor"] == 2
        assert emu.call("GET", "/model_info").body["weight_version"] == "default"
    out = _outcome(agent)
    assert out["state"] == "Succeeded", out
    st = agent.state()
    assert st["stage"] == "Refitted" and st["trainer"].get("refitWindowVersion") is None
    assert emu.stats()["calls"]["/update_weights_from_tensor"] == 3
    assert emu.weights()["checksum"] == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert emu.weights()["tensors"] == 3
    calls = emu.stats()["calls"]
    session = version != "0.5.15.post1"
    assert calls.get("/begin_weight_update", 0) == calls.get("/end_weight_update", 0) == int(session)
    assert calls["/flush_cache"] >= 1
    r = agent.trainer("POST", "/v1/trainer/refit/tensor", {"serializedNamedTensors": ["AA=="]})
    assert r.status == 409 and r.body["error"] == "NoRefitWindow"
    c.ok("resume")


def test_window_closed_with_error_fails_the_refit_and_ends_the_session(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    _to_trained(c, "1")
    _refit_async(agent, c, version="1", source="tensor")
    handoff = Handoff(agent.trainer_url)
    with pytest.raises(RuntimeError, match="trainer exploded"), handoff.refit_window(timeout=10) as w:
        w.push_tensors([_small_bucket("x")], load_format="flattened_bucket")
        raise RuntimeError("trainer exploded")
    out = _outcome(agent)
    assert out["state"] == "Failed" and "trainer exploded" in out["error"]
    assert emu.stats()["calls"]["/end_weight_update"] == 1  # the session did not stay open
    assert agent.state()["stage"] == "Trained"
    # a second attempt (new epoch) works: begin does not find a stale session
    _refit_async(agent, c, version="1", source="tensor")
    with handoff.refit_window(timeout=10) as w:
        w.push_tensors([_small_bucket("y")], load_format="flattened_bucket")
    assert _outcome(agent)["state"] == "Succeeded"


def test_window_not_closed_fails_by_deadline(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.21")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    _to_trained(c, "1")
    started = time.monotonic()
    _refit_async(agent, c, version="1", source="tensor", timeoutSeconds=1)
    out = _outcome(agent)
    assert out["state"] == "Failed" and "did not close the refit window" in out["error"]
    assert time.monotonic() - started < 5
    assert agent.trainer("GET", "/v1/trainer/refit").body == {"open": False, "pushes": 0}
    assert emu.stats()["calls"]["/end_weight_update"] == 1


def _open_window(
    version: str, source: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> tuple[Emulator, Agent, AgentDriver]:
    """An emulator and agent with a refit window for version "1" open and waiting for the trainer."""
    emu = start_emulator(version)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    _to_trained(c, "1")
    _refit_async(agent, c, version="1", source=source)
    agent.wait_state(lambda s: s["trainer"].get("refitWindowVersion") == "1", 5)
    return emu, agent, c


def _push_one_bucket(agent: Agent) -> None:
    with Handoff(agent.trainer_url).refit_window(timeout=10) as w:
        for chunk in bucket_payloads([("w", "float32", (2, 2))]):
            w.push_tensors([packing.to_wire(chunk)], load_format="flattened_bucket")
    assert _outcome(agent)["state"] == "Succeeded"


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_push_that_is_not_base64_is_refused_before_sglang(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-REFIT-TENSOR-B64: 0.5.6 dies decoding it; the agent answers 422 naming the entry, keeps the
    window usable, and SGLang stays alive and serving."""
    emu, agent, _ = _open_window(version, "tensor", start_emulator, start_agent)
    r = agent.trainer("POST", "/v1/trainer/refit/tensor", {"serializedNamedTensors": ["QQ==", "not base64!"]})
    assert r.status == 422 and r.body["error"] == "InvalidPush", r.text
    assert "serializedNamedTensors[1]" in r.body["reason"]
    assert "/update_weights_from_tensor" not in emu.stats()["calls"]
    assert emu.alive() and agent.state()["lastCommand"]["state"] == "Running"
    _push_one_bucket(agent)
    assert emu.alive() and agent.state()["engine"]["servedVersion"] == "1"


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_push_that_is_not_a_pickle_is_refused_before_sglang(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-REFIT-TENSOR-PICKLE: every version unpickles each entry outside any try and dies on bytes that are
    no pickle (here b"A"); the agent answers 422 naming the entry, and SGLang stays alive and serving."""
    emu, agent, _ = _open_window(version, "tensor", start_emulator, start_agent)
    r = agent.trainer("POST", "/v1/trainer/refit/tensor", {"serializedNamedTensors": ["QQ=="]})
    assert r.status == 422 and r.body["error"] == "InvalidPush", r.text
    assert "serializedNamedTensors[0] is not a pickle" in r.body["reason"], r.text
    assert "/update_weights_from_tensor" not in emu.stats()["calls"]
    _push_one_bucket(agent)
    assert emu.alive() and agent.state()["engine"]["servedVersion"] == "1"


def bucket_without_numel() -> bytes:
    """A hand-built bucket whose second metadata entry lacks `numel` (the SDK always writes it)."""
    good = packing.metadata_entry("a", (2,), "float32", 0, 8)
    bare = packing.metadata_entry("b", (2,), "float32", 8, 16)
    bare = packing.Instance(bare.cls, {k: v for k, v in bare.state.items() if k != "numel"})
    return packing.bucket_payload(_ipc_stand_in(16), [good, bare])


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_bucket_metadata_without_numel_is_refused_before_sglang(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-REFIT-TENSOR-META: every version reads each entry's numel outside any try and dies without it;
    the agent reads the pickle with stand-ins (nothing in it runs), answers 422 naming the field, keeps
    the window usable, and SGLang stays alive and serving."""
    emu, agent, _ = _open_window(version, "tensor", start_emulator, start_agent)
    body = {
        "serializedNamedTensors": [packing.to_wire(bucket_without_numel())],
        "loadFormat": "flattened_bucket",
    }
    r = agent.trainer("POST", "/v1/trainer/refit/tensor", body)
    assert r.status == 422 and r.body["error"] == "InvalidPush", r.text
    assert "serializedNamedTensors[0].metadata[1].numel" in r.body["reason"], r.text
    assert "/update_weights_from_tensor" not in emu.stats()["calls"]
    assert emu.alive() and agent.state()["lastCommand"]["state"] == "Running"
    _push_one_bucket(agent)
    assert emu.alive() and agent.state()["engine"]["servedVersion"] == "1"


@pytest.mark.parametrize("version", ["0.5.6", "0.5.15.post1", "0.5.21"])
def test_push_naming_a_group_sglang_never_formed(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-REFIT-GROUP-UNKNOWN: up to 0.5.20 SGLang dies on it, so the agent refuses 409 and sends nothing;
    from 0.5.21 SGLang answers 400 itself and the agent forwards it (502, the window fails)."""
    emu, agent, c = _open_window(version, "distributed", start_emulator, start_agent)
    meta = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 2]], "groupName": "never_formed"}
    r = agent.trainer("POST", "/v1/trainer/refit/distributed", meta)
    if version == "0.5.21":
        assert r.status == 502 and "init_weights_update_group" in r.body["reason"], r.text
    else:
        assert r.status == 409 and r.body["error"] == "UnknownWeightsGroup", r.text
        assert "never_formed" in r.body["reason"]
        assert "/update_weights_from_distributed" not in emu.stats()["calls"]
        assert agent.state()["lastCommand"]["state"] == "Running"
    agent.trainer("POST", "/v1/trainer/refit/close", {})
    _outcome(agent)
    assert emu.alive()
    _refit_async(agent, c, version="1", source="tensor")  # the next refit works, then SGLang serves again
    _push_one_bucket(agent)
    c.ok("resume")
    r = emu.call("POST", "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 2}})
    assert r.status == 200, r.text


def test_wrong_source_and_final_push_guards(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    _to_trained(c, "1")
    _refit_async(agent, c, version="1", source="distributed")
    agent.wait_state(lambda s: s["trainer"].get("refitWindowVersion") == "1", 5)
    t = agent.trainer
    r = t("POST", "/v1/trainer/refit/tensor", {"serializedNamedTensors": ["QQ=="]})
    assert r.status == 409 and r.body["error"] == "WrongSource"
    meta = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2, 2]]}
    r = t("POST", "/v1/trainer/refit/distributed", meta)  # no group yet: SGLang says so
    assert r.status == 502 and "init_weights_update_group" in r.body["reason"]
    assert agent.state()["lastCommand"]["state"] == "Running"  # open until the trainer closes it
    t("POST", "/v1/trainer/refit/close", {})
    assert _outcome(agent)["state"] == "Failed"
    _refit_async(agent, c, version="1", source="distributed")
    agent.wait_state(lambda s: s["trainer"].get("refitWindowVersion") == "1", 5)
    rank0 = Rank0(0, world_size=2)  # the trainer's side: SGLang's group init answers once it joined
    group = {"masterAddress": "127.0.0.1", "masterPort": rank0.port, "rankOffset": 1, "worldSize": 2}
    r = t("POST", "/v1/trainer/refit/group", group)  # answered at once; SGLang's side runs in the background
    assert r.status == 202 and r.body["group"] == "Pending", r.text
    r = t("POST", "/v1/trainer/refit/distributed", meta)
    assert r.status == 409 and r.body["error"] == "Busy", r.text  # SGLang still waits in the rendezvous
    assert rank0.wait(10) == [1]
    assert t("GET", "/v1/trainer/refit?wait=10").body["group"] == "Ready"
    r = t("POST", "/v1/trainer/refit/distributed", {**meta, "names": ["w", "v"]})
    assert r.status == 422
    assert t("POST", "/v1/trainer/refit/distributed", {**meta, "last": True}).status == 200
    r = t("POST", "/v1/trainer/refit/distributed", meta)
    assert r.status == 409 and r.body["error"] == "FinalPushDone"
    t("POST", "/v1/trainer/refit/close", {})
    assert _outcome(agent)["state"] == "Succeeded"
    assert agent.state()["engine"]["servedVersion"] == "1"
    assert agent.state()["releasedTags"] == ["kv_cache"]


@pytest.mark.parametrize("version", ["0.5.6", "0.5.15.post1", "0.5.20", "0.5.21", "0.5.23"])
def test_emulator_reads_flattened_buckets_on_every_version(
    version: str, start_emulator: Callable[..., Emulator]
) -> None:
    emu = start_emulator(version)
    emu.wait_ready()
    chunks = bucket_payloads([("a", "bfloat16", (8, 8)), ("b", "bfloat16", (8,)), ("n", "float32", (8,))])
    session = emu.call("POST", "/begin_weight_update", {}).status == 200  # 404 before 0.5.21
    for i, chunk in enumerate(chunks):
        body = {"serialized_named_tensors": [packing.to_wire(chunk)], "load_format": "flattened_bucket"}
        if i == len(chunks) - 1:
            body["weight_version"] = "7"
        r = emu.call("POST", "/update_weights_from_tensor", {**body, "flush_cache": False})
        assert r.status == 200 and r.body["success"], r.text
    if session:
        assert emu.call("POST", "/end_weight_update", {}).status == 200
    w = emu.weights()
    assert (w["source"], w["tensors"]) == ("tensor", 3)
    assert w["checksum"] == hashlib.sha256(b"".join(chunks)).hexdigest()


@pytest.mark.emulator_may_die
def test_a_bucket_sglang_cannot_view_kills_it_and_fails_the_refit(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    _to_trained(c, "1")
    _refit_async(agent, c, version="1", source="tensor")
    # bfloat16 at an odd byte offset: tensor_bucket.py's view(dtype) raises in the scheduler
    bad = packing.bucket_payload(_ipc_stand_in(8), [packing.metadata_entry("w", (3,), "bfloat16", 1, 7)])
    handoff = Handoff(agent.trainer_url)
    with pytest.raises(AgentError) as err, handoff.refit_window(timeout=10) as w:
        w.push_tensors([packing.to_wire(bad)], load_format="flattened_bucket")
    assert err.value.status == 502, err.value
    assert emu.wait_exit(10) != 0
    log = emu.log_text()
    assert "Scheduler hit an exception" in log and "storage_offset() must be divisible by 2" in log
    assert _outcome(agent)["state"] == "Failed"


def test_push_named_tensors_without_torch_says_what_is_missing(
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # a trainer without torch: `import torch` fails
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    _to_trained(c, "1")
    _refit_async(agent, c, version="1", source="tensor")
    handoff = Handoff(agent.trainer_url)
    with pytest.raises(ModuleNotFoundError, match="needs torch"), handoff.refit_window(timeout=10) as w:
        w.push_named_tensors([("w", object())])
    assert _outcome(agent)["state"] == "Failed"


class _SGLangImports(importlib.abc.MetaPathFinder):
    """Records every attempt to import sglang in this process (and refuses it)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.split(".")[0] == "sglang":
            self.asked.append(fullname)
            raise ImportError(f"no {fullname} in this trainer")


def test_a_trainer_that_publishes_at_once_waits_on_no_import(
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A torch trainer that publishes right after train() returns: nothing was imported or started for
    its push meanwhile (SGLang's serializer took 8.3 s to import in a trainer on an H100)."""
    pytest.importorskip("torch")
    finder = _SGLangImports()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    for name in [m for m in sys.modules if m.split(".")[0] == "sglang"]:
        monkeypatch.delitem(sys.modules, name)
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    handoff = Handoff(agent.trainer_url)
    before = set(threading.enumerate())

    def trainer() -> None:
        with handoff.train(timeout=20) as lease:
            lease.publish("1")

    t = threading.Thread(target=trainer, name="trainer")
    t.start()
    agent.wait_state(lambda s: s["trainer"]["requested"], 15, "the trainer to ask for the GPU")
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    c.ok("grant")
    t.join(20)
    assert not t.is_alive() and agent.state()["stage"] == "Trained"
    started = [x for x in threading.enumerate() if x not in before and x is not t]
    for x in started:
        x.join(5)
    assert finder.asked == [] and [x.name for x in started] == []
