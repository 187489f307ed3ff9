"""Tensor refit by CUDA IPC on a real GPU, through the real agent and the trainer SDK.

test_ipc_copy_floor: the plain-torch floor (ipc_floor.py): two processes, 15 GiB in buckets, handles
opened cold, re-opened, or kept open; and a device-to-device copy of the same bytes.

test_tensor_refit_through_the_agent: the emulator holds a 7B-sized footprint (15 GiB weights) in
torch_memory_saver regions; a separate trainer process (tensor_trainer.py) makes Llama-3-8B-shaped bf16
weights (14.96 GiB) in each lease, gives them back before the resume, and goes through the iterations of
PLAN: tensor refits
(RefitSession.push_named_tensors) in buckets of 1, 2 and 4 GiB, each size twice (the first allocates the
bucket buffers, the second reuses them), then a disk refit of the same weights for contrast. After each
tensor refit the checksum the emulator computed on the GPU over its weights region equals the one the
trainer computed the same way over its own tensors, and /generate serves the new version. Release through
the agent is compared with the torch_memory_saver floor of the same release. Figures:
$RLJOB_GPU_RESULTS_DIR/gpu_tensor_refit.{md,json}, gpu_ipc_floor.json."""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from agent_procs import ALL_TAGS, PY, Agent, AgentDriver, Emulator, Proc, wait_until, write_weights
from gpu_helpers import GiB, gib, markdown_table, nvml_total, sha256_file, tms_events, while_alive
from test_gpu_handoff import generate, region_sizes, size_flags, wait_trained

from rljob.emulator.tokens import GARBAGE_MARKER

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
# bucket sizes in MiB; each size's first refit allocates the two bucket buffers, the next reuses them
PLAN = ("tensor@1024", "tensor@1024", "tensor@2048", "tensor@2048", "tensor@4096", "tensor@4096", "disk")


