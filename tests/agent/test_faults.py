"""Faults SGLang really has (docs/sglang-conformance.md), injected into the emulator: the agent must fail
safely, by its deadlines, without killing SGLang and without granting the GPU early."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_procs import ALL_TAGS, VERSIONS, Agent, AgentDriver, Emulator, wait_until, write_weights


@pytest.mark.parametrize("version", VERSIONS)
def test_release_returning_early_does_not_grant_before_memory_is_freed(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """slime#579 / miles#86: release answers while other ranks still hold memory."""
    emu = start_emulator(version, "--gpus", "2", "--fault-release-unmap-delay", "1.5")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    c.epoch += 1
    r = agent.command("release", c.epoch, wait=0, tags=ALL_TAGS)
    assert r.status == 202
    # SGLang has answered, the memory is still mapped: the agent must still be verifying
    wait_until(lambda: emu.stats()["offload_tags"] == sorted(ALL_TAGS), 5, "SGLang to answer the release")
    assert all(g["regions"]["kv_cache"] > 0 for g in emu.memory()), "fault did not delay the unmap"
    st = agent.state()
    assert st["stage"] == "Drained" and st["lastCommand"]["state"] == "Running"
    c.refused("grant", "Busy", _emulator_url=emu.url)
    st = agent.wait_state(lambda s: s["lastCommand"]["state"] != "Running", 10, "release to finish")
    assert st["lastCommand"]["state"] == "Succeeded", st["lastCommand"]
    assert st["lastCommand"]["seconds"] >= 1.4
    assert st["stage"] == "Released" and st["memory"]["verified"]
    assert all(g["regions"]["kv_cache"] == 0 and g["regions"]["weights"] == 0 for g in emu.memory())
    c.ok("grant")
    assert agent.trainer("GET", "/v1/trainer/lease").body["granted"] is True


def test_release_freeing_too_late_never_grants(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--fault-release-unmap-delay", "30")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    st = c.failed("release", tags=ALL_TAGS, verify={"timeoutSeconds": 1})
    assert "GPU 0 freed 0 of" in st["error"]
    st = agent.state()
    assert st["stage"] == "Drained" and not st["memory"]["verified"] and st["memory"]["freedBytes"] == 0
    c.refused("grant", "IllegalTransition", _emulator_url=emu.url)
    assert agent.trainer("GET", "/v1/trainer/lease").body["granted"] is False


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VERSIONS)
def test_resume_oom_fails_the_resume_and_agent_survives(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """C-MEM-RESUME-OOM: a resume that torch_memory_saver cannot map exits the scheduler process. With the
    watchdog (≥0.5.10) the server dies and the resume's connection drops; 0.5.6 stays up and the call never
    completes (sglang#14092), so the agent's deadline ends it. Either way the kv_cache mapping is unknown:
    the agent never resumes again."""
    emu = start_emulator(version, "--fault-resume-oom", "kv_cache")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.iteration_to_trained("1", str(write_weights(tmp_path, "1")))
    c.ok("refit", version="1")
    started = time.monotonic()
    st = c.failed("resume", timeoutSeconds=1.5)
    assert time.monotonic() - started < 10
    assert "resume_memory_occupation" in st["error"]
    if version == "0.5.6":
        assert time.monotonic() - started >= 1.4
        st = agent.state()
        assert st["stage"] == "Failed" and "unknown" in st["fatal"]
        assert emu.alive()  # a zombie scheduler: hung, not dead
    else:
        assert "unreachable" in st["error"]
        emu.wait_exit(10)
        agent.wait_state(lambda s: s["stage"] == "Failed", 15, "the agent to see SGLang gone")
    assert agent.alive() and agent.get("/healthz", token=None).status == 200
    c.refused("resume", "AgentFailed", _emulator_url=emu.url if emu.alive() else None)
    assert "cudaError error: 2 (out of memory)" in emu.log_text()


@pytest.mark.parametrize("version", VERSIONS)
def test_refit_success_false_fails_the_refit(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator(version, "--fault-refit-fail")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    path = str(write_weights(tmp_path, "1"))
    c.iteration_to_trained("1", path)
    st = c.failed("refit", version="1")
    assert "cache was not flushed" in st["error"]
    assert agent.state()["stage"] == "Trained" and agent.state()["engine"]["servedVersion"] == "default"
    emu.set_faults(refit_fail=False)
    c.ok("refit", version="1")
    c.ok("resume")
    assert agent.state()["engine"]["servedVersion"] == "1"


def test_slow_routes_count_as_sglang_time(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--fault-slow", "/flush_cache=0.4")
    c = AgentDriver(start_agent(emu))
    st = c.ok("drain")
    assert st["seconds"] >= 0.4 and st["engineSeconds"] >= 0.4
    assert st["seconds"] - st["engineSeconds"] < 0.2  # the agent's own share stays small


@pytest.mark.parametrize("route", ["/pause_generation", "/flush_cache"])
def test_hung_route_fails_the_drain_by_its_deadline(
    route: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    emu.set_faults(hang=[route])
    c = AgentDriver(agent)
    started = time.monotonic()
    st = c.failed("drain", timeoutSeconds=1)
    assert time.monotonic() - started < 5
    assert "within 1s" in st["error"]
    st = agent.state()
    assert st["stage"] == "Serving" and st["engine"]["paused"] is True  # maybe paused: never assume not
    emu.set_faults(hang=[])
    c.ok("drain")


@pytest.mark.emulator_may_die
def test_sglang_death_fails_the_agent(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    emu.popen.send_signal(signal.SIGKILL)
    st = agent.wait_stage("Failed", timeout=10)
    assert "stopped answering" in st["fatal"] and st["engine"]["reachable"] is False
    r = agent.command("drain", 2)
    assert r.status == 409 and r.body["error"] == "AgentFailed"
    assert agent.trainer("POST", "/v1/trainer/request", {}).status == 409
    assert agent.get("/healthz", token=None).body == {"ok": False, "stage": "Failed", "bootId": st["bootId"]}


@pytest.mark.emulator_may_die
def test_sglang_death_during_a_command(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--fault-slow", "/release_memory_occupation=3")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    assert agent.command("release", 3, wait=0, tags=ALL_TAGS).status == 202
    time.sleep(0.5)
    emu.popen.send_signal(signal.SIGKILL)
    st = agent.wait_state(lambda s: s["lastCommand"]["state"] != "Running", 10, "release to end")
    assert st["lastCommand"]["state"] == "Failed" and "unreachable" in st["lastCommand"]["error"]
    assert st["stage"] == "Failed" and st["fatal"]
