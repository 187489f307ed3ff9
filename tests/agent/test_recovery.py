"""The agent's own restart (SIGKILL, then the same command line, as the kubelet restarts a native sidecar)
against a real emulator: it recovers its state from the pod-local record, checks it against SGLang, and
continues where it was without repeating a non-idempotent call; where it cannot be sure, it says so
(stage Failed, fatal StateUnknown, recovery Unsure). The emulator's /_emulator/calls counts every call."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, Agent, AgentDriver, Emulator, free_port, http, wait_until, write_weights

VERSION = "0.5.23"


def restart(agent: Agent) -> None:
    """SIGKILL the agent and start the same command line again (ports, token, state dir)."""
    argv = list(agent.popen.args)
    agent.popen.kill()
    agent.popen.wait(5)
    agent.popen = subprocess.Popen(argv, stdout=agent._logf, stderr=subprocess.STDOUT)
    wait_until(lambda: http("GET", agent.url + "/healthz", timeout=2).status == 200, 15, "agent restarted")


def recovered(agent: Agent, timeout: float = 20) -> dict[str, Any]:
    return agent.wait_state(
        lambda s: s["recovery"]["state"] in ("Recovered", "Unsure"), timeout, "recovery to finish"
    )


def calls(emu: Emulator) -> dict[str, Any]:
    return dict(emu.call("GET", "/_emulator/calls").body)


def count(report: dict[str, Any], route: str) -> int:
    return int(report["routes"].get(route, 0))


def wait_command(agent: Agent, epoch: int, timeout: float = 30) -> dict[str, Any]:
    return agent.wait_state(
        lambda s: (
            (s.get("lastCommand") or {}).get("epoch") == epoch and s["lastCommand"]["state"] != "Running"
        ),
        timeout,
        f"command {epoch} to finish",
    )


@pytest.fixture
def start_pod(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent], tmp_path: Path
) -> Callable[..., tuple[Emulator, Agent, AgentDriver]]:
    def start(*flags: str, version: str = VERSION) -> tuple[Emulator, Agent, AgentDriver]:
        emu = start_emulator(version, *flags)
        agent = start_agent(emu, "--state-dir", str(tmp_path / f"state-{emu.port}"))
        return emu, agent, AgentDriver(agent)

    return start


def test_restart_while_serving_keeps_the_state(start_pod: Any, tmp_path: Path) -> None:
    emu, agent, c = start_pod()
    before = agent.state()
    restart(agent)
    st = recovered(agent)
    assert st["recovery"] == {
        "state": "Recovered",
        "restarts": 1,
        "detail": "recorded state matches SGLang",
    }
    assert st["bootId"] != before["bootId"]
    assert (st["stage"], st["epoch"], st["engine"]["servedVersion"]) == ("Serving", 1, "default")
    # The operator's repeat of the last epoch is a replay of its recorded outcome, not a second resume.
    r = agent.command("resume", 1)
    assert r.status == 200 and r.body["state"] == "Succeeded", r.text
    c.full_iteration("1", str(write_weights(tmp_path, "1")))
    assert agent.state()["engine"]["servedVersion"] == "1"
    assert calls(emu)["repeats"] == []


@pytest.mark.parametrize("route", ["/release_memory_occupation", "/resume_memory_occupation"])
def test_killed_during_a_memory_call_recovers_from_freed_memory(
    start_pod: Any, tmp_path: Path, route: str
) -> None:
    """Killed while the call is in flight: the record holds its intent, no outcome. Freed (or regained)
    GPU memory proves it was made: the command finishes, and the call went to SGLang once."""
    emu, agent, c = start_pod("--fault-slow", f"{route}=1.0")
    if route == "/release_memory_occupation":
        c.ok("drain")
        c.epoch += 1
        assert agent.command("release", c.epoch, wait=0, tags=ALL_TAGS).status == 202
        target, sent = "Released", 1
    else:
        path = str(write_weights(tmp_path, "1"))
        c.iteration_to_trained("1", path)
        c.ok("refit", version="1", path=path)  # resumes weights and cuda_graph (one call)
        c.epoch += 1
        assert agent.command("resume", c.epoch, wait=0).status == 202  # kv_cache, then continue
        target, sent = "Serving", 2
    wait_until(lambda: count(calls(emu), route) == sent, 10, f"{route} sent")
    restart(agent)
    st = recovered(agent)
    assert st["recovery"]["state"] == "Recovered", st["recovery"]
    assert "made" in st["recovery"]["detail"], st["recovery"]
    st = wait_command(agent, c.epoch)
    assert st["lastCommand"]["state"] == "Succeeded", st["lastCommand"]
    assert st["stage"] == target
    if target == "Released":
        assert st["memory"]["verified"] is True and sorted(st["releasedTags"]) == sorted(ALL_TAGS)
    else:
        assert st["releasedTags"] == []
    report = calls(emu)
    assert count(report, route) == sent and report["repeats"] == [], report
    assert sorted(emu.stats()["offload_tags"]) == (sorted(ALL_TAGS) if target == "Released" else [])


def test_killed_during_a_disk_refit_recovers_from_the_served_version(start_pod: Any, tmp_path: Path) -> None:
    emu, agent, c = start_pod("--fault-slow", "/update_weights_from_disk=1.0")
    path = str(write_weights(tmp_path, "1"))
    c.iteration_to_trained("1", path)
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version="1", path=path).status == 202
    wait_until(lambda: count(calls(emu), "/update_weights_from_disk") == 1, 10, "refit sent")
    restart(agent)
    st = recovered(agent)
    assert st["recovery"]["state"] == "Recovered" and "made" in st["recovery"]["detail"], st["recovery"]
    st = wait_command(agent, c.epoch)
    assert st["lastCommand"]["state"] == "Succeeded", st["lastCommand"]
    assert (st["stage"], st["engine"]["servedVersion"]) == ("Refitted", "1")
    c.ok("resume")
    report = calls(emu)
    assert count(report, "/update_weights_from_disk") == 1 and report["repeats"] == [], report


def test_restart_while_the_trainer_holds_the_lease(start_pod: Any, tmp_path: Path) -> None:
    emu, agent, c = start_pod()
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    c.ok("grant")
    restart(agent)
    st = recovered(agent)
    assert st["stage"] == "Granted" and st["trainer"]["leaseHeld"] is True
    assert agent.trainer("GET", "/v1/trainer/lease").body == {"granted": True, "epoch": c.epoch}
    path = str(write_weights(tmp_path, "1"))
    c.publish("1", path)
    restart(agent)  # the publish's answer may be lost: the same publish again is a replay
    recovered(agent)
    r = agent.trainer("POST", "/v1/trainer/publish", {"version": "1", "path": path})
    assert r.status == 200 and r.body["publishedVersion"] == "1", r.text
    r = agent.trainer("POST", "/v1/trainer/publish", {"version": "2", "path": path})
    assert r.status == 409 and r.body["error"] == "NoLease", r.text
    c.ok("refit", version="1", path=path)
    c.ok("resume")
    assert agent.state()["recovery"]["restarts"] == 2
    assert calls(emu)["repeats"] == []


def test_an_announced_call_without_evidence_is_state_unknown(start_pod: Any) -> None:
    """The release reached SGLang and never ran (it hangs): nothing freed, so the restarted agent cannot
    tell whether it will. It does not send it again; it reports StateUnknown."""
    emu, agent, c = start_pod("--fault-hang", "/release_memory_occupation")
    c.ok("drain")
    c.epoch += 1
    verify = {"timeoutSeconds": 1}
    assert agent.command("release", c.epoch, wait=0, tags=ALL_TAGS, verify=verify).status == 202
    wait_until(lambda: count(calls(emu), "/release_memory_occupation") == 1, 10, "release sent")
    restart(agent)
    st = recovered(agent)
    assert st["recovery"]["state"] == "Unsure" and st["stage"] == "Failed", st
    assert st["fatal"].startswith("StateUnknown: release_memory_occupation(kv_cache, weights, cuda_graph)")
    assert http("GET", agent.url + "/healthz").body["ok"] is False
    c.refused("drain", "AgentFailed")
    time.sleep(0.5)
    assert count(calls(emu), "/release_memory_occupation") == 1


def test_an_unreadable_record_is_state_unknown(start_pod: Any, tmp_path: Path) -> None:
    emu, agent, _ = start_pod()
    record = tmp_path / f"state-{emu.port}" / "agent-record.json"
    assert json.loads(record.read_text())["state"]["stage"] == "Serving"
    argv = list(agent.popen.args)
    agent.popen.kill()
    agent.popen.wait(5)
    record.write_text("{not json")
    agent.popen = subprocess.Popen(argv, stdout=agent._logf, stderr=subprocess.STDOUT)
    wait_until(lambda: http("GET", agent.url + "/healthz", timeout=2).status == 200, 15, "agent restarted")
    st = agent.wait_state(lambda s: s["stage"] == "Failed", 15, "Failed")
    assert st["recovery"]["state"] == "Unsure" and st["fatal"].startswith("StateUnknown:"), st


def _send_in_background(url: str) -> None:
    """A framework's call that blocks on the gang, sent in a thread; its answer is not waited for, and a
    connection the agent's restart drops is expected."""

    def send() -> None:
        with contextlib.suppress(OSError):
            http("POST", url, {}, timeout=60)

    threading.Thread(target=send, daemon=True).start()


