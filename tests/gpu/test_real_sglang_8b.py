"""The figures at the size users run: real SGLang 0.5.15.post1 serving a Llama-3-8B-shaped checkpoint
(rljob.testing.llama_checkpoint: 16.06 GB of random bf16, built on the GPU once per run by the `llama8b`
fixture), driven by the real agent (`--gpu-probe nvml`) through the iterations of PLAN with a real torch
trainer (real_iterations.drive): a tensor refit by a trainer that publishes as soon as it holds the lease
(its first push of the run), a tensor refit after a training step (the bucket buffers reused), a disk
refit. After each, the checks of real_iterations (no stale KV, the logprobs moved, and equal to SGLang's
own disk load of the same version), then SGLang's own calls for the same phases in the same run.

Printed, and written to $RLJOB_GPU_RESULTS_DIR as the test goes (real_sglang_8b.{md,json}, with the card):
SGLang's cold start and where it went; each agent command against SGLang's own calls; the switching cost
of an iteration (drain + release + refit + resume through the agent); each push's window against the
CUDA-IPC floor of the same bytes measured in the same run (ipc_floor.py, before SGLang starts: it needs
twice the model's bytes) and where the push's time goes; the goals met or not. Sized from the card
(real_sglang.mem_fraction): an 80 GB H100 and a 141 GB H200 both run it."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from agent_procs import PY, Proc
from gpu_helpers import card, nvml_total
from real_iterations import Served, drive, summarize
from real_models import Built8B
from real_sglang import RealSGLang, launch_flags, mem_fraction, sglang_missing

from rljob.trainer.engines.sglang.packing import DEFAULT_BUCKET_BYTES

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
PLAN = ("tensor", "tensor", "disk")
AT_ONCE = (0,)  # the first iteration's trainer publishes as soon as it holds the lease


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE)
    return r.stdout.strip() if r.returncode == 0 else "(no git here)"


def ipc_floor(results_dir: Path, nbytes: int) -> dict[str, Any]:
    """ipc_floor.py on `nbytes` in buckets of the SDK's default size: the floor of the same push."""
    out = results_dir / "ipc_floor_8b.json"
    argv = [PY, str(HERE / "ipc_floor.py"), "--out", str(out), "--bytes", str(nbytes),
            "--bucket-mib", str(DEFAULT_BUCKET_BYTES >> 20)]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    floor = dict(json.loads(out.read_text()))
    rounds = {
        k: v["seconds"] for k, v in floor[f"{DEFAULT_BUCKET_BYTES >> 20}MiB"].items() if isinstance(v, dict)
    }
    print(
        "\nCUDA-IPC floor of the same bytes, ms: "
        + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in rounds.items())
    )
    return floor


def test_figures_at_8b(llama8b: Built8B, results_dir: Path, tmp_path: Path) -> None:
    reason = sglang_missing()
    if reason:
        pytest.skip(f"real-SGLang tier: {reason}")
    total = nvml_total()
    header = (
        f"{card()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, commit {commit()}; "
        f"checkpoint {llama8b.ckpt.nbytes / 1e9:.2f} GB built in {llama8b.build['seconds']:.1f} s"
    )
    print("\n" + header)
    (results_dir / "llama8b_build.json").write_text(json.dumps(llama8b.build, indent=1))
    floor = ipc_floor(results_dir, llama8b.ckpt.nbytes)
    server = RealSGLang(tmp_path, llama8b.launch, *launch_flags(mem_fraction(total)))
    procs: list[Proc] = []
    seen: dict[str, Any] = {"card": header}
    try:
        start = server.wait_ready()
        print(f"SGLang ready in {start:.1f} s")
        served = Served("8b", llama8b.launch, root=llama8b.ckpt.root)
        drive(server, tmp_path, served, PLAN, procs, seen, at_once=AT_ONCE)
        report = summarize(server, seen, floor) | {"card": header, "build": llama8b.build}
        report["markdown"] = header + "\n\n" + report["markdown"]
        (results_dir / "real_sglang_8b.json").write_text(json.dumps(report, indent=1, default=str))
        (results_dir / "real_sglang_8b.md").write_text(report["markdown"])
        print("\n" + report["markdown"])
    except BaseException:
        # What the iterations that ran saw, for a run that did not finish.
        (results_dir / "real_sglang_8b_partial.json").write_text(json.dumps(seen, indent=1, default=str))
        raise
    finally:
        for p in reversed(procs):
            p.stop()
            (results_dir / f"real_sglang_8b_{p.name}.log").write_text(p.log_text()[-400_000:])
        server.stop()
        (results_dir / "real_sglang_8b_sglang.log").write_text(server.log_text()[-400_000:])
