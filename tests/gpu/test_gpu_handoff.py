"""One RL iteration on a real GPU: the emulator holds a 7B-sized footprint in torch_memory_saver regions,
the real agent (NVML probe) drains and releases it, a real torch trainer takes the freed memory for a
training step that would not fit otherwise, publishes a safetensors file, and the agent refits from it
and resumes. Then, for contrast, a cold restart of the emulator with the same allocations loading that
file. Figures go to $RLJOB_GPU_RESULTS_DIR (gpu_handoff.json, gpu_handoff.md) and stdout."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, PY, Agent, AgentDriver, Emulator, Proc, write_weights
from gpu_helpers import (
    GiB,
    gib,
    markdown_table,
    nvml_total,
    nvml_used,
    sha256_file,
    tms_events,
    wait_used_below,
    while_alive,
)

from rljob.emulator.tokens import GARBAGE_MARKER

pytestmark = pytest.mark.gpu

GRAPH_BYTES = 1 * GiB


def region_sizes(total: int, reserve: int = 0) -> dict[str, int]:
    """A 7B model in bf16 on one GPU: ~15 GiB of weights; the KV pool takes what SGLang's static fraction
    leaves (RLJOB_GPU_STATIC_FRACTION, default 0.80 of the GPU), and never more than leaves `reserve` bytes
    to what else holds memory beside the regions all along (a tensor trainer's weights and buckets); 1 GiB
    of CUDA graphs. Sized from the card: 80 GB and 141 GB both fit."""
    weights = int(float(os.environ.get("RLJOB_GPU_WEIGHTS_GIB", "15")) * GiB)
    static = min(int(float(os.environ.get("RLJOB_GPU_STATIC_FRACTION", "0.80")) * total), total - reserve)
    kv = (static - weights - GRAPH_BYTES) // GiB * GiB
    assert kv > 0, f"GPU of {gib(total)} too small for {gib(weights)} of weights"
    return {"weights": weights, "kv_cache": kv, "cuda_graph": GRAPH_BYTES}


def size_flags(sizes: dict[str, int]) -> list[str]:
    return [
        "--weights-bytes",
        str(sizes["weights"]),
        "--kv-bytes",
        str(sizes["kv_cache"]),
        "--graph-bytes",
        str(sizes["cuda_graph"]),
    ]


def generate(emu: Emulator) -> dict[str, Any]:
    body = {"text": "a b c d", "sampling_params": {"max_new_tokens": 4}}
    r = emu.call("POST", "/generate", body, timeout=30)
    assert r.status == 200, r.text
    return dict(r.body)


def wait_trained(agent: Agent, trainer: Proc, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    st = agent.state()
    while st["stage"] != "Trained":
        assert st["stage"] == "Granted", st
        rc = trainer.returncode()
        assert rc is None or rc == 0, f"trainer exited {rc}:\n{trainer.log_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no publish within {timeout}s:\n{trainer.log_text()[-4000:]}"
        st = agent.state(since=st["revision"], wait=5)
    return st


def test_release_train_refit_resume_on_real_gpu(
    tmp_path: Path,
    results_dir: Path,
    procs: list[Proc],
    start_gpu_emulator: Callable[..., Emulator],
    start_nvml_agent: Callable[..., Agent],
) -> None:
    total, idle_used = nvml_total(), nvml_used()
    sizes = region_sizes(total)
    footprint = sum(sizes.values())
    launch = write_weights(tmp_path / "launch", "1")

    t0 = time.monotonic()
    emu = start_gpu_emulator(*size_flags(sizes), "--model-path", str(launch), "--weight-version", "1")
    first_start_s = time.monotonic() - t0
    loaded_used = nvml_used()
    assert loaded_used - idle_used >= footprint, "the regions are not real GPU memory"
    assert emu.weights()["checksum"] == sha256_file(launch)  # launch load went through the GPU region

    agent = start_nvml_agent(emu)
    c = AgentDriver(agent)
    result_file = tmp_path / "trainer.json"
    argv = [PY, "-m", "rljob.testing.gpu_trainer", "--version", "2", "--weights-dir", str(tmp_path / "ckpt")]
    trainer = Proc(
        "trainer",
        [*argv, "--result", str(result_file)],
        tmp_path / "trainer.log",
        env={"RLJOB_AGENT_URL": agent.trainer_url},
    )
    procs.append(trainer)
    assert generate(emu)["meta_info"]["weight_version"] == "1"  # rollout on the launch weights
    agent.wait_state(while_alive(trainer, lambda s: s["trainer"]["requested"]), 180, "the trainer to ask")

    phases: dict[str, dict[str, Any]] = {}
    phases["drain"] = c.ok("drain")
    used_before = nvml_used()
    need = int(0.95 * footprint)
    phases["release"] = c.ok(
        "release", tags=ALL_TAGS, verify={"minFreedBytes": need, "timeoutSeconds": 60}, wait=120
    )
    used_released = nvml_used()
    released_state = agent.state()
    assert released_state["stage"] == "Released" and released_state["memory"]["verified"]
    assert used_before - used_released >= need, (used_before, used_released)
    phases["grant"] = c.ok("grant")
    trained = wait_trained(agent, trainer, 400)
    path = trained["trainer"]["publishedPath"]
    assert trained["trainer"]["publishedVersion"] == "2" and path
    phases["refit"] = c.ok("refit", version="2", path=path, wait=300)
    phases["resume"] = c.ok("resume", wait=120)
    used_resumed = nvml_used()

    # The new weights are what the GPU holds and what is served.
    file_sha = sha256_file(path)
    w = emu.weights()
    assert (w["checksum"], w["valid"], w["weight_version"], w["source"]) == (file_sha, True, "2", "disk")
    out = generate(emu)
    assert out["meta_info"]["weight_version"] == "2" and GARBAGE_MARKER not in out["text"]
    assert agent.state()["engine"]["servedVersion"] == "2"
    assert trainer.wait_exit(120) == 0, trainer.log_text()[-4000:]
    tr = json.loads(result_file.read_text())
    assert tr["losses_finite"], tr["losses"]
    # The step needed more than the GPU had free before the release.
    assert tr["max_memory_allocated"] > tr["free_before_request"], tr

    ev = tms_events(emu.log_text())
    pause = {e["tag"]: e for e in ev if e["op"] == "pause"}
    resume = {e["tag"]: e for e in ev if e["op"] == "resume"}
    loads = [e for e in ev if e["op"] == "weights_load"]
    assert set(pause) == set(resume) == set(ALL_TAGS), ev
    assert resume["weights"]["contents_kept"] is False  # no CPU backup: garbage until the refit
    assert resume["cuda_graph"]["contents_kept"] is True  # captured with CPU backup
    assert loads[-1]["bytes"] == Path(path).stat().st_size

    # Contrast: a cold restart with the same allocations, loading the trainer's file from disk.
    for p in (agent, emu):
        p.stop()
        procs.remove(p)
    wait_used_below(idle_used + GiB, 60)
    t0, t0_unix = time.monotonic(), time.time()
    cold = start_gpu_emulator(*size_flags(sizes), "--model-path", path, "--weight-version", "2")
    cold_s = time.monotonic() - t0
    assert cold.weights()["checksum"] == file_sha
    cev = tms_events(cold.log_text())
    cold_alloc = next(e for e in cev if e["op"] == "allocate")
    cold_load = next(e for e in cev if e["op"] == "weights_load")
    cold_hash = next(e for e in cev if e["op"] == "weights_hash")
    hashes = [e for e in ev if e["op"] == "weights_hash"]
    first_alloc = next(e for e in ev if e["op"] == "allocate")

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def agent_row(name: str, floor: float | None, floor_what: str) -> list[Any]:
        cmd = phases[name]
        return [name, s(cmd["seconds"]), s(cmd.get("engineSeconds")), s(floor), floor_what]

    rows = [
        agent_row("drain", None, "-"),
        agent_row(
            "release",
            sum(pause[t]["seconds"] for t in ALL_TAGS),
            "pause kv_cache {:.3f} + weights {:.3f} + cuda_graph {:.3f}".format(
                *(pause[t]["seconds"] for t in ("kv_cache", "weights", "cuda_graph"))
            ),
        ),
        agent_row("grant", None, "-"),
        agent_row(
            "refit",
            resume["cuda_graph"]["seconds"] + resume["weights"]["seconds"] + loads[-1]["seconds"],
            "resume cuda_graph {:.3f} + resume weights {:.3f} + H2D copy of the file {:.3f}; emulator-only "
            "evidence: readback {:.3f} + sha256 {:.3f}; rest (file read, HTTP, agent checks) {:.3f}".format(
                resume["cuda_graph"]["seconds"],
                resume["weights"]["seconds"],
                loads[-1]["seconds"],
                loads[-1]["readback_seconds"],
                hashes[-1]["seconds"],
                phases["refit"]["seconds"]
                - resume["cuda_graph"]["seconds"]
                - resume["weights"]["seconds"]
                - loads[-1]["seconds"]
                - loads[-1]["readback_seconds"]
                - hashes[-1]["seconds"],
            ),
        ),
        agent_row("resume", resume["kv_cache"]["seconds"], "resume kv_cache"),
        [
            "cold restart",
            s(cold_s),
            "-",
            s(cold_alloc["seconds"] + cold_load["seconds"]),
            "allocate {:.3f} + H2D copy {:.3f}; before allocating (python, torch import, CUDA init) {:.3f}; "
            "file read {:.3f}; readback {:.3f} + sha256 {:.3f}; then to listening {:.3f}".format(
                cold_alloc["seconds"],
                cold_load["seconds"],
                cold_alloc["at"] - cold_alloc["seconds"] - t0_unix,
                cold_load["at"] - cold_load["readback_seconds"] - cold_load["seconds"] - cold_alloc["at"],
                cold_load["readback_seconds"],
                cold_hash["seconds"],
                t0_unix + cold_s - cold_hash["at"],
            ),
        ],
    ]
    time_table = markdown_table(
        ["phase", "agent seconds", "agent engine_seconds", "raw floor seconds", "floor and breakdown"], rows
    )
    byte_rows = [
        ["regions (weights + kv_cache + cuda_graph)", gib(footprint)],
        ["NVML used by the emulator after start", gib(loaded_used - idle_used)],
        ["NVML freed by release (before - after)", gib(used_before - used_released)],
        ["agent memory.freedBytes (verified)", gib(released_state["memory"]["freedBytes"])],
        ["trainer: free before the release (cudaMemGetInfo)", gib(tr["free_before_request"])],
        ["trainer: free at the grant", gib(tr["free_at_grant"])],
        ["trainer: torch.cuda.max_memory_allocated", gib(tr["max_memory_allocated"])],
        ["trainer: torch.cuda.max_memory_reserved", gib(tr["max_memory_reserved"])],
        ["NVML used after resume - before release", gib(used_resumed - used_before)],
        ["checkpoint file written by the trainer", gib(tr["file_bytes"])],
    ]
    byte_table = markdown_table(["quantity", "bytes"], byte_rows)
    other = {
        "gpu_total": total,
        "first_start_seconds": first_start_s,
        "first_allocate_seconds": first_alloc["seconds"],
        "trainer": tr,
        "phases": phases,
        "tms": ev,
        "cold_tms": cev,
        "cold_restart_seconds": cold_s,
        "sizes": sizes,
        "nvml": {
            "idle": idle_used,
            "loaded": loaded_used,
            "before_release": used_before,
            "released": used_released,
            "resumed": used_resumed,
        },
    }
    text = (
        f"GPU {gib(total)}; regions {', '.join(f'{k} {gib(v)}' for k, v in sizes.items())}\n\n"
        f"{time_table}\n\n{byte_table}\n\n"
        f"trainer: {tr['params'] / 1e9:.2f} B params, batch {tr['batch']} x {tr['seq']} tokens, "
        f"step seconds {tr['step_seconds']}, losses {[round(x, 4) for x in tr['losses']]}, "
        f"train {tr['train_seconds']} s (calibration {tr['calibrate_seconds']} s), "
        f"save {tr['save_seconds']} s, request to lease {tr['granted_after_seconds']} s\n"
        f"first emulator start {first_start_s:.3f} s (allocate {first_alloc['seconds']:.3f} s)\n"
    )
    (results_dir / "gpu_handoff.md").write_text(text)
    (results_dir / "gpu_handoff.json").write_text(json.dumps(other, indent=2, default=str))
    print("\n" + text)
