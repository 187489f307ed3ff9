"""The happy path on every emulated SGLang version: each transition, in order, with its evidence."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import (
    ALL_TAGS,
    RETRACT_REFUSED,
    Agent,
    AgentDriver,
    Emulator,
    Pod,
    sha256_file,
    write_weights,
)


def test_full_iteration_disk_refit(pod: Pod, tmp_path: Path) -> None:
    agent, emu, c = pod.agent, pod.emu, pod.conductor
    st = agent.state()
    assert st["stage"] == "Serving"
    assert st["engine"]["version"] == emu.version
    assert st["engine"]["servedVersion"] == "default"
    # rollout traffic so the drain has something to drain
    r = emu.call(
        "POST", "/generate", {"text": ["a b c d", "a b c e"], "sampling_params": {"max_new_tokens": 3}}
    )
    assert r.status == 200

    assert agent.trainer("POST", "/v1/trainer/request", {}).body["requested"] is True
    c.ok("drain")
    st = agent.state()
    assert st["stage"] == "Drained" and st["engine"]["paused"] is True
    assert emu.stats()["paused"] is True

    used_before = emu.memory()[0]["used_bytes"]
    c.ok("release", tags=ALL_TAGS)
    st = agent.state()
    assert st["stage"] == "Released"
    assert sorted(st["releasedTags"]) == sorted(ALL_TAGS)
    mem = st["memory"]
    assert mem["verified"] is True and mem["gpus"] == 1
    assert mem["usedBeforeBytes"] == used_before
    assert mem["freedBytes"] == used_before - emu.memory()[0]["used_bytes"] > 0
    assert sorted(emu.stats()["offload_tags"]) == sorted(ALL_TAGS)

    c.ok("grant")
    lease = agent.trainer("GET", "/v1/trainer/lease?wait=1").body
    assert lease == {"granted": True, "epoch": 4}  # epoch 1 was the resume that opened rollout
    path = write_weights(tmp_path, "1")
    c.publish("1", str(path))
    st = agent.state()
    assert st["stage"] == "Trained"
    assert st["trainer"]["publishedVersion"] == "1" and st["trainer"]["publishedEpoch"] == 4
    assert st["trainer"]["leaseHeld"] is False

    c.ok("refit", version="1")  # path from the trainer's publish
    st = agent.state()
    assert st["stage"] == "Refitted" and st["engine"]["servedVersion"] == "1"
    assert st["releasedTags"] == ["kv_cache"]  # multi-stage resume: KV stays released until resume
    assert emu.stats()["paused"] is True  # engine stays paused until after the last resume
    w = emu.weights()
    assert w["checksum"] == sha256_file(path) and w["valid"] and w["weight_version"] == "1"

    c.ok("resume")
    st = agent.state()
    assert st["stage"] == "Serving" and st["releasedTags"] == [] and st["engine"]["paused"] is False
    r = emu.call("POST", "/generate", {"text": "a b c d", "sampling_params": {"max_new_tokens": 3}})
    assert r.body["meta_info"]["weight_version"] == "1"
    assert "GARBAGE" not in r.body["text"]
    assert emu.stats()["offload_tags"] == []


def test_two_iterations_and_replays(pod: Pod, tmp_path: Path) -> None:
    c = pod.conductor
    for v in ("1", "2"):
        c.full_iteration(v, str(write_weights(tmp_path, v)))
    st = pod.agent.state()
    assert st["engine"]["servedVersion"] == "2" and st["epoch"] == 11
    # the last command again: recorded outcome, nothing re-executed
    calls = pod.emu.lifecycle_calls()
    r = pod.agent.command("resume", 11)
    assert r.status == 200 and r.body["state"] == "Succeeded" and r.body["epoch"] == 11
    assert pod.emu.lifecycle_calls() == calls


@pytest.mark.parametrize("mode", ["abort", "retract"])
def test_rollout_traffic_during_the_lifecycle(
    mode: str,
    version: str,
    tmp_path: Path,
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
) -> None:
    """Clients keep generating through drain, release, refit and resume: nothing reaches released
    memory (the emulator would die), nothing is garbage, and versions only move forward. Where a retract
    drain can never become idle (C-DRAIN-RETRACT, 0.5.15.post1-0.5.20) the agent refuses it and the
    iteration drains with abort."""
    refused = mode == "retract" and version in RETRACT_REFUSED
    drain_mode = "abort" if refused else mode
    emu = start_emulator(version, "--weight-version", "0", tps=200)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    stop = threading.Event()
    replies: list[dict[str, Any]] = []
    errors: list[str] = []

    def client(i: int) -> None:
        body = {"text": f"shared prefix {i}", "sampling_params": {"max_new_tokens": 10}}
        while not stop.is_set():
            r = emu.call("POST", "/generate", body, timeout=30)
            if r.status != 200:
                errors.append(r.text)
                return
            replies.append(r.body)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for v in ("1", "2"):
        time.sleep(0.2)
        if refused:
            c.refused("drain", "RetractUnsupported", mode=mode, _emulator_url=emu.url)
        c.ok("drain", mode=drain_mode)
        c.ok("release", tags=ALL_TAGS)
        c.ok("grant")
        c.publish(v, str(write_weights(tmp_path, v)))
        c.ok("refit", version=v)
        c.ok("resume")
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    finished = [r for r in replies if r["meta_info"]["finish_reason"]["type"] == "length"]
    assert len(finished) > 10
    assert not any("GARBAGE" in r["text"] for r in replies)
    served = {r["meta_info"]["weight_version"] for r in finished}
    assert served <= {"0", "1", "2"} and "2" in served
    if drain_mode == "abort":
        aborted = [r for r in replies if r["meta_info"]["finish_reason"]["type"] == "abort"]
        assert aborted, "the drain aborted nothing: the test did not overlap traffic with it"
    crossed = 0
    for r in finished:
        versions = [s["version"] for s in r["meta_info"].get("weight_versions", [])]
        assert versions == sorted(versions), versions  # retracted requests may cross a refit, forward only
        crossed += len(versions) > 1
    if version in ("0.5.21", "0.5.23"):  # the versions with per-token spans
        # abort: no request spans two versions; retract: the requests running at the drain finish on the
        # new weights
        assert (crossed > 0) == (drain_mode == "retract"), crossed


def test_fresh_server_is_ready_until_the_operator_opens_rollout(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """A recreated pod serves its launch weights: rollout must not open before the operator verified or
    refitted them (rejoin)."""
    emu = start_emulator(version, "--weight-version", "3")
    agent = start_agent(emu, serving=False)
    st = agent.wait_stage("Ready")
    assert st["engine"]["servedVersion"] == "3" and st["engine"]["paused"] is False and st["epoch"] == 0
    c = AgentDriver(agent)
    for action in ("release", "grant"):
        c.refused(
            action,
            "IllegalTransition",
            _emulator_url=emu.url,
            **({"tags": ALL_TAGS} if action == "release" else {}),
        )
    assert agent.trainer("POST", "/v1/trainer/request", {}).status == 200  # a trainer may ask early
    path = str(write_weights(tmp_path, "5"))
    c.ok("refit", version="5", path=path)  # rejoin at the committed version: drains first
    st = agent.state()
    assert (
        st["stage"] == "Refitted" and st["engine"]["servedVersion"] == "5" and emu.stats()["paused"] is True
    )
    c.ok("resume")
    st = agent.state()
    assert st["stage"] == "Serving" and st["engine"]["paused"] is False
    assert (
        emu.call("POST", "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}).body[
            "meta_info"
        ]["weight_version"]
        == "5"
    )
