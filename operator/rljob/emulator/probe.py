"""The emulator's GPU probe, an agent plugin: `rljob-agent --gpu-probe rljob.emulator.probe:EmulatorProbe`.
It reads the emulator's per-GPU accounting (`/_emulator/memory`, `/_emulator/processes` and
`/_emulator/utilization`, not SGLang routes) through the agent's engine (Engine.get_json), so the agent's
product code never names the emulator."""

from __future__ import annotations

from rljob.agent.engines.base import Engine
from rljob.agent.gpu_probe import GpuMemory, GpuProcessUse

PROBE = "rljob.emulator.probe:EmulatorProbe"  # what the test world passes as --gpu-probe
# It stands in for NVML, which answers from the node's driver and has no timeout: an emulator that answers
# late (hundreds of pods sharing one process, rljob.testing.shared_pods) is slow, not a failed GPU.
TIMEOUT_S = 60.0


class EmulatorProbe:
    host_pids = False  # the emulated GPUs' processes are this machine's: their pids are the agent's own

    def __init__(self, engine: Engine) -> None:
        self._client = engine
        self._last: tuple[float, list[float]] | None = None  # (emulator clock, busy seconds per GPU)

    async def sample(self) -> list[GpuMemory]:
        body = await self._client.get_json("emulator_memory", "/_emulator/memory", timeout=TIMEOUT_S)
        return [
            GpuMemory(
                int(g["index"]), int(g["used_bytes"]), int(g["total_bytes"]), name=str(g.get("name", ""))
            )
            for g in body["gpus"]
        ]

    async def processes(self) -> list[GpuProcessUse]:
        """NVML's per-process list as the emulator answers it (emulator/gpu_processes.py)."""
        body = await self._client.get_json("emulator_processes", "/_emulator/processes", timeout=TIMEOUT_S)
        return [
            GpuProcessUse(
                int(g["gpu"]),
                int(p["pid"]),
                None if p["usedGpuMemory"] is None else int(p["usedGpuMemory"]),
            )
            for g in body["gpus"]
            for p in g["processes"]
        ]

    async def utilization(self) -> list[float] | None:
        """Busy fraction per GPU since the previous call, from the emulator's cumulative busy seconds."""
        body = await self._client.get_json("gpu_utilization", "/_emulator/utilization", timeout=TIMEOUT_S)
        now, busy = float(body["monotonic"]), [float(g["busy_seconds"]) for g in body["gpus"]]
        last, self._last = self._last, (now, busy)
        if last is None or now <= last[0] or len(last[1]) != len(busy):
            return None
        return [min(1.0, max(0.0, (b - a) / (now - last[0]))) for a, b in zip(last[1], busy, strict=True)]
