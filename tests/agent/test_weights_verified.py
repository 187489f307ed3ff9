"""Verified weights (docs/agent.md, "Verified weights"): after every refit the agent takes SGLang's
/weights_checker checksum (C-CHECKER-CHECKSUM) and holds it against the trainer's digest, the weights before
the load and the committed checksum. Each way wrong weights come to be served under the right version is
injected into the emulator (or the test world) and must fail the refit, naming what is wrong, with rollout
left closed; the same run without the fault verifies."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import VERSIONS, Agent, AgentDriver, Emulator, write_weights

from rljob.testing.trainer import SIM_LAYOUT, make_tensors, rewrite_checkpoint, tensor_payload
from rljob.trainer import Handoff
from rljob.trainer.engines.sglang import packing
from rljob.trainer.engines.sglang.digest import checkpoint_digest, digest_named_tensors

CHECKSUM_VERSIONS = [v for v in VERSIONS if v != "0.5.6"]  # C-CHECKER-CHECKSUM: from 0.5.15.post1


def publish(c: AgentDriver, version: str, path: Path, digest: bool = True) -> None:
    body: dict[str, Any] = {"version": version, "path": str(path)}
    if digest:
        body["digest"] = checkpoint_digest(path).wire()
    r = c.agent.trainer("POST", "/v1/trainer/publish", body)
    assert r.status == 200, r.text


def to_trained(c: AgentDriver, version: str, path: Path | None, digest: bool = True) -> None:
    c.ok("drain")
    c.ok("release", tags=["kv_cache", "weights", "cuda_graph"])
    c.ok("grant")
    if path is None:
        r = c.agent.trainer("POST", "/v1/trainer/publish", {"version": version})
        assert r.status == 200, r.text
    else:
        publish(c, version, path, digest)


def weights(agent: Agent) -> dict[str, Any]:
    return dict(agent.state()["engine"]["weights"])


def push(agent: Agent, c: AgentDriver, version: str, shared: Path | None) -> dict[str, Any]:
    """A tensor refit of the simulated trainer's tensors for `version` (one bucket each); with `shared`,
    their bytes are shared with the emulator and the window's close carries their digest."""
    c.epoch += 1
    r = agent.command("refit", c.epoch, wait=0, version=version, source="tensor")
    assert r.status == 202, r.text
    tensors = make_tensors(version, 16 << 10)
    with Handoff(agent.trainer_url).refit_window(timeout=15) as w:
        for name in sorted(tensors):
            w.push_tensors(
                [packing.to_wire(tensor_payload(name, tensors[name], shared))], packing.LOAD_FORMAT
            )
        if shared is not None:
            w.add_digest(digest_named_tensors(sorted(tensors.items()), SIM_LAYOUT))
    st = agent.wait_state(lambda s: s["lastCommand"]["state"] != "Running", 15, "refit to finish")
    return dict(st["lastCommand"])


