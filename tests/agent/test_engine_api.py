"""The agent's SGLang-compatible endpoint (agent/engines/sglang/endpoint.py) against the emulator, with
this test as the operator: a framework's release waits for the lease, its pushes go through the refit
window once the refit opens it, its resume returns once the pod serves the new version; refusals come back
in SGLang's error shape for the route and reach SGLang with nothing."""

from __future__ import annotations

import threading
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, Agent, AgentDriver, Emulator, Reply, free_port, http, write_weights

from rljob.testing.ipc_stand_in import cuda_reduction
from rljob.trainer.engines.sglang import packing


def _bucket(name: str = "w") -> str:
    """One float32 [2] tensor as a flattened bucket on the wire (the stand-in CUDA IPC reduction)."""
    entry = packing.metadata_entry(name, (2,), "float32", 0, 8)
    return packing.to_wire(packing.bucket_payload(cuda_reduction(8), [entry]))


class Framework:
    """A framework's HTTP calls to the endpoint, each in its own thread (they block on the gang)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replies: dict[str, Reply] = {}
        self._threads: dict[str, threading.Thread] = {}

    def call(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Reply:
        return http(method, self.url + path, body, timeout=timeout)

    def start(self, key: str, method: str, path: str, body: Any = None) -> None:
        def run() -> None:
            self.replies[key] = self.call(method, path, body)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self._threads[key] = t

    def reply(self, key: str, timeout: float = 30) -> Reply:
        self._threads[key].join(timeout)
        assert key in self.replies, f"{key}: no answer within {timeout}s"
        return self.replies.pop(key)

    def waiting(self, key: str) -> bool:
        return self._threads[key].is_alive()


@pytest.fixture
def pod(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> tuple[Emulator, Agent, Framework]:
    emu = start_emulator("0.5.23", "--enable-memory-saver")
    port = free_port()
    agent = start_agent(emu, "--engine-listen", f"127.0.0.1:{port}")
    return emu, agent, Framework(f"http://127.0.0.1:{port}")


def _to_granted(agent: Agent, c: AgentDriver, fw: Framework) -> None:
    """The framework's release is its lease request: it waits until drained, released and granted."""
    fw.start("release", "POST", "/release_memory_occupation", {})
    agent.wait_state(lambda s: s["trainer"]["requested"], 10, "the trainer's request")
    assert fw.waiting("release")
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    assert fw.waiting("release"), "the release answered before the lease was granted"
    c.ok("grant")
    r = fw.reply("release")
    assert (r.status, r.text) == (200, "null"), r.text  # C-ROUTE-RELEASE


def _lifecycle_calls(emu: Emulator) -> dict[str, Any]:
    return dict(http("GET", emu.url + "/_emulator/calls").body)


