"""A framework's call to the agent's SGLang-compatible endpoint in flight when the agent's process restarts
(SIGKILL, then the same command line, as the kubelet restarts a native sidecar): the call's connection
drops with the process (no process keeps it), and the same call sent again to the restarted agent is
answered as the first would have been, from its record, without a second SGLang call. Where the agent
cannot account for the first sending (a refit window open at the restart), the call sent again is refused
with the reason the pod is given up."""

from __future__ import annotations

import threading
import urllib.error
from collections.abc import Callable
from http.client import HTTPException
from pathlib import Path
from typing import Any

import pytest
from agent_procs import (
    ALL_TAGS,
    Agent,
    AgentDriver,
    Emulator,
    Reply,
    free_port,
    http,
    wait_until,
    write_weights,
)
from test_engine_api import _bucket
from test_recovery import calls, count, recovered, restart

VERSION = "0.5.23"


class Call:
    """One framework call in a thread: its reply, or the error its connection ended with."""

    def __init__(self, url: str, path: str, body: Any) -> None:
        self.reply: Reply | None = None
        self.error: BaseException | None = None

        def run() -> None:
            try:
                self.reply = http("POST", url + path, body, timeout=60)
            except (OSError, urllib.error.URLError, HTTPException) as e:
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def waiting(self) -> bool:
        return self.thread.is_alive()

    def result(self, timeout: float = 30) -> Reply:
        self.thread.join(timeout)
        assert self.reply is not None, f"no answer within {timeout}s ({self.error!r})"
        return self.reply

    def dropped(self, timeout: float = 15) -> BaseException:
        """The call ended without an answer: the agent's process, and its end of the connection, is gone."""
        self.thread.join(timeout)
        assert self.reply is None and self.error is not None, (self.reply, self.error)
        return self.error


@pytest.fixture
def endpoint_pod(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent], tmp_path: Path
) -> Callable[..., tuple[Emulator, Agent, AgentDriver, str]]:
    """An emulator with `flags`, its agent Serving with a record (--state-dir) and the endpoint."""

    def start(*flags: str) -> tuple[Emulator, Agent, AgentDriver, str]:
        emu = start_emulator(VERSION, "--enable-memory-saver", *flags)
        port = free_port()
        state = str(tmp_path / f"state-{emu.port}")
        agent = start_agent(emu, "--state-dir", state, "--engine-listen", f"127.0.0.1:{port}")
        return emu, agent, AgentDriver(agent), f"http://127.0.0.1:{port}"

    return start


def _dropped_by_restart(agent: Agent, call: Call) -> None:
    restart(agent)
    error = call.dropped()
    # urllib's words for it; requests (slime) raises ConnectionError(RemoteDisconnected), aiohttp (verl,
    # AReaL) ServerDisconnectedError.
    assert isinstance(error, (ConnectionError, urllib.error.URLError, HTTPException)), error
    st = recovered(agent)
    assert st["recovery"]["state"] == "Recovered", st["recovery"]


def _lease_granted(agent: Agent, c: AgentDriver, engine: str) -> None:
    release = Call(engine, "/release_memory_occupation", {})
    agent.wait_state(lambda s: s["trainer"]["requested"], 10, "the framework's lease request")
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    c.ok("grant")
    assert release.result().text == "null"


def test_a_release_in_flight_drops_and_the_release_sent_again_gets_the_lease(endpoint_pod: Any) -> None:
    emu, agent, c, engine = endpoint_pod()
    first = Call(engine, "/release_memory_occupation", {})
    st = agent.wait_state(lambda s: s["trainer"]["requested"], 10, "the framework's lease request")
    _dropped_by_restart(agent, first)
    again = Call(engine, "/release_memory_occupation", {})
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    assert again.waiting(), "the release answered before the lease was granted"
    c.ok("grant")
    r = again.result()
    assert (r.status, r.text) == (200, "null"), r.text
    trainer = agent.state()["trainer"]
    assert trainer["leaseHeld"] and trainer["requestEpoch"] == st["trainer"]["requestEpoch"], trainer
    assert count(calls(emu), "/release_memory_occupation") == 1  # the agent's own, once


