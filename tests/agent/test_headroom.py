"""The headroom gate (agent/headroom.py): the real agent never sends a resume whose GPU memory another
process holds; it waits, says who holds it, and resumes once it is free, or fails the command at its
deadline with SGLang alive and paused. The emulator models the memory of other processes and NVML's
per-process list (emulator/gpu_processes.py), and, as SGLang, dies on a resume that does not fit
(C-MEM-RESUME-OOM): without the gate each of these tests ends with a dead emulator.

The emulator's default GPU: 80 GiB, 2 GiB baseline, weights 16 GiB, KV cache 40 GiB, graphs 2 GiB (outside
the memory saver): 60 GiB used; a release of every tag frees 56 GiB. A trainer that keeps 30 GiB after its
lease leaves room for the refit's weights (16 GiB, SGLang's size of weights and graphs 18 GiB), not for
the KV cache after them (40 GiB, 30 GiB free)."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import (
    ALL_TAGS,
    PY,
    VERSIONS,
    Agent,
    AgentDriver,
    Emulator,
    Proc,
    http,
    wait_until,
    write_weights,
)

GiB = 1 << 30
KEPT = 30 * GiB  # what the trainer keeps after its lease: the KV cache's 40 GiB no longer fit
SGLANG = {"RLJOB_CONTAINER": "sglang"}  # what the operator puts in each container's environment
TRAINER_ARGS = ["--prompts", "2", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--weights-bytes",
                "8192", "--timeout", "60", "--iterations", "1", "--gpu-bytes", str(60 * GiB)]  # fmt: skip


def start_trainer(procs: list[Proc], tmp: Path, agent: Agent, emu: Emulator, keep: int) -> Proc:
    """The simulated trainer, in container `trainer`: it holds 60 GiB while it has the lease and `keep`
    bytes after publishing, until it gets SIGUSR1."""
    env = {
        "RLJOB_AGENT_URL": agent.trainer_url,
        "RLJOB_ENGINE_SERVER_URL": emu.url,
        "RLJOB_REFIT_SOURCE": "disk",
        "RLJOB_WEIGHTS_DIR": str(tmp / "weights"),
        "RLJOB_CONTAINER": "trainer",
    }
    argv = [PY, "-m", "rljob.testing.trainer", *TRAINER_ARGS, "--keep-gpu-bytes", str(keep)]
    p = Proc("trainer", argv, tmp / "trainer.log", env)
    procs.append(p)
    return p


def to_refitted(agent: Agent, trainer: Proc) -> AgentDriver:
    """The operator's part up to a refitted pod: the trainer asks, drain, release, grant, it publishes,
    refit (its weights fit beside what the trainer keeps)."""
    c = AgentDriver(agent)
    agent.wait_state(lambda s: s["trainer"]["requested"], 60, "the trainer to ask for the GPU")
    c.ok("drain")
    c.ok("release", tags=ALL_TAGS)
    c.ok("grant")
    st = agent.wait_stage("Trained", 60)
    assert trainer.alive(), trainer.log_text()[-2000:]
    c.ok("refit", version=st["trainer"]["publishedVersion"], path=st["trainer"]["publishedPath"])
    return c


def resume_waiting(agent: Agent, c: AgentDriver, **fields: Any) -> dict[str, Any]:
    """Send the resume; the state once it waits for memory."""
    c.epoch += 1
    r = agent.command("resume", c.epoch, wait=0, **fields)
    assert r.status == 202, r.text
    epoch = c.epoch
    return agent.wait_state(
        lambda s: (s.get("headroom") or {}).get("waiting") and s["headroom"]["epoch"] == epoch,
        20,
        "the resume to wait for GPU memory",
    )


def finished(agent: Agent, epoch: int, timeout: float = 30) -> dict[str, Any]:
    return agent.wait_state(
        lambda s: s["lastCommand"]["epoch"] == epoch and s["lastCommand"]["state"] != "Running",
        timeout,
        f"command {epoch} to finish",
    )


def not_a_pid() -> int:
    """A pid no process here has: another pod's process, as NVML in this pod would list it."""
    return next(p for p in range(400_000, 500_000) if not Path(f"/proc/{p}").exists())