def test_tensor_iteration_through_the_endpoint(pod: tuple[Emulator, Agent, Framework]) -> None:
    emu, agent, fw = pod
    c = AgentDriver(agent)
    r = fw.call("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    served = agent.state()["engine"]["servedVersion"]
    assert r.status == 200 and r.body["meta_info"]["weight_version"] == served, r.text  # passed through
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}, "stream": True}
    r = fw.call("POST", "/generate", body)  # streamed: SGLang's server-sent events, chunk by chunk
    events = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status == 200 and events[-1] == "data: [DONE]" and len(events) >= 2, r.text
    _to_granted(agent, c, fw)
    assert fw.call("POST", "/resume_memory_occupation", {"tags": ["weights"]}).text == "null"
    assert fw.call("POST", "/pause_generation", {}).body["status"] == "ok"
    push = {"serialized_named_tensors": [_bucket()], "load_format": "flattened_bucket", "flush_cache": False}
    fw.start("push", "POST", "/update_weights_from_tensor", {**push, "weight_version": "1"})
    agent.wait_state(lambda s: s["trainer"].get("publishedVersion") == "1", 10, "the push to publish 1")
    assert fw.waiting("push"), "the push went on before the refit window opened"
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", source="tensor").status == 202
    r = fw.reply("push")
    assert r.status == 200 and r.body["success"] is True, r.text
    assert fw.call("GET", "/flush_cache").status == 200  # answered here: the refit flushes
    assert fw.call("POST", "/continue_generation", {}).body["status"] == "ok"
    fw.start("resume", "POST", "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    agent.wait_stage("Refitted", 15)
    assert fw.waiting("resume"), "the resume answered before the pod served the new weights"
    c.ok("resume")
    r = fw.reply("resume")
    assert (r.status, r.text) == (200, "null"), r.text
    served = agent.state()["engine"]["servedVersion"]
    assert served == "1"
    calls = _lifecycle_calls(emu)
    assert calls["repeats"] == [], calls  # nothing non-idempotent twice
    # The framework's pause and continue were answered by the endpoint: SGLang saw the agent's only.
    assert calls["routes"].get("/pause_generation") == 1, calls["routes"]


def test_disk_iteration_through_the_endpoint(pod: tuple[Emulator, Agent, Framework], tmp_path: Path) -> None:
    emu, agent, fw = pod
    c = AgentDriver(agent)
    _to_granted(agent, c, fw)
    path = str(write_weights(tmp_path / "w", "1"))
    fw.start("load", "POST", "/update_weights_from_disk", {"model_path": path, "abort_all_requests": True})
    agent.wait_state(lambda s: s["trainer"].get("publishedPath") == path, 10, "the load to publish its path")
    c.ok("refit", version="1", path=path)
    r = fw.reply("load")
    assert r.status == 200 and r.body["success"] is True, r.text  # C-ROUTE-DISK
    fw.start("resume", "POST", "/resume_memory_occupation", {})
    c.ok("resume")
    assert fw.reply("resume").text == "null"
    assert agent.state()["engine"]["servedVersion"] == "1"
    assert _lifecycle_calls(emu)["repeats"] == []


def test_refusals_come_back_in_sglang_shapes(pod: tuple[Emulator, Agent, Framework]) -> None:
    emu, agent, fw = pod
    c = AgentDriver(agent)
    before = sum(_lifecycle_calls(emu)["routes"].values())
    push = {"serialized_named_tensors": [_bucket()], "load_format": "flattened_bucket"}
    r = fw.call("POST", "/update_weights_from_tensor", push)
    assert r.status == 400 and r.body["success"] is False and "no GPU lease" in r.body["message"], r.text
    r = fw.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status == 400 and "nothing is released" in r.body["error"]["message"], r.text
    r = fw.call(
        "POST", "/update_weights_from_distributed", {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}
    )
    assert r.status == 400 and r.body["success"] is False, r.text
    r = fw.call("POST", "/update_weights_from_tensor", {"serialized_named_tensors": []})
    assert r.status == 400 and r.body["object"] == "error" and r.body["code"] == 400, r.text
    assert sum(_lifecycle_calls(emu)["routes"].values()) == before, "a refused call reached SGLang"
    # A push the guards refuse (a bucket whose metadata lacks a field SGLang reads) reaches the framework
    # as SGLang's update error, and SGLang gets nothing of it.
    _to_granted(agent, c, fw)
    full = packing.metadata_entry("w", (2,), "float32", 0, 8)
    entry = packing.Instance(full.cls, {k: v for k, v in full.state.items() if k != "numel"})
    bad = packing.to_wire(packing.bucket_payload(cuda_reduction(8), [entry]))
    fw.start(
        "push",
        "POST",
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [bad], "load_format": "flattened_bucket", "weight_version": "1"},
    )
    agent.wait_state(lambda s: s["trainer"].get("publishedVersion") == "1", 10, "the push to publish 1")
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", source="tensor").status == 202
    r = fw.reply("push")
    assert r.status == 400 and r.body["success"] is False and "InvalidPush" in r.body["message"], r.text
    assert emu.alive()