@pytest.fixture
def reload_pod(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent], tmp_path: Path
) -> Callable[..., tuple[Emulator, Agent, AgentDriver, str]]:
    """A pod serving the launch weights whose trainer, through the endpoint, took the lease and gave it
    back without weights; with `flags` for the emulator. (emulator, agent, conductor, served version)."""

    def start(*flags: str) -> tuple[Emulator, Agent, AgentDriver, str]:
        write_weights(tmp_path / "launch-model", "0")  # the checkpoint the emulator launches from
        emu = start_emulator(VERSION, *flags)
        port = free_port()
        engine = f"http://127.0.0.1:{port}"
        state = str(tmp_path / f"state-{emu.port}")
        agent = start_agent(emu, "--state-dir", state, "--engine-listen", f"127.0.0.1:{port}")
        c = AgentDriver(agent)
        _send_in_background(engine + "/release_memory_occupation")
        agent.wait_state(lambda s: s["trainer"]["requested"], 10, "the framework's lease request")
        c.ok("drain")
        c.ok("release", tags=ALL_TAGS)
        c.ok("grant")
        _send_in_background(engine + "/resume_memory_occupation")  # nothing pushed: the lease goes back
        agent.wait_state(lambda s: s["stage"] == "Trained", 10, "the lease to come back without weights")
        return emu, agent, c, str(agent.state()["engine"]["servedVersion"])

    return start


