"""The headroom gate against real SGLang 0.5.15.post1 on the GPU: a real torch trainer
(headroom_trainer.py) keeps 20 GiB after its lease, where SGLang's KV cache has to come back.

SGLang is launched with the tier's flags (real_sglang.py) but `--mem-fraction-static` such that about
HEADROOM_GIB GiB of the card stay free before the release: the 20 GiB the trainer keeps then do not fit
beside SGLang's resumed memory, on an 80 GB H100 as on a 141 GB H200. Without the gate SGLang dies at the
agent's resume of kv_cache (C-MEM-RESUME-OOM, seen on an H100: tests/gpu/RESULTS.md).

test_resume_waits_until_the_trainer_frees: the real agent (`--gpu-probe nvml`) does not send the resume;
its state names the trainer's pid and what it holds (NVML's per-process list, attributed by the trainer's
RLJOB_CONTAINER); once the trainer frees the memory the resume goes through and SGLang serves the new
weights. test_resume_fails_at_its_deadline_sglang_answers: the trainer keeps its memory past the resume's
deadline: the command fails with that reason, SGLang is alive and paused; once the memory is free a resume
of the next epoch goes through and /generate answers.

The model: RLJOB_GPU_MODEL (rljob.testing.gpu_models; tiny by default). Printed: the wait message, the bytes
NVML and SGLang report, the seconds waited. Figures: $RLJOB_GPU_RESULTS_DIR/real_sglang_headroom.json."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, PY, Agent, AgentDriver, Proc
from gpu_helpers import GiB, nvml_total, nvml_used, while_alive
from real_sglang import LAUNCH_FLAGS, RealSGLang, sglang_missing

from rljob.testing.gpu_models import MODEL_ENV, MODEL_VARS, load_model, spec_from_env

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
KEEP_GIB = 20  # what the trainer keeps after its lease
HEADROOM_GIB = 12  # free on the card before the release: less than the trainer keeps
RESUME_DEADLINE_S = 15  # the failing test's resume deadline (a command's HTTP wait answers within 30 s)
HOLD_S = 3.0  # how long the first test's trainer keeps its memory once the resume waits


def launch_flags(total: int) -> list[str]:
    """The tier's flags, with the static fraction that leaves about HEADROOM_GIB free (weights, KV pool;
    graphs and the context take a little more)."""
    fraction = round(1 - HEADROOM_GIB * GiB / total, 3)
    flags = list(LAUNCH_FLAGS)
    at = flags.index("--mem-fraction-static")
    flags[at + 1] = str(fraction)
    return flags


class Served:
    """The module's real SGLang; launched again when the last test failed or the server is gone."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.model = load_model(spec_from_env())
        self.launch = self.model.write(tmp / "v0", seed=0)
        self.server: RealSGLang | None = None
        self.dirty = True

    def ready(self) -> RealSGLang:
        if self.dirty or self.server is None or not self.server.alive():
            if self.server is not None:
                self.server.stop()
            flags = launch_flags(nvml_total())
            self.server = RealSGLang(self.tmp, self.launch, *flags, env={"RLJOB_CONTAINER": "sglang"})
            self.server.wait_ready()
            self.dirty = False
        return self.server


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    reason = sglang_missing()
    if reason:
        pytest.skip(f"real-SGLang tier: {reason}")
    holder = Served(tmp_path_factory.mktemp("headroom"))
    try:
        yield holder
    finally:
        if holder.server is not None:
            holder.server.stop()


@pytest.fixture
def pod(served: Served, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[RealSGLang, Agent]]:
    """SGLang with a fresh agent (rollout open), stopped with the test's processes."""
    server = served.ready()
    agent = Agent(tmp_path, server.url, probe="nvml")
    try:
        agent.wait_stage("Ready", timeout=120)
        AgentDriver(agent).done("resume", 60)
        yield server, agent
    finally:
        agent.stop()
        report = getattr(request.node, "rep_call", None)
        served.dirty = report is None or not report.passed


def start_trainer(tmp: Path, agent: Agent, version: str) -> Proc:
    env = {"RLJOB_AGENT_URL": agent.trainer_url, "RLJOB_CONTAINER": "trainer"}
    env.update({n: os.environ[n] for n in (MODEL_ENV, *MODEL_VARS) if n in os.environ})
    argv = [PY, str(HERE / "headroom_trainer.py"), "--keep-gib", str(KEEP_GIB), "--weights-dir",
            str(tmp / "ckpt"), "--version", version, "--seed", str(10 + int(version))]  # fmt: skip
    return Proc("headroom-trainer", argv, tmp / f"headroom-trainer-{version}.log", env)


def events(trainer: Proc) -> list[dict[str, Any]]:
    return [json.loads(line) for line in trainer.log_text().splitlines() if line.startswith('{"event"')]


