"""Every refusal: 409 with a reason, and the emulator's lifecycle-call counter proves nothing reached
SGLang. Epoch rules, auth and malformed bodies too."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_procs import ALL_TAGS, Agent, AgentDriver, Emulator, Pod, http, write_weights


def test_illegal_transitions_are_refused_and_not_forwarded(pod: Pod, tmp_path: Path) -> None:
    c, url = pod.conductor, pod.emu.url
    # Serving
    c.refused("release", "IllegalTransition", tags=ALL_TAGS, _emulator_url=url)
    c.refused("grant", "IllegalTransition", _emulator_url=url)
    c.refused("resume", "IllegalTransition", _emulator_url=url)
    c.refused("refit", "NoPath", version="1", _emulator_url=url)  # rejoin needs a path
    c.ok("drain")
    c.refused("grant", "IllegalTransition", _emulator_url=url)
    c.refused("release", "DuplicateTag", tags=["kv_cache", "kv_cache"], _emulator_url=url)
    c.ok("release", tags=ALL_TAGS)
    # Released: a second release (any tag) must never reach SGLang
    c.refused("release", "IllegalTransition", tags=["kv_cache"], _emulator_url=url)
    c.refused("drain", "IllegalTransition", _emulator_url=url)
    c.refused("refit", "IllegalTransition", version="1", path="/x", _emulator_url=url)
    c.refused("resume", "IllegalTransition", _emulator_url=url)
    c.ok("grant")
    c.refused("grant", "IllegalTransition", _emulator_url=url)
    c.refused("refit", "IllegalTransition", version="1", path="/x", _emulator_url=url)
    # trainer side: a second request while holding the lease; publish twice
    assert pod.agent.trainer("POST", "/v1/trainer/request", {}).status == 409
    c.publish("1", str(write_weights(tmp_path, "1")))
    r = pod.agent.trainer("POST", "/v1/trainer/publish", {"version": "2"})
    assert r.status == 409 and r.body["error"] == "NoLease"
    c.refused("resume", "IllegalTransition", _emulator_url=url)
    c.ok("refit", version="1")
    c.refused("refit", "IllegalTransition", version="1", path="/x", _emulator_url=url)
    c.ok("resume")


def test_double_release_after_failed_verification_is_refused(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    # Verification asks for more than the GPU holds: SGLang released, the agent refuses to grant. The
    # freed amount stopped moving, so the failure is permanent (ReleaseShortfall), not retryable.
    failed = c.failed("release", tags=["kv_cache"], verify={"minFreedBytes": 2**49, "timeoutSeconds": 1})
    assert "cannot free what verify asks" in failed["error"]
    assert failed["permanent"] is True and failed["failureReason"] == "ReleaseShortfall"
    st = agent.state()
    assert st["stage"] == "Drained" and st["releasedTags"] == ["kv_cache"] and not st["memory"]["verified"]
    c.refused("grant", "IllegalTransition", _emulator_url=emu.url)
    c.refused("release", "AlreadyReleased", tags=["kv_cache", "weights"], _emulator_url=emu.url)
    # kv_cache released, weights intact: resuming from Drained is legal and resumes only what was released
    c.ok("resume")
    assert agent.state()["stage"] == "Serving" and emu.stats()["offload_tags"] == []


def test_resume_refuses_garbage_weights(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    c.failed("release", tags=["weights"], verify={"minFreedBytes": 2**49, "timeoutSeconds": 1})
    c.refused("resume", "WeightsNotRefitted", _emulator_url=emu.url)


def test_resume_from_drained_with_cpu_backup(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--enable-weights-cpu-backup")
    agent = start_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    c.failed("release", tags=["weights"], verify={"minFreedBytes": 2**49, "timeoutSeconds": 1})
    c.ok("resume")  # weights survive with CPU backup
    r = emu.call("POST", "/generate", {"text": "x y", "sampling_params": {"max_new_tokens": 2}})
    assert "GARBAGE" not in r.body["text"]


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_weight_cache_refusals(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator(version, "--weight-cache-mode", "daemon")
    agent = start_agent(emu)
    refusal = agent.state()["engine"]["launchRefusal"]  # the weight cache mode, as the launch refusal it is
    assert refusal["reason"] == "WeightCacheActive" and "--weight-cache-mode daemon" in refusal["message"]
    c = AgentDriver(agent)
    c.ok("drain")
    r = c.refused("release", "WeightCacheActive", tags=ALL_TAGS, _emulator_url=emu.url)
    assert "weight-cache-mode" in r["reason"]
    c.refused("refit", "WeightCacheActive", version="1", path="/x", _emulator_url=emu.url)
    c.ok("release", tags=["kv_cache"], verify={"minFreedFraction": 0.1})  # KV is fine under a weight cache


def test_memory_saver_disabled_refused(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", memory_saver=False)
    c = AgentDriver(start_agent(emu))
    c.ok("drain")
    c.refused("release", "MemorySaverDisabled", tags=ALL_TAGS, _emulator_url=emu.url)


def test_epoch_rules(start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]) -> None:
    emu = start_emulator("0.5.23", "--fault-slow", "/pause_generation=1.5")
    agent = start_agent(emu)
    r = agent.command("drain", 5, wait=0)
    assert r.status == 202 and r.body["state"] == "Running" and r.body["epoch"] == 5
    # same epoch + action while running: the recorded status, not a second pause
    r = agent.command("drain", 5, wait=0)
    assert r.status == 200 and r.body["state"] == "Running"
    r = agent.command("release", 5, wait=0, tags=ALL_TAGS)
    assert r.status == 409 and r.body["error"] == "EpochConflict"
    r = agent.command("drain", 6, wait=0)
    assert r.status == 409 and r.body["error"] == "Busy"
    r = agent.command("drain", 5, wait=10)
    assert r.status == 200 and r.body["state"] == "Succeeded" and r.body["seconds"] >= 1.5
    assert 1.5 <= r.body["engineSeconds"] <= r.body["seconds"]
    assert emu.stats()["calls"]["/pause_generation"] == 1
    r = agent.command("drain", 4)
    assert r.status == 409 and r.body["error"] == "StaleEpoch"
    st = agent.state()
    assert st["epoch"] == 5 and st["lastCommand"]["state"] == "Succeeded"


def test_auth_and_open_paths(pod: Pod) -> None:
    a = pod.agent
    calls = pod.emu.lifecycle_calls()
    for token in (None, "wrong"):
        r = a.get("/v1/state", token=token)
        assert r.status == 401 and r.body["error"] == "Unauthorized"
        r = http("POST", a.url + "/v1/commands", {"action": "drain", "epoch": 1}, token=token)
        assert r.status == 401
    assert pod.emu.lifecycle_calls() == calls
    for path in ("/healthz", "/metrics", "/openapi.json"):
        assert a.get(path, token=None).status == 200
    assert a.get("/healthz", token=None).body["stage"] == "Serving"


@pytest.mark.parametrize(
    ("raw", "status", "error", "field"),
    [
        (b"{not json", 400, "InvalidJSON", None),
        (b"", 400, "MissingBody", None),
        (b'{"action": "explode", "epoch": 1}', 422, "InvalidBody", "body"),
        (b'{"action": "drain"}', 422, "InvalidBody", "epoch"),
        (b'{"action": "drain", "epoch": 0}', 422, "InvalidBody", "epoch"),
        (b'{"action": "drain", "epoch": 1, "mode": "in_place"}', 422, "InvalidBody", "mode"),
        (b'{"action": "release", "epoch": 1, "tags": []}', 422, "InvalidBody", "tags"),
        (b'{"action": "release", "epoch": 1, "tags": ["vram"]}', 422, "InvalidBody", "tags"),
        (b'{"action": "refit", "epoch": 1, "version": "../x"}', 422, "InvalidBody", "version"),
        (b'{"action": "grant", "epoch": 1, "surprise": true}', 422, "InvalidBody", "surprise"),
    ],
)
def test_malformed_commands(
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
    raw: bytes,
    status: int,
    error: str,
    field: str | None,
) -> None:
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    calls = emu.lifecycle_calls()
    r = http("POST", agent.url + "/v1/commands", raw=raw, token=agent.token)
    assert r.status == status, r.text
    assert r.body["error"] == error
    if field:
        assert field in r.body["reason"], r.body
    assert emu.lifecycle_calls() == calls and agent.state()["epoch"] == 1  # only the opening resume


def test_commands_refused_until_sglang_answers(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--startup-seconds", "2")
    agent = start_agent(emu, serving=False)
    assert agent.state()["stage"] == "Starting"
    r = agent.command("drain", 1)
    assert r.status == 409 and r.body["error"] == "NotReady"
    agent.wait_stage("Ready", timeout=15)
    AgentDriver(agent).ok("drain")  # a fresh server may be drained before rollout opened (suspend)


def test_trainer_calls_outside_their_window(pod: Pod) -> None:
    a = pod.agent
    calls = pod.emu.lifecycle_calls()
    r = a.trainer("POST", "/v1/trainer/refit/tensor", {"serializedNamedTensors": ["AA=="]})
    assert r.status == 409 and r.body["error"] == "NoRefitWindow"
    r = a.trainer("POST", "/v1/trainer/refit/close", {})
    assert r.status == 409
    r = a.trainer("POST", "/v1/trainer/publish", {"version": "1"})
    assert r.status == 409 and r.body["error"] == "NoLease"
    r = a.trainer("POST", "/v1/trainer/abandon", {"reason": "x"})
    assert r.status == 409
    r = a.trainer("GET", "/v1/trainer/lease?wait=0.2")
    assert r.status == 200 and r.body == {"granted": False}
    assert pod.emu.lifecycle_calls() == calls


def test_sglang_api_keys(
    tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--api-key", "user-key", "--admin-api-key", "admin-key")
    (tmp_path / "api").write_text("user-key")
    (tmp_path / "admin").write_text("admin-key")
    both = start_agent(
        emu,
        "--engine-api-key-file",
        str(tmp_path / "api"),
        "--engine-admin-api-key-file",
        str(tmp_path / "admin"),
    )
    AgentDriver(both).full_iteration("1", str(write_weights(tmp_path, "1")))
    # only the api key: SGLang refuses lifecycle calls (401), the agent reports it, SGLang lives
    user_only = start_agent(emu, "--engine-api-key-file", str(tmp_path / "api"), serving=False)
    user_only.wait_stage("Ready")
    failed = AgentDriver(user_only).failed("drain")
    assert "HTTP 401" in failed["error"]
    # no key at all: SGLang cannot even be identified
    none = start_agent(emu, serving=False)
    time.sleep(1)
    assert none.state()["stage"] == "Starting"
    assert "cannot be identified" in none.log_text()