def test_killed_after_a_reload_resumed_the_discarded_weights_still_loads_them(reload_pod: Any) -> None:
    """Killed between the resume of the weights the release discarded (garbage without a CPU backup) and
    their load: the restarted agent proves the resume from the memory it took, and its record says the
    committed checkpoint is still owed. It loads it: rollout never reopens on garbage weights."""
    emu, agent, c, served = reload_pod("--fault-slow", "/resume_memory_occupation=1.0")
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version=served, reload=True).status == 202
    wait_until(lambda: count(calls(emu), "/resume_memory_occupation") == 1, 10, "the weights' resume sent")
    restart(agent)
    st = recovered(agent)
    assert st["recovery"]["state"] == "Recovered" and "made" in st["recovery"]["detail"], st["recovery"]
    st = wait_command(agent, c.epoch)
    assert st["lastCommand"]["state"] == "Succeeded", st["lastCommand"]
    assert (st["stage"], st["engine"]["servedVersion"]) == ("Refitted", served)
    weights = emu.weights()
    assert weights["valid"] is True and weights["source"] == "disk", weights  # not the resumed garbage
    c.ok("resume")
    report = calls(emu)
    assert count(report, "/update_weights_from_disk") == 1 and report["repeats"] == [], report


def test_killed_during_a_reloads_load_gives_the_pod_up(reload_pod: Any) -> None:
    """Killed while the reload's disk load runs: /model_info reports the same version and checkpoint before
    and after it, so nothing can show it ran, and a second load may race the first. The restarted agent
    does not take it as made: StateUnknown, the pod is replaced, and the load went to SGLang once."""
    emu, agent, c, served = reload_pod("--fault-slow", "/update_weights_from_disk=1.0")
    c.epoch += 1
    assert agent.command("refit", c.epoch, wait=0, version=served, reload=True).status == 202
    wait_until(lambda: count(calls(emu), "/update_weights_from_disk") == 1, 10, "the reload's load sent")
    restart(agent)
    st = recovered(agent)
    assert st["recovery"]["state"] == "Unsure" and st["stage"] == "Failed", st
    assert st["fatal"].startswith(f"StateUnknown: update_weights_from_disk({served}) at epoch {c.epoch}"), st
    assert st["lastCommand"]["state"] == "Failed", st["lastCommand"]
    wait_until(lambda: emu.weights()["valid"], 10, "the first load to end")  # and nothing sent again
    report = calls(emu)
    assert count(report, "/update_weights_from_disk") == 1 and report["repeats"] == [], report
