"""GPU busy during an emulated rollout, read from NVML by the real agent (`--gpu-probe nvml`): the
emulator with `--memory-backend cuda` keeps the GPU as busy as its decode model says (a spin kernel per
tick, gpu_memory.CudaRegionBackend.drive_busy); the agent's rollout report must show it (docs/profiling.md:
gpuBusyFraction). An idle stretch first, then a saturated one: NVML, read directly by this test, and the
agent's time-weighted mean both follow. Figures go to $RLJOB_GPU_RESULTS_DIR/gpu_profile.json."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from agent_procs import Agent, AgentDriver, Emulator, Proc, http
from gpu_helpers import GiB

pytestmark = pytest.mark.gpu

IDLE_S = 3.0
TOKENS_PER_SECOND = 200.0
SATURATION = 16
REQUESTS = 48  # more than SATURATION: the emulated GPU is fully busy while they run
NEW_TOKENS = 800  # each runs at 200 x 16 / 48 tok/s: about 12 s of a saturated GPU


class NvmlBusy:
    """nvmlDeviceGetUtilizationRates(handle).gpu every `interval` s on GPU 0, in a thread."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), pynvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0))
            time.sleep(self.interval)

    def mean(self, start: float, end: float) -> float:
        values = [v for t, v in self.samples if start <= t <= end]
        assert values, "no NVML sample in the interval"
        return sum(values) / len(values)

    def __enter__(self) -> NvmlBusy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _generate(emu: Emulator) -> dict[str, Any]:
    body = {"text": "p q r", "sampling_params": {"max_new_tokens": NEW_TOKENS}}
    r = http("POST", emu.url + "/generate", body, timeout=120)
    assert r.status == 200, r.text
    return dict(r.body)


def test_nvml_reads_gpu_busy_during_an_emulated_rollout(
    tmp_path: Path,
    results_dir: Path,
    procs: list[Proc],
    start_gpu_emulator: Callable[..., Emulator],
) -> None:
    sizes = ("--weights-bytes", str(GiB), "--kv-bytes", str(2 * GiB), "--graph-bytes", str(GiB // 4))
    emu = start_gpu_emulator(
        *sizes,
        "--enable-metrics",
        "--weight-version",
        "0",
        "--tokens-per-second",
        str(TOKENS_PER_SECOND),
        "--saturation-batch",
        str(SATURATION),
    )
    agent = Agent(tmp_path, emu.url, "--rollout-sample-seconds", "0.25", probe="nvml")
    procs.append(agent)
    agent.wait_stage("Ready", timeout=60)
    conductor = AgentDriver(agent)
    conductor.ok("resume")  # opens rollout: the agent's baseline
    with NvmlBusy() as nvml:
        opened = time.monotonic()
        time.sleep(IDLE_S)
        idle_report = agent.state()["rollout"]
        busy_from = time.monotonic()
        with ThreadPoolExecutor(REQUESTS) as pool:
            replies = list(pool.map(lambda _: _generate(emu), range(REQUESTS)))
        busy_to = time.monotonic()
        conductor.ok("drain")  # the drain's sample closes the window
        report = agent.state()["rollout"]
    assert all(r["meta_info"]["completion_tokens"] == NEW_TOKENS for r in replies)
    idle_nvml = nvml.mean(opened + 0.5, busy_from)
    busy_nvml = nvml.mean(busy_from + 1.0, busy_to - 0.5)
    busy_s, window_s = busy_to - busy_from, float(report["windowSeconds"])
    expected = busy_s / window_s  # the GPU saturated while the requests ran, idle otherwise
    figures = {
        "nvml_idle_mean": round(idle_nvml, 4),
        "nvml_saturated_mean": round(busy_nvml, 4),
        "agent_busy_after_idle": idle_report.get("gpuBusyFraction"),
        "agent_busy_fraction": report.get("gpuBusyFraction"),
        "expected_fraction": round(expected, 4),
        "window_seconds": window_s,
        "saturated_seconds": round(busy_s, 3),
        "gpu_name": report.get("gpuName"),
        "generation_tokens": report.get("generationTokens"),
        "mean_running_requests": report.get("meanRunningRequests"),
    }
    (results_dir / "gpu_profile.json").write_text(json.dumps(figures, indent=2) + "\n")
    print("\nGPU busy during an emulated rollout:", json.dumps(figures, indent=2))
    assert idle_nvml < 0.15, figures  # nothing generates: no kernel runs
    assert busy_nvml > 0.7, figures  # the spin kernel keeps the GPU as busy as the emulated decode
    assert report["gpus"] >= 1 and "NVIDIA" in (report.get("gpuName") or ""), figures
    assert idle_report.get("gpuBusyFraction") is not None and idle_report["gpuBusyFraction"] < 0.15, figures
    assert report["gpuBusyFraction"] == pytest.approx(expected, abs=0.2), figures
    assert report["generationTokens"] == REQUESTS * NEW_TOKENS, figures
    assert report["meanRunningRequests"] > SATURATION, figures
