"""Release answering before the memory is free (slime#579, miles#86), on a real GPU: the emulator answers
`release_memory_occupation` at once and calls torch_memory_saver.pause only after a delay. The agent must
not report Released, nor grant the lease, before NVML shows the memory free."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_procs import ALL_TAGS, Agent, AgentDriver, Emulator, wait_until, write_weights
from gpu_helpers import GiB, NvmlSampler, gib, nvml_used, tms_events

pytestmark = pytest.mark.gpu

DELAY_S = 3.0
SIZES = {"weights": 4 * GiB, "kv_cache": 16 * GiB, "cuda_graph": GiB // 2}
SLACK = 128 << 20  # NVML noise allowed below the footprint; smaller than any region


def test_delayed_unmap_is_not_granted_early(
    tmp_path: Path,
    results_dir: Path,
    start_gpu_emulator: Callable[..., Emulator],
    start_nvml_agent: Callable[..., Agent],
) -> None:
    footprint = sum(SIZES.values())
    assert "torch_memory_saver" not in os.environ.get("LD_PRELOAD", "")
    emu = start_gpu_emulator(
        "--weights-bytes",
        str(SIZES["weights"]),
        "--kv-bytes",
        str(SIZES["kv_cache"]),
        "--graph-bytes",
        str(SIZES["cuda_graph"]),
        "--fault-release-unmap-delay",
        str(DELAY_S),
        preload=False,
    )
    assert "re-executing with LD_PRELOAD=" in emu.log_text()  # `python -m rljob.emulator` sets the hook
    agent = start_nvml_agent(emu)
    c = AgentDriver(agent)
    c.ok("drain")
    used_before = nvml_used()
    need = footprint - SLACK  # every region, cuda_graph (> SLACK) included
    with NvmlSampler() as sampler:
        c.epoch += 1
        r = agent.command(
            "release", c.epoch, wait=0, tags=ALL_TAGS, verify={"minFreedBytes": need, "timeoutSeconds": 60}
        )
        assert r.status == 202, r.text
        wait_until(lambda: emu.stats()["offload_tags"] == sorted(ALL_TAGS), 10, "SGLang's answer")
        answered_at = time.time()
        st = agent.state()
        assert st["stage"] == "Drained" and st["lastCommand"]["state"] == "Running", st
        c.refused("grant", "Busy", _emulator_url=emu.url)
        st = agent.wait_state(lambda s: s["lastCommand"]["state"] != "Running", 60, "release to finish")
        seen_released_at = time.time()
        used_at_released = nvml_used()
    cmd = st["lastCommand"]
    assert cmd["state"] == "Succeeded", cmd
    assert st["stage"] == "Released" and st["memory"]["verified"]
    # When the agent says Released, NVML shows the memory free.
    assert used_before - used_at_released >= need, (used_before, used_at_released)

    # The log line of a pause comes right after torch_memory_saver.pause returned: wait for all three.
    wait_until(lambda: len([e for e in tms_events(emu.log_text()) if e["op"] == "pause"]) == 3, 10, "logs")
    ev = tms_events(emu.log_text())
    deferred = [e for e in ev if e["op"] == "pause_deferred"]
    paused = [e for e in ev if e["op"] == "pause"]
    assert {e["tag"] for e in deferred} == {e["tag"] for e in paused} == set(ALL_TAGS), ev
    answered = min(e["at"] for e in deferred)  # the release call returned right after these
    first_unmap_started = min(e["at"] - e["seconds"] for e in paused)
    last_unmap_started = max(e["at"] - e["seconds"] for e in paused)
    unmapped_at = max(e["at"] for e in paused)
    finished_at = cmd["startedAt"] + cmd["seconds"]
    # SGLang answered long before the memory was unmapped ...
    assert first_unmap_started - answered >= DELAY_S * 0.95
    # ... NVML still saw it in use after the answer ...
    held = [u for t, u in sampler.samples if answered_at <= t < first_unmap_started - 0.05]
    assert held and min(held) > used_before - SLACK, (len(held), used_before)
    # ... and the agent finished the release only after the last region began to unmap.
    assert finished_at > last_unmap_started, (finished_at, last_unmap_started)
    assert cmd["seconds"] >= DELAY_S * 0.95

    c.ok("grant")
    assert agent.trainer("GET", "/v1/trainer/lease").body["granted"] is True
    ckpt = write_weights(tmp_path / "ckpt", "2")
    c.publish("2", str(ckpt))
    c.ok("refit", version="2", path=str(ckpt), wait=60)
    c.ok("resume", wait=60)
    assert emu.weights()["weight_version"] == "2"

    first_free = next((t for t, u in sampler.samples if used_before - u >= need), None)
    figures = {
        "delay_s": DELAY_S,
        "footprint_bytes": footprint,
        "release_seconds": cmd["seconds"],
        "release_engine_seconds": cmd["engineSeconds"],
        "sglang_answered_to_first_unmap_s": first_unmap_started - answered,
        "last_unmap_started_to_agent_finished_s": finished_at - last_unmap_started,
        "last_unmap_returned_to_agent_finished_s": finished_at - unmapped_at,
        "pause_seconds": {e["tag"]: e["seconds"] for e in paused},
        "nvml_first_free_to_agent_finished_s": None if first_free is None else finished_at - first_free,
        "agent_finished_to_test_saw_released_s": seen_released_at - finished_at,
        "nvml_freed_at_released": used_before - used_at_released,
        "nvml_samples": len(sampler.samples),
    }
    (results_dir / "gpu_delayed_unmap.json").write_text(json.dumps(figures, indent=2))
    print(
        "\ndelayed unmap: "
        + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        + f" (freed {gib(used_before - used_at_released)})"
    )