def hold(emu: Emulator, pid: int, nbytes: int, **extra: Any) -> None:
    r = emu.call("POST", "/_emulator/processes", {"pid": pid, "bytes": nbytes, **extra})
    assert r.status == 200, r.text


@pytest.mark.parametrize("version", VERSIONS)
def test_resume_waits_for_a_trainer_that_keeps_memory(
    version: str,
    procs: list[Proc],
    tmp_path: Path,
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
) -> None:
    """The trainer keeps 30 GiB after its lease: the resume of kv_cache is not sent; the agent says who
    holds the memory, and resumes once the trainer frees it. Without the gate the emulator dies there."""
    emu = start_emulator(version, env=SGLANG)
    agent = start_agent(emu)
    trainer = start_trainer(procs, tmp_path, agent, emu, keep=KEPT)
    c = to_refitted(agent, trainer)
    st = resume_waiting(agent, c)
    h = st["headroom"]
    message = h["message"]
    print(f"\n{version} waits: {message}")
    assert f"GPU 0: pid {trainer.pid} (trainer) holds 30.0 GiB" in message, message
    assert f"pid {emu.pid} (sglang) holds 20.0 GiB" in message, message
    assert "the resume of kv_cache needs 40.0 GiB (+0.5 GiB margin), 30.0 GiB free" in message, message
    assert h["gpus"] == [{"gpu": 0, "needBytes": 40 * GiB, "freeBytes": 30 * GiB}]
    assert {(p["pid"], p.get("container")) for p in h["holders"]} == {
        (trainer.pid, "trainer"),
        (emu.pid, "sglang"),
    }
    assert emu.stats()["offload_tags"] == ["kv_cache"]  # the resume was not sent
    assert st["lastCommand"]["state"] == "Running" and st["stage"] == "Refitted"

    os.kill(trainer.pid, signal.SIGUSR1)  # its offload finished: the memory frees
    st = finished(agent, c.epoch)
    assert st["lastCommand"]["state"] == "Succeeded", st["lastCommand"]
    assert st["stage"] == "Serving" and st["engine"]["servedVersion"] == "1"
    assert not st["headroom"]["waiting"] and st["headroom"]["waitedSeconds"] > 0
    assert trainer.wait_exit(60) == 0, trainer.log_text()[-3000:]
    assert emu.stats()["offload_tags"] == []


def test_resume_fails_at_its_deadline_with_sglang_alive_and_paused(
    procs: list[Proc],
    tmp_path: Path,
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
) -> None:
    """The memory never frees within the resume's deadline: the command fails with who holds it; SGLang
    is alive, paused, kv_cache still released, and answers; the pod's agent is not Failed. Once the
    memory is free, a resume of the next epoch goes through and rollout answers."""
    emu = start_emulator("0.5.23", env=SGLANG)
    agent = start_agent(emu)
    trainer = start_trainer(procs, tmp_path, agent, emu, keep=KEPT)
    c = to_refitted(agent, trainer)
    st = c.failed("resume", timeoutSeconds=2)
    error = st["error"]
    print(f"\nfailed: {error}")
    assert f"pid {trainer.pid} (trainer) holds 30.0 GiB" in error, error
    assert "not resumed: not free within the command's deadline" in error, error
    assert emu.alive()
    stats = emu.stats()
    assert stats["paused"] and stats["offload_tags"] == ["kv_cache"], stats
    assert emu.call("GET", "/ping").status == 200
    assert emu.call("GET", "/model_info").body["weight_version"] == "1"
    st = agent.state()
    assert st["stage"] == "Refitted" and not st.get("fatal")
    assert not st["headroom"]["waiting"] and "trainer" in st["headroom"]["message"]

    os.kill(trainer.pid, signal.SIGUSR1)
    c.ok("resume")
    r = emu.call("POST", "/generate", {"text": "after the wait", "sampling_params": {"max_new_tokens": 2}})
    assert r.status == 200 and r.body["meta_info"]["weight_version"] == "1", r.text
    assert trainer.wait_exit(60) == 0, trainer.log_text()[-3000:]