@pytest.mark.parametrize("cpu_backup", [False, True])
def test_a_resume_with_nothing_pushed_gives_the_lease_back_and_serves_the_committed_weights_again(
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
    tmp_path: Path,
    cpu_backup: bool,
) -> None:
    """AReaL's start-up offload and onload: release, then resume with no weights. The lease goes back
    without weights; the refit the operator sends (reload) brings back what the release discarded: a
    disk load of the checkpoint SGLang launched from, or nothing where SGLang restores its CPU backup."""
    write_weights(tmp_path / "launch-model", "0")  # the checkpoint the emulator launches from
    flags = ["--enable-memory-saver", *(["--enable-weights-cpu-backup"] if cpu_backup else [])]
    emu = start_emulator("0.5.23", *flags)
    port = free_port()
    agent = start_agent(emu, "--engine-listen", f"127.0.0.1:{port}")
    fw = Framework(f"http://127.0.0.1:{port}")
    c = AgentDriver(agent)
    served = agent.state()["engine"]["servedVersion"]
    _to_granted(agent, c, fw)
    fw.start("resume", "POST", "/resume_memory_occupation", {})
    st = agent.wait_state(lambda s: s["stage"] == "Trained", 10, "the lease to come back")
    assert st["trainer"]["returnedEpoch"] == c.epoch and not st["trainer"]["leaseHeld"], st["trainer"]
    assert "publishedVersion" not in st["trainer"], st["trainer"]
    assert fw.waiting("resume"), "the resume answered before the gang served again"
    c.ok("refit", version=served, reload=True)
    c.ok("resume")
    r = fw.reply("resume")
    assert (r.status, r.text) == (200, "null"), r.text
    assert agent.state()["engine"]["servedVersion"] == served
    calls = _lifecycle_calls(emu)
    assert calls["repeats"] == [], calls
    assert calls["routes"].get("/update_weights_from_disk", 0) == (0 if cpu_backup else 1), calls["routes"]
    r = fw.call("POST", "/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert r.status == 200 and r.body["meta_info"]["weight_version"] == served, r.text


def test_the_trainers_last_refusal_is_in_the_state_until_it_asks_again(
    pod: tuple[Emulator, Agent, Framework],
) -> None:
    _, agent, fw = pod
    c = AgentDriver(agent)
    push = {"serialized_named_tensors": [_bucket()], "load_format": "flattened_bucket"}
    assert fw.call("POST", "/update_weights_from_tensor", push).status == 400
    st = agent.wait_state(lambda s: "lastRefusal" in s["trainer"], 10, "the refusal")
    assert st["trainer"]["lastRefusal"].startswith(
        "POST /update_weights_from_tensor: rljob: the trainer holds"
    ), st
    _to_granted(agent, c, fw)  # the next lease request clears it
    assert "lastRefusal" not in agent.state()["trainer"]


def test_a_release_sent_again_after_the_client_gave_up_waits_on_the_same_request(
    pod: tuple[Emulator, Agent, Framework],
) -> None:
    """verl's adapter gives a call 60 s and sends it again on a timeout (3 attempts): the lease request
    outlives the first attempt, and the attempt that is waiting when the gang's lease is granted gets it."""
    _, agent, fw = pod
    c = AgentDriver(agent)
    with pytest.raises((TimeoutError, urllib.error.URLError)):  # the client gives up on its first attempt
        fw.call("POST", "/release_memory_occupation", {}, timeout=1)
    epoch = agent.state()["trainer"]["requestEpoch"]
    fw.start("retry", "POST", "/release_memory_occupation", {})
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    c.ok("grant")
    r = fw.reply("retry")
    assert (r.status, r.text) == (200, "null"), r.text
    st = agent.state()["trainer"]
    assert st["leaseHeld"] and st["requestEpoch"] == epoch, st  # one request, the first attempt's


def _bad_bucket() -> str:
    """A flattened bucket whose metadata lacks `numel`, which SGLang reads: the guards refuse it."""
    full = packing.metadata_entry("w", (2,), "float32", 0, 8)
    entry = packing.Instance(full.cls, {k: v for k, v in full.state.items() if k != "numel"})
    return packing.to_wire(packing.bucket_payload(cuda_reduction(8), [entry]))


def test_a_refusal_the_trainer_recovered_from_is_not_its_last_after_its_next_accepted_push(
    pod: tuple[Emulator, Agent, Framework],
) -> None:
    """A push refused (nothing sent to SGLang), then the same bucket fixed and accepted: the refusal is
    behind the trainer, and a later end of the trainer must not be blamed on it."""
    _, agent, fw = pod
    c = AgentDriver(agent)
    _to_granted(agent, c, fw)
    bad = {
        "serialized_named_tensors": [_bad_bucket()],
        "load_format": "flattened_bucket",
        "weight_version": "1",
    }
    fw.start("bad", "POST", "/update_weights_from_tensor", bad)
    agent.wait_state(lambda s: s["trainer"].get("publishedVersion") == "1", 10, "the push to publish 1")
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", source="tensor").status == 202
    r = fw.reply("bad")
    assert r.status == 400 and "InvalidPush" in r.body["message"], r.text
    st = agent.wait_state(lambda s: "lastRefusal" in s["trainer"], 10, "the refusal")
    assert "InvalidPush" in st["trainer"]["lastRefusal"], st["trainer"]
    good = {"serialized_named_tensors": [_bucket()], "load_format": "flattened_bucket", "weight_version": "1"}
    r = fw.call("POST", "/update_weights_from_tensor", good)
    assert r.status == 200 and r.body["success"] is True, r.text
    assert "lastRefusal" not in agent.state()["trainer"], agent.state()["trainer"]
    fw.start("resume", "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})
    agent.wait_stage("Refitted", 15)
    c.ok("resume")
    assert fw.reply("resume").text == "null"
    assert "lastRefusal" not in agent.state()["trainer"]


def test_through_the_sdk_an_accepted_push_clears_the_last_refusal_and_a_failed_close_keeps_it(
    pod: tuple[Emulator, Agent, Framework],
) -> None:
    _, agent, _ = pod
    c = AgentDriver(agent)
    c.iteration_to_trained("1", None)
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", source="tensor").status == 202
    agent.wait_state(lambda s: s["trainer"].get("refitWindowVersion") == "1", 10, "the window")
    bad = {"serializedNamedTensors": [_bad_bucket()], "loadFormat": "flattened_bucket"}
    r = agent.trainer("POST", "/v1/trainer/refit/tensor", bad)
    assert r.status == 422 and r.body["error"] == "InvalidPush", r.text
    assert agent.state()["trainer"]["lastRefusal"].startswith("POST /v1/trainer/refit/tensor: InvalidPush")
    good = {"serializedNamedTensors": [_bucket()], "loadFormat": "flattened_bucket"}
    assert agent.trainer("POST", "/v1/trainer/refit/tensor", good).status == 200
    assert "lastRefusal" not in agent.state()["trainer"], agent.state()["trainer"]
    r = agent.trainer("POST", "/v1/trainer/refit/tensor", bad)  # refused again, then the trainer gives up
    assert r.status == 422
    r = agent.trainer("POST", "/v1/trainer/refit/close", {"error": "the bucket could not be built"})
    assert r.status == 200, r.text
    assert "InvalidPush" in agent.state()["trainer"]["lastRefusal"]  # a close with an error recovers nothing