def test_ipc_copy_floor(results_dir: Path) -> None:
    out = results_dir / "gpu_ipc_floor.json"
    r = subprocess.run(
        [PY, str(HERE / "ipc_floor.py"), "--out", str(out)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    res = json.loads(out.read_text())
    rows = []
    for size in ("1024MiB", "256MiB"):
        for name, rnd in res[size].items():
            if isinstance(rnd, dict):
                rows.append(
                    [size, res[size]["buckets"], name]
                    + [f"{rnd[k] * 1e3:.1f}" for k in ("seconds", "serialize", "open", "copy", "close")]
                )
    table = markdown_table(["bucket", "n", "round", "total ms", "serialize", "open", "copy", "close"], rows)
    d2d = res["d2d_copy_median_seconds"] * 1e3
    text = f"IPC floor, {res['gib']:.2f} GiB; D2D copy median {d2d:.2f} ms\n\n{table}\n"
    (results_dir / "gpu_ipc_floor.md").write_text(text)
    print("\n" + text)
    assert res["d2d_copy_median_seconds"] < 0.1  # 15 GiB at HBM speed: milliseconds


def release_breakdown(agent_log: str) -> list[dict[str, Any]]:
    out = []
    for line in agent_log.splitlines():
        _, sep, rest = line.partition("release timing ")
        if sep:
            out.append(json.loads(rest))
    return out


def test_tensor_refit_through_the_agent(
    tmp_path: Path,
    results_dir: Path,
    procs: list[Proc],
    start_gpu_emulator: Callable[..., Emulator],
    start_nvml_agent: Callable[..., Agent],
) -> None:
    total = nvml_total()
    # Beside the regions all along: the trainer's two bucket buffers of the largest size (4 GiB) and both
    # processes' CUDA contexts. Its 14.96 GiB of weights live in its lease only (given back before the
    # resume, as a colocated trainer's): on an 80 GB card holding them too killed the resume (out of memory).
    sizes = region_sizes(total, reserve=12 * GiB)
    footprint = sum(sizes.values())
    emu = start_gpu_emulator(
        *size_flags(sizes),
        "--model-path",
        str(write_weights(tmp_path / "launch", "1")),
        "--weight-version",
        "1",
    )
    agent = start_nvml_agent(emu)
    c = AgentDriver(agent)
    tr_dir = tmp_path / "trainer"
    trainer = Proc(
        "tensor-trainer",
        [PY, str(HERE / "tensor_trainer.py"), "--plan", ",".join(PLAN), "--first-version", "2",
         "--result-dir", str(tr_dir), "--weights-dir", str(tmp_path / "ckpt")],
        tmp_path / "tensor-trainer.log",
        env={"RLJOB_AGENT_URL": agent.trainer_url},
    )  # fmt: skip
    procs.append(trainer)
    assert generate(emu)["meta_info"]["weight_version"] == "1"

    iterations: list[dict[str, Any]] = []
    for i, step in enumerate(PLAN):
        kind = step.partition("@")[0]
        version = str(2 + i)
        agent.wait_state(while_alive(trainer, lambda s: s["trainer"]["requested"]), 300, "the trainer to ask")
        it: dict[str, Any] = {"kind": kind, "version": version, "tms_from": len(tms_events(emu.log_text()))}
        it["step"] = step
        it["drain"] = c.done("drain", 60)
        need = int(0.95 * footprint)
        it["release"] = c.done(
            "release", 120, tags=ALL_TAGS, verify={"minFreedBytes": need, "timeoutSeconds": 60}
        )
        assert agent.state()["memory"]["verified"]
        it["grant"] = c.done("grant", 30)
        trained = wait_trained(agent, trainer, 600)
        assert trained["trainer"]["publishedVersion"] == version
        if kind == "tensor":
            it["refit"] = c.done("refit", 300, version=version, source="tensor")
        else:
            it["path"] = trained["trainer"]["publishedPath"]
            it["refit"] = c.done("refit", 900, version=version, path=it["path"])
        t0 = time.perf_counter()
        it["weights"] = emu.weights()  # a tensor refit's checksum is computed on the GPU now
        it["weights_read_seconds"] = time.perf_counter() - t0
        # the trainer's memory back before the resume (its iteration file comes last)
        given_back = tr_dir / f"iteration-{i}.json"
        wait_until(lambda f=given_back: f.exists() or trainer.returncode() is not None,
                   300, "the trainer to give its memory back")  # fmt: skip
        assert given_back.exists(), trainer.log_text()[-4000:]
        it["resume"] = c.done("resume", 120)
        out = generate(emu)
        assert out["meta_info"]["weight_version"] == version and GARBAGE_MARKER not in out["text"], out
        assert agent.state()["engine"]["servedVersion"] == version
        it["tms"] = tms_events(emu.log_text())[it["tms_from"] :]
        iterations.append(it)
    assert trainer.wait_exit(120) == 0, trainer.log_text()[-4000:]

    trainer_info = json.loads((tr_dir / "trainer.json").read_text())
    for i, it in enumerate(iterations):
        it["trainer"] = json.loads((tr_dir / f"iteration-{i}.json").read_text())
        w = it["weights"]
        assert (w["source"], w["weight_version"], w["valid"]) == (it["kind"], it["version"], True), w
        if it["kind"] == "tensor":
            # the bytes the emulator holds are the trainer's, checksummed the same way on both GPUs' sides
            assert w["checksum"] == it["trainer"]["checksum"], (w, it["trainer"]["checksum"])
            assert w["checksum"].endswith(f":{trainer_info['bytes']}")
            assert w["tensors"] == trainer_info["tensors"]
        else:
            assert w["checksum"] == sha256_file(it["path"])
    for prev, it in itertools.pairwise(iterations):
        if it["kind"] == "tensor":
            # a refit with the previous refit's bucket size reuses its buffers (the same IPC handles)
            reused = prev["step"] == it["step"]
            assert it["trainer"]["report"]["new_buffers"] == (0 if reused else 2), it["trainer"]["report"]
            assert it["trainer"]["checksum"] != prev["trainer"].get("checksum")  # new weights each time
    assert iterations[0]["trainer"]["report"]["new_buffers"] == 2

    text, figures = report(iterations, trainer_info, sizes, release_breakdown(agent.log_text()))
    (results_dir / "gpu_tensor_refit.md").write_text(text)
    (results_dir / "gpu_tensor_refit.json").write_text(json.dumps(figures, indent=1, default=str))
    print("\n" + text)


def report(
    iterations: list[dict[str, Any]],
    trainer_info: dict[str, Any],
    sizes: dict[str, int],
    breakdown: list[dict[str, Any]],
) -> tuple[str, dict[str, Any]]:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    rows, release_rows = [], []
    figures: dict[str, Any] = {"trainer": trainer_info, "sizes": sizes, "iterations": []}
    for n, it in enumerate(iterations):
        ev = it["tms"]
        pushes = [e for e in ev if e["op"] == "tensor_push"]
        resumes = {e["tag"]: e for e in ev if e["op"] == "resume"}
        pauses = {e["tag"]: e for e in ev if e["op"] == "pause"}
        checksum = [e for e in ev if e["op"] == "weights_checksum"]
        refit = it["refit"]
        resume_s = sum(resumes[t]["seconds"] for t in ("cuda_graph", "weights") if t in resumes)
        fig: dict[str, Any] = {
            "kind": it["kind"],
            "step": it["step"],
            "raw": {k: it[k] for k in ("drain", "release", "grant", "refit", "resume", "tms")},
            "refit_seconds": refit["seconds"],
            "refit_engine_seconds": refit.get("engineSeconds"),
            "resume_graph_weights_seconds": resume_s,
            "release_seconds": it["release"]["seconds"],
            "release_floor_seconds": sum(p["seconds"] for p in pauses.values()),
            "release_floor_parts": {t: p["seconds"] for t, p in pauses.items()},
        }
        fig["release_ratio"] = fig["release_seconds"] / fig["release_floor_seconds"]
        if it["kind"] == "tensor":
            tr = it["trainer"]
            rep = tr["report"]
            send = sum(rep["send_seconds"])
            emu_push = sum(p["seconds"] for p in pushes)
            parts = {k: sum(p[f"{k}_seconds"] for p in pushes) for k in ("decode", "open", "copy", "close")}
            floor = tr["floor"]["median_seconds"]
            fig.update(
                {
                    "window_seconds": tr["window_seconds"],
                    "push_named_tensors_seconds": tr["push_named_tensors_seconds"],
                    "pack_seconds": rep["pack_seconds"],
                    "serialize_seconds": rep["serialize_seconds"],
                    "ipc_share_seconds": rep["ipc_share_seconds"],
                    "send_seconds": send,
                    "emulator_push_seconds": emu_push,
                    "http_and_agent_seconds": send - emu_push,
                    **{f"{k}_seconds": v for k, v in parts.items()},
                    "pushes": len(pushes),
                    "bytes": rep["bytes"],
                    "d2d_floor_seconds": floor,
                    "window_over_floor": tr["window_seconds"] / floor,
                    "new_buffers": rep["new_buffers"],
                    "buffer_bytes": tr["buffer_bytes"],
                    "gpu_checksum_seconds": checksum[0]["seconds"] if checksum else None,
                    "trainer_checksum_seconds": tr["checksum_seconds"],
                }
            )
            rows.append(
                [
                    f"tensor, {tr['bucket_bytes'] >> 20} MiB buckets, "
                    f"{'cold (buffers allocated)' if rep['new_buffers'] else 'buffers reused'}",
                    ms(fig["window_seconds"]),
                    ms(fig["pack_seconds"]),
                    ms(fig["serialize_seconds"]),
                    ms(fig["http_and_agent_seconds"]),
                    ms(parts["open"]),
                    ms(parts["copy"]),
                    ms(parts["close"] + parts["decode"]),
                    ms(floor),
                    f"{fig['window_over_floor']:.1f}x",
                    ms(refit["seconds"]),
                    ms(resume_s),
                ]
            )
        else:
            load = next(e for e in ev if e["op"] == "weights_load")
            hashed = next(e for e in ev if e["op"] == "weights_hash")
            fig.update(
                {
                    "copy_seconds": load["seconds"],
                    "readback_seconds": load["readback_seconds"],
                    "sha256_seconds": hashed["seconds"],
                    "bytes": load["bytes"],
                    "save_seconds": it["trainer"]["save_seconds"],
                }
            )
            rows.append(
                [
                    "disk (same weights, safetensors)",
                    ms(refit["seconds"]),
                    "-",
                    "-",
                    "-",
                    "-",
                    f"H2D {ms(load['seconds'])}",
                    f"evidence: readback {ms(load['readback_seconds'])} + sha256 {ms(hashed['seconds'])}",
                    "-",
                    "-",
                    ms(refit["seconds"]),
                    ms(resume_s),
                ]
            )
        release_rows.append(
            [
                n,
                ms(fig["release_seconds"]),
                ms(it["release"].get("engineSeconds")),
                ms(fig["release_floor_seconds"]),
                " + ".join(f"{t} {ms(s)}" for t, s in fig["release_floor_parts"].items()),
                f"{fig['release_ratio']:.3f}",
            ]
        )
        figures["iterations"].append(fig)
    figures["release_breakdown"] = breakdown
    refit_table = markdown_table(
        [
            "refit",
            "window ms (trainer: first pack to last answer)",
            "pack",
            "serialize",
            "HTTP + agent",
            "handle open",
            "copy",
            "decode + close",
            "D2D floor",
            "window / floor",
            "refit command ms",
            "of which resume graphs+weights",
        ],
        rows,
    )
    release_table = markdown_table(
        ["iteration", "release ms", "agent sglang ms", "floor ms", "floor parts", "ratio"], release_rows
    )
    ratios = [f["release_ratio"] for f in figures["iterations"]]
    text = (
        f"weights {trainer_info['tensors']} tensors, {gib(trainer_info['bytes'])} bf16; regions "
        f"{', '.join(f'{k} {gib(v)}' for k, v in sizes.items())}\n\n{refit_table}\n\n{release_table}\n\n"
        f"release ratio median {statistics.median(ratios):.3f}; release breakdown (agent log): "
        f"{json.dumps(breakdown)}\n"
    )
    return text, figures