def test_a_load_and_a_resume_sent_again_after_the_restart_are_answered_as_the_first(
    endpoint_pod: Any, tmp_path: Path
) -> None:
    """AReaL's disk refit: its load waits for this pod's refit, its resume for the gang serving. Each in
    flight at a restart, each sent again: the load replays the version the lease published (not a refusal
    for a lease no longer held), the resume of weights the pod already serves answers at once."""
    emu, agent, c, engine = endpoint_pod()
    _lease_granted(agent, c, engine)
    path = str(write_weights(tmp_path / "w", "1"))
    body = {"model_path": path, "abort_all_requests": True}
    load = Call(engine, "/update_weights_from_disk", body)
    agent.wait_state(lambda s: s["trainer"].get("publishedPath") == path, 10, "the load to publish its path")
    _dropped_by_restart(agent, load)
    again = Call(engine, "/update_weights_from_disk", body)
    c.ok("refit", version="1", path=path)
    r = again.result()
    assert r.status == 200 and r.body["success"] is True, r.text
    resume = Call(engine, "/resume_memory_occupation", {})
    _dropped_by_restart(agent, resume)
    c.ok("resume")
    r = Call(engine, "/resume_memory_occupation", {}).result()
    assert (r.status, r.text) == (200, "null"), r.text
    st = agent.state()
    assert (st["stage"], st["engine"]["servedVersion"]) == ("Serving", "1")
    report = calls(emu)
    assert count(report, "/update_weights_from_disk") == 1 and report["repeats"] == [], report


def test_a_push_sent_again_after_the_restart_goes_to_sglang_once(endpoint_pod: Any) -> None:
    """slime's and verl's tensor refit: the push publishes and waits for the refit window. In flight at a
    restart, sent again: it waits for the same window and is forwarded once."""
    emu, agent, c, engine = endpoint_pod()
    _lease_granted(agent, c, engine)
    body = {"serialized_named_tensors": [_bucket()], "load_format": "flattened_bucket", "weight_version": "1"}
    push = Call(engine, "/update_weights_from_tensor", body)
    agent.wait_state(lambda s: s["trainer"].get("publishedVersion") == "1", 10, "the push to publish 1")
    _dropped_by_restart(agent, push)
    again = Call(engine, "/update_weights_from_tensor", body)
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", source="tensor").status == 202
    r = again.result()
    assert r.status == 200 and r.body["success"] is True, r.text
    resume = Call(engine, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    agent.wait_stage("Refitted", 15)
    c.ok("resume")
    assert resume.result().text == "null"
    assert agent.state()["engine"]["servedVersion"] == "1"
    restart(agent)  # serving 1: the record still names 1 as this lease's weights
    recovered(agent)
    r = Call(engine, "/update_weights_from_tensor", body).result()  # no window for 1 will open again
    assert r.status == 400 and "this push came after their refit window" in r.body["message"], r.text
    report = calls(emu)
    assert count(report, "/update_weights_from_tensor") == 1 and report["repeats"] == [], report


def test_a_push_in_an_open_window_at_the_restart_gives_the_pod_up_and_the_push_sent_again_says_so(
    endpoint_pod: Any,
) -> None:
    """The window's pushes went to SGLang and cannot be replayed by the agent: the restarted agent reports
    StateUnknown (the pod is replaced), and the push sent again gets that reason at once, not a wait."""
    emu, agent, c, engine = endpoint_pod("--fault-slow", "/update_weights_from_tensor=2")
    _lease_granted(agent, c, engine)
    body = {"serialized_named_tensors": [_bucket()], "load_format": "flattened_bucket", "weight_version": "1"}
    push = Call(engine, "/update_weights_from_tensor", body)
    agent.wait_state(lambda s: s["trainer"].get("publishedVersion") == "1", 10, "the push to publish 1")
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", source="tensor").status == 202
    wait_until(lambda: count(calls(emu), "/update_weights_from_tensor") == 1, 10, "the push forwarded")
    restart(agent)
    push.dropped()
    st = recovered(agent)
    assert st["recovery"]["state"] == "Unsure" and st["fatal"].startswith("StateUnknown: a tensor"), st
    r = Call(engine, "/update_weights_from_tensor", body).result()
    assert r.status == 400 and r.body["success"] is False, r.text
    assert "the pod must be replaced" in r.body["message"] and "StateUnknown" in r.body["message"], r.text
    assert count(calls(emu), "/update_weights_from_tensor") == 1
