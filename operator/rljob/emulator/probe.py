"""The emulator's GPU probe, an agent plugin: `rljob-agent --gpu-probe rljob.emulator.probe:EmulatorProbe`.
It reads the emulator's per-GPU accounting (`/_emulator/memory`, not an SGLang route) through the agent's
SGLang client, so the agent's product code never names the emulator."""

from __future__ import annotations

from rljob.agent.gpu_probe import GpuMemory
from rljob.agent.sglang_client import SGLangClient

PROBE = "rljob.emulator.probe:EmulatorProbe"  # what the test world passes as --gpu-probe


class EmulatorProbe:
    def __init__(self, client: SGLangClient) -> None:
        self._client = client

    async def sample(self) -> list[GpuMemory]:
        body = await self._client.get_json("emulator_memory", "/_emulator/memory")
        return [GpuMemory(int(g["index"]), int(g["used_bytes"]), int(g["total_bytes"])) for g in body["gpus"]]
