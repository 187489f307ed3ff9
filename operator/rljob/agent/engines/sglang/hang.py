"""C-DEATH-HARD: on SGLang without a subprocess watchdog (0.5.6) a scheduler that died without a Python
exception (a torch_memory_saver `exit(1)`, an OOM kill) leaves `/ping` at 200 (C-HEALTH-PING) and every
scheduler-bound call hanging. `/get_load` is answered even while paused (C-DP-LOADS-PAUSED), so it is a
bounded probe, but only while no control call is in flight: a release, a refit or a group init occupies
the scheduler."""

from __future__ import annotations

import logging

from rljob.agent.engines.sglang.client import SGLangClient

log = logging.getLogger("rljob.agent")

SCHEDULER_PROBE_MISSES = 2  # consecutive unanswered probes, with no control call in flight, mean death


class SchedulerProbe:
    def __init__(self, client: SGLangClient, timeout_s: float) -> None:
        self._client = client
        self._timeout = timeout_s
        self._misses = 0

    async def check(self) -> str | None:
        """Why the scheduler is dead, or None; EngineUnreachable when SGLang's port is gone."""
        if self._client.control_in_flight:
            return None
        started = self._client.control_started
        try:
            if await self._client.scheduler_probe(timeout=self._timeout):
                self._misses = 0  # any HTTP answer: the scheduler replied
            return None
        except TimeoutError:
            if self._client.control_in_flight or self._client.control_started != started:
                return None  # a control call overlapped: the scheduler may just have been busy with it
        self._misses += 1
        log.warning(
            "scheduler probe: /get_load did not answer within %gs (%d/%d)",
            self._timeout,
            self._misses,
            SCHEDULER_PROBE_MISSES,
        )
        if self._misses < SCHEDULER_PROBE_MISSES:
            return None
        return (
            f"scheduler dead: /get_load did not answer within {self._timeout:g}s "
            f"{SCHEDULER_PROBE_MISSES} times in a row with no control call in flight; SGLang "
            f"{self._client.quirks.version if self._client.quirks else '?'} has no subprocess watchdog, "
            "so its HTTP server (and /ping) outlive a dead scheduler"
        )