def to_refitted(server: RealSGLang, agent: Agent, trainer: Proc, seen: dict[str, Any]) -> AgentDriver:
    """The trainer asks; drain, release (NVML verifies), grant; it keeps 20 GiB and publishes; refit from
    disk: SGLang's weights and graphs fit beside what it keeps, the KV cache does not."""
    c = AgentDriver(agent)
    agent.wait_state(while_alive(trainer, lambda s: s["trainer"]["requested"]), 300, "the trainer to ask")
    seen["used_before_release"] = nvml_used()
    c.done("drain", 60)
    c.done("release", 120, tags=ALL_TAGS)
    seen["freed"] = agent.state()["memory"]["freedBytes"]
    c.done("grant", 30)
    st = agent.wait_state(while_alive(trainer, lambda s: s["stage"] == "Trained"), 300, "the publish")
    seen["trainer"] = events(trainer)
    seen["refit"] = c.done(
        "refit", 300, version=st["trainer"]["publishedVersion"], path=st["trainer"]["publishedPath"]
    )
    seen["memory_usage"] = server.call("GET", "/server_info").body["internal_states"][0]["memory_usage"]
    return c


def generate(server: RealSGLang) -> dict[str, Any]:
    body = {"text": "the resume after the wait", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    r = server.call("POST", "/generate", body)
    assert r.status == 200, r.text
    return dict(r.body)


def record(results_dir: Path, name: str, seen: dict[str, Any]) -> None:
    path = results_dir / "real_sglang_headroom.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[name] = seen
    path.write_text(json.dumps(data, indent=1, default=str))


def test_resume_waits_until_the_trainer_frees(
    pod: tuple[RealSGLang, Agent], tmp_path: Path, results_dir: Path
) -> None:
    server, agent = pod
    trainer = start_trainer(tmp_path, agent, "1")
    seen: dict[str, Any] = {"total": nvml_total()}
    try:
        c = to_refitted(server, agent, trainer, seen)
        c.epoch += 1
        epoch = c.epoch
        t0 = time.monotonic()
        r = agent.command("resume", epoch, wait=0)
        assert r.status == 202, r.text
        st = agent.wait_state(
            lambda s: (s.get("headroom") or {}).get("waiting") and s["headroom"]["epoch"] == epoch,
            60,
            "the resume to wait for the trainer's memory",
        )
        h = seen["headroom_waiting"] = st["headroom"]
        print(f"\nwaiting: {h['message']}")
        assert f"pid {trainer.pid} (trainer) holds" in h["message"], h
        assert server.alive() and st["lastCommand"]["state"] == "Running"
        time.sleep(HOLD_S)  # SGLang stays paused, alive, its resume not sent
        assert server.alive() and agent.state()["lastCommand"]["state"] == "Running"
        os.kill(trainer.pid, signal.SIGUSR1)
        st = agent.wait_state(
            lambda s: s["lastCommand"]["epoch"] == epoch and s["lastCommand"]["state"] != "Running",
            120,
            "the resume to finish",
        )
        assert st["lastCommand"]["state"] == "Succeeded", st["lastCommand"]
        seen["resume"] = st["lastCommand"]
        seen["headroom_after"] = st["headroom"]
        seen["generate"] = generate(server)["meta_info"]
        assert seen["generate"]["weight_version"] == "1"
        seen["seconds_to_serving"] = time.monotonic() - t0
        print(
            f"resumed after {st['headroom']['waitedSeconds']:.1f} s of waiting; freed at release "
            f"{seen['freed'] / GiB:.2f} GiB, SGLang reports {seen['memory_usage']}, "
            f"trainer: {seen['trainer']}"
        )
    finally:
        record(results_dir, "waits_until_freed", seen)
        trainer.stop()


def test_resume_fails_at_its_deadline_sglang_answers(
    pod: tuple[RealSGLang, Agent], tmp_path: Path, results_dir: Path
) -> None:
    server, agent = pod
    version = str(int(agent.state()["engine"]["servedVersion"] or "1") + 1)
    trainer = start_trainer(tmp_path, agent, version)
    seen: dict[str, Any] = {"total": nvml_total()}
    try:
        c = to_refitted(server, agent, trainer, seen)
        t0 = time.monotonic()
        st = c.failed("resume", timeoutSeconds=RESUME_DEADLINE_S, wait=RESUME_DEADLINE_S + 10)
        seen["failed_after_s"] = time.monotonic() - t0
        seen["error"] = st["error"]
        print(f"\nfailed after {seen['failed_after_s']:.1f} s: {st['error']}")
        assert f"pid {trainer.pid} (trainer) holds" in st["error"], st
        assert "not resumed: not free within the command's deadline" in st["error"], st
        assert server.alive(), server.log_text()[-4000:]
        assert server.call("GET", "/ping").status == 200
        assert server.call("GET", "/model_info").body["weight_version"] == version
        state = agent.state()
        assert state["stage"] == "Refitted" and not state.get("fatal"), state
        os.kill(trainer.pid, signal.SIGUSR1)
        seen["resume"] = c.done("resume", 120)
        seen["generate"] = generate(server)["meta_info"]
        assert seen["generate"]["weight_version"] == version
        print(f"then resumed once freed; /generate answers at weight_version {version}")
    finally:
        record(results_dir, "fails_at_deadline", seen)
        trainer.stop()