@pytest.mark.parametrize("version", VERSIONS)
def test_a_disk_refit_is_verified_against_the_trainers_digest(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator(version)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    launch = weights(agent)
    for v in ("1", "2"):
        to_trained(c, v, write_weights(tmp_path, v))
        st = c.ok("refit", version=v)
        w = weights(agent)
        assert st["state"] == "Succeeded"
        if version == "0.5.6":  # no checksum action: said, never passed silently
            assert launch["unverified"].startswith(
                "weights not verified: SGLang 0.5.6 has no /weights_checker"
            )
            assert w == {"version": v, "parameters": 0, "checked": [], "unverified": launch["unverified"],
                         "checkerSeconds": 0.0, "seconds": w["seconds"]}  # fmt: skip
        else:
            assert w["version"] == v and w["checked"] == ["Trainer", "Previous"], w
            assert w["checksum"] != launch["checksum"] and w["parameters"] == 4 and w["layout"] == "tp1 pp1"
            assert w.get("unverified") is None
            assert w["checkerSeconds"] > 0 and w["seconds"] >= w["checkerSeconds"]
        c.ok("resume")
        assert agent.state()["stage"] == "Serving"


@pytest.mark.parametrize("version", CHECKSUM_VERSIONS)
def test_a_push_answered_success_that_moved_nothing_fails_the_refit(
    version: str, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """tokenspeed#1373: the transport says success and SGLang holds what it held before the load. No digest
    here (pushes serialized by hand): the look right before the load catches it."""
    emu = start_emulator(version)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    to_trained(c, "1", None)
    assert push(agent, c, "1", None)["state"] == "Succeeded"
    assert weights(agent)["checked"] == ["Previous"]
    assert "not compared with the trainer's digest" in weights(agent)["unverified"]
    c.ok("resume")
    emu.set_faults(refit_noop=True)
    to_trained(c, "2", None)
    out = push(agent, c, "2", None)
    assert out["state"] == "Failed" and out["failureReason"] == "WeightsMismatch", out
    assert "the load answered success and moved nothing" in out["error"]
    st = agent.state()
    assert st["stage"] == "Trained" and st["engine"]["servedVersion"] == "1"  # rollout stays closed
    c.refused("resume", "IllegalTransition", _emulator_url=emu.url)


@pytest.mark.parametrize("version", CHECKSUM_VERSIONS)
def test_a_tensor_stored_under_another_name_fails_the_refit(
    version: str,
    tmp_path: Path,
    start_emulator: Callable[..., Emulator],
    start_agent: Callable[..., Agent],
) -> None:
    """The pushed bytes are shared with the emulator (the accounting backend reads them as SGLang reads
    the memory behind an IPC handle) and the window's close carries their digest."""
    shared = tmp_path / "ipc"
    emu = start_emulator(version, "--ipc-stand-in-dir", str(shared))
    agent = start_agent(emu)
    c = AgentDriver(agent)
    to_trained(c, "1", None)
    assert push(agent, c, "1", shared)["state"] == "Succeeded"
    assert weights(agent)["checked"] == ["Trainer", "Previous"]
    c.ok("resume")
    emu.set_faults(refit_store_as={"model.layers.0.mlp.weight": "model.layers.1.mlp.weight"})
    to_trained(c, "2", None)
    out = push(agent, c, "2", shared)
    assert out["state"] == "Failed" and out["failureReason"] == "WeightsMismatch", out
    # layer 0's tensor went to layer 1 (which layer 1's own push then overwrote): layer 0 holds what the
    # release left
    assert "SGLang's model.layers.0.mlp.weight is not what the trainer published" in out["error"]
    assert agent.state()["stage"] == "Trained"


@pytest.mark.parametrize("version", CHECKSUM_VERSIONS)
def test_a_checkpoint_changed_after_publish_fails_the_refit(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator(version)
    agent = start_agent(emu)
    c = AgentDriver(agent)
    path = write_weights(tmp_path, "1")
    to_trained(c, "1", path)
    rewrite_checkpoint(path, "model.layers.2.mlp.weight")  # a later save over the published file
    out = c.failed("refit", version="1")
    assert out["failureReason"] == "WeightsMismatch", out
    assert "SGLang's model.layers.2.mlp.weight is not what the trainer published" in out["error"]
    assert agent.state()["stage"] == "Trained"
    c.refused("resume", "IllegalTransition", _emulator_url=emu.url)


@pytest.mark.parametrize("version", CHECKSUM_VERSIONS)
def test_a_rejoined_pod_holding_its_launch_weights_fails_the_refit(
    version: str, tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """miles#1806: a recovered engine reports the committed version and serves its launch weights. A rejoin
    carries the checksum the job committed (another pod's, here); the faulty pod's refit fails on it."""
    path = write_weights(tmp_path, "1")
    good = start_agent(start_emulator(version), serving=False)
    good.wait_stage("Ready")
    assert AgentDriver(good).ok("refit", version="1", path=str(path))["state"] == "Succeeded"
    committed = weights(good)
    assert committed["checked"] == []  # a rejoin without a committed checksum: nothing to hold it to
    emu = start_emulator(version, "--fault-refit-loads-launch")
    agent = start_agent(emu, serving=False)
    agent.wait_stage("Ready")
    c = AgentDriver(agent)
    refit = {"version": "1", "path": str(path), "committedChecksum": committed["checksum"],
             "committedLayout": committed["layout"]}  # fmt: skip
    out = c.failed("refit", **refit)
    assert out["failureReason"] == "WeightsMismatch", out
    assert "does not hold the committed weights 1" in out["error"]
    assert agent.state()["stage"] == "Drained"  # paused: rollout never opened on the launch weights
    emu.set_faults(refit_loads_launch=False)
    assert c.ok("refit", **refit)["state"] == "Succeeded"
    assert weights(agent)["checked"] == ["Committed"] and weights(agent)["checksum"] == committed["checksum"]