def test_memory_of_another_pods_process_is_named_not_attributable(
    tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """A process of another pod (a pid no process of this pod has) holds 30 GiB: the resume waits and
    says so, and that the pid is not this pod's; no trainer is named. It resumes once that memory frees."""
    emu = start_emulator("0.5.23", env=SGLANG)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    path = str(write_weights(tmp_path, "1"))
    c.iteration_to_trained("1", path)
    other = not_a_pid()
    hold(emu, other, KEPT, foreign=True)
    c.ok("refit", version="1", path=path)
    st = resume_waiting(agent, c)
    message = st["headroom"]["message"]
    print(f"\nwaits: {message}")
    assert f"pid {other} (not attributable: no process of this pid in the agent's PID namespace" in message
    assert "holds 30.0 GiB" in message and st["headroom"].get("trainerHeld") is None
    hold(emu, other, 0, foreign=True)
    st = finished(agent, c.epoch)
    assert st["lastCommand"]["state"] == "Succeeded" and st["stage"] == "Serving", st["lastCommand"]


def test_a_trainer_that_keeps_memory_is_named_when_the_resume_did_not_wait(
    procs: list[Proc],
    tmp_path: Path,
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
) -> None:
    """The trainer keeps 2 GiB after its lease: everything still fits, the resume does not wait, and the
    agent names the trainer and what it holds."""
    emu = start_emulator("0.5.23", env=SGLANG)
    agent = start_agent(emu)
    trainer = start_trainer(procs, tmp_path, agent, emu, keep=2 * GiB)
    c = to_refitted(agent, trainer)
    c.ok("resume")
    h = agent.state()["headroom"]
    print(f"\nnamed: {h['trainerHeld']}")
    assert not h["waiting"] and h["waitedSeconds"] == 0 and h.get("message") is None
    assert h["trainerHeld"] == f"pid {trainer.pid} (trainer) holds 2.0 GiB on GPU 0 after returning its lease"
    assert trainer.wait_exit(60) == 0, trainer.log_text()[-3000:]  # Serving: it ends, and its memory with it


def test_a_restarted_agent_gates_the_resume_it_runs_again(
    tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """The agent is killed while its resume waits for memory: the restarted agent runs the recorded
    command again and waits too (it knows what the release freed from its record); SGLang gets no resume
    until the memory is free."""
    emu = start_emulator("0.5.23", env=SGLANG)
    agent = start_agent(emu, "--state-dir", str(tmp_path / "state"))
    c = AgentDriver(agent)
    path = str(write_weights(tmp_path, "1"))
    c.iteration_to_trained("1", path)
    other = not_a_pid()
    hold(emu, other, KEPT, foreign=True)
    c.ok("refit", version="1", path=path)
    first = resume_waiting(agent, c)
    argv = list(agent.popen.args)
    agent.popen.kill()
    agent.popen.wait(5)
    agent.popen = subprocess.Popen(argv, stdout=agent._logf, stderr=subprocess.STDOUT)
    wait_until(lambda: http("GET", agent.url + "/healthz", timeout=2).status == 200, 15, "agent restarted")
    st = agent.wait_state(
        lambda s: s["bootId"] != first["bootId"] and (s.get("headroom") or {}).get("waiting"),
        20,
        "the restarted agent's resume to wait",
    )
    assert st["recovery"]["state"] == "Recovered" and st["lastCommand"]["state"] == "Running"
    assert st["headroom"]["message"] == first["headroom"]["message"]
    assert emu.stats()["offload_tags"] == ["kv_cache"]
    hold(emu, other, 0, foreign=True)
    st = finished(agent, c.epoch)
    assert st["lastCommand"]["state"] == "Succeeded" and st["stage"] == "Serving", st["lastCommand"]


# --- what the emulator answers as SGLang and NVML do ------------------------------------------------------


@pytest.mark.emulator_may_die
@pytest.mark.parametrize("version", VERSIONS)
def test_c_mem_resume_oom_beside_another_process(
    version: str, start_emulator: Callable[..., Emulator]
) -> None:
    """C-MEM-RESUME-OOM: a resume whose region does not fit beside another process's memory exits the
    scheduler (torch_memory_saver's cuMemCreate fails): the server dies where a watchdog sees it (from
    0.5.10), and on 0.5.6 the call never answers. What the gate keeps the agent from sending."""
    emu = start_emulator(version, wait_ready=True)
    assert emu.call("POST", "/pause_generation", {"mode": "abort"}).status == 200
    assert emu.call("POST", "/flush_cache", {}).status == 200
    assert emu.call("POST", "/release_memory_occupation", {"tags": ALL_TAGS}).status == 200
    hold(emu, not_a_pid(), KEPT, foreign=True)
    assert emu.call("POST", "/resume_memory_occupation", {"tags": ["weights"]}).status == 200  # 16 GiB fit
    try:
        r = emu.call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}, timeout=2)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        r = None
    assert r is None, f"the resume answered {r.status}: {r.text}"
    if version == "0.5.6":
        assert emu.alive()  # a zombie: the scheduler is gone, HTTP stays up (C-DEATH-HARD)
    else:
        assert emu.wait_exit(10) != 0
    assert "cudaError error: 2 (out of memory)" in emu.log_text()


