"""Rollout statistics while Serving: SGLang's load endpoint sampled every ~1 s into AgentState.rollout
(reset at each resume). Rollout-only changes bump the revision at most every `report_s`, so long-polls
are not woken every second for numbers nobody waits on."""

from __future__ import annotations

import asyncio
import time

from rljob.agent.sglang_client import SGLangClient, SGLangError, SGLangUnreachable
from rljob.agent.state import StateStore
from rljob.api.agent import RolloutReport, Stage


class RolloutSampler:
    def __init__(self, store: StateStore, client: SGLangClient, sample_s: float, report_s: float) -> None:
        self._store = store
        self._client = client
        self._sample_s = sample_s
        self._report_s = report_s
        self._report: RolloutReport | None = None  # the report object the sums below belong to
        self._tput_sum = 0.0
        self._tput_busy = 0

    async def run(self) -> None:
        while self._store.state.stage != Stage.FAILED:
            await asyncio.sleep(self._sample_s)
            if self._store.state.stage == Stage.SERVING:
                await self.sample()

    async def final_sample(self) -> None:
        """Called as a drain starts: a rollout shorter than the sampling period still gets its numbers."""
        if self._store.state.stage == Stage.SERVING:
            await self.sample(force=True)

    async def sample(self, force: bool = False) -> None:
        try:
            load = await self._client.load()
        except (SGLangError, SGLangUnreachable, TimeoutError):
            return  # death is the watch's business
        if self._store.state.stage != Stage.SERVING:
            return
        report = self._store.state.rollout
        if report is not self._report:
            self._report, self._tput_sum, self._tput_busy = report, 0.0, 0
        report.samples += 1
        if load["cache_hit_rate"] is not None:
            report.cache_hit_rate = min(1.0, max(0.0, load["cache_hit_rate"]))
        # `utilization` is not read: SGLang never sets it (0.0, or -1 in PD prefill; C-METRIC-UTILIZATION,
        # managers/scheduler_components/metrics_reporter.py:1303-1315@0.5.23).
        tput = load["gen_throughput"]
        if tput is not None and tput > 0:  # average over busy samples: idle tails say nothing
            self._tput_sum += tput
            self._tput_busy += 1
            report.generation_tokens_per_second = self._tput_sum / self._tput_busy
        if force or report.samples == 1 or time.monotonic() - self._store.last_commit >= self._report_s:
            self._store.commit()