def test_nvml_process_list(start_emulator: Callable[..., Emulator]) -> None:
    """The per-process list NVML gives per GPU: SGLang's own process with what it maps, every other
    process with its bytes, None where NVML cannot tell; an allocation that does not fit is refused (the
    process's own CUDA OOM) and holds nothing; a process that exited holds nothing."""
    emu = start_emulator("0.5.23", "--gpus", "2", wait_ready=True)
    other = not_a_pid()
    hold(emu, other, [GiB, 0], foreign=True)
    hold(emu, other + 1, 3 * GiB, foreign=True, unknownBytes=True)
    gpus = emu.call("GET", "/_emulator/processes").body["gpus"]
    assert gpus[0] == {
        "gpu": 0,
        "processes": [
            {"pid": emu.pid, "usedGpuMemory": 60 * GiB},
            {"pid": other, "usedGpuMemory": GiB},
            {"pid": other + 1, "usedGpuMemory": None},
        ],
    }
    assert [p["pid"] for p in gpus[1]["processes"]] == [emu.pid, other + 1]
    assert [g["used_bytes"] for g in emu.memory()] == [64 * GiB, 63 * GiB]
    r = emu.call("POST", "/_emulator/processes", {"pid": other, "bytes": 40 * GiB, "foreign": True})
    assert r.status == 409 and "CUDA out of memory" in r.text, r.text
    exited = subprocess.run([PY, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    hold(emu, int(exited.stdout), GiB)  # a local pid that is gone: its context died with it
    assert [g["used_bytes"] for g in emu.memory()] == [64 * GiB, 63 * GiB]


@pytest.mark.parametrize("version", VERSIONS)
def test_c_mem_usage_report(version: str, start_emulator: Callable[..., Emulator]) -> None:
    """C-MEM-USAGE-REPORT: /server_info's internal_states carry each rank's memory_usage in GB of 2^30
    bytes: one `graph` number up to 0.5.15.post1, per capture phase from 0.5.20."""
    emu = start_emulator(version, wait_ready=True)
    (state,) = emu.call("GET", "/server_info").body["internal_states"]
    usage = state["memory_usage"]
    assert (usage["weight"], usage["kvcache"]) == (16.0, 40.0)
    if version in ("0.5.6", "0.5.15.post1"):
        assert usage["graph"] == 2.0 and "startup_available" not in usage
    else:
        assert usage["graph"]["decode"] == 2.0 and sum(usage["graph"].values()) == 2.0
        assert usage["startup_available"] == 78.0 and usage["token_capacity_swa"] is None
