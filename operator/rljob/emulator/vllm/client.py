"""The API server's side of vLLM (AsyncLLM and its engine-core client): utility calls fanned out to every
DP engine and their answers combined per version (V-DP-FANOUT), request routing, aborts, the sleep-state
gauge, and engine death as the API server sees it (V-DEATH-EXC, V-HEALTH)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

from rljob.emulator.memory import RegionBackend
from rljob.emulator.vllm.config import LaunchConfig
from rljob.emulator.vllm.core import EngineCore
from rljob.emulator.vllm.errors import EngineDeadError
from rljob.emulator.vllm.scheduler import Request

log = logging.getLogger("vllm.emulator")


class AsyncLLM:
    def __init__(self, cfg: LaunchConfig, backend: RegionBackend) -> None:
        self.cfg = cfg
        self.profile = cfg.profile
        self.backend = backend
        self.cores = [EngineCore(cfg, backend, i, self._engine_died) for i in range(cfg.dp_size)]
        self.errored = False
        self.death_listeners: list[Callable[[], None]] = []
        # vllm:engine_sleep_state per engine: (awake, weights_offloaded, discard_all) (ml:1261-1278@0.26.0)
        self.sleep_state = (1, 0, 0)
        self.tracked: dict[str, Request] = {}  # the output processor's request states
        self.server_load = 0  # --enable-server-load-tracking (V-METRIC-LOAD-ROUTE)
        self._next = 0

    def start(self) -> None:
        for core in self.cores:
            core.start()

    def stop(self) -> None:
        for core in self.cores:
            core.stop()

    def gpu_busy_seconds(self, gpu: int) -> float:
        """Emulated GPU time on `gpu`: each DP engine runs on TP x PP GPUs of its own."""
        core = self.cores[min(gpu // max(1, self.cfg.world_size), len(self.cores) - 1)]
        return core.busy_seconds

    def _engine_died(self, reason: str) -> None:
        """The client's monitor marks the whole engine dead: every DP engine's requests fail."""
        if self.errored:
            return
        self.errored = True
        for core in self.cores:
            core.die(f"another engine core died: {reason}")
        for listener in self.death_listeners:
            listener()

    def record_sleep_state(self, sleep: int, level: int) -> None:
        if not self.cfg.log_stats:
            return
        if sleep == 0:
            self.sleep_state = (1, 0, 0)
        else:
            self.sleep_state = (0, int(level == 1), int(level == 2))

    # --- utility calls over the DP engines -------------------------------------------------------

    def _alive(self) -> None:
        if self.errored:
            raise EngineDeadError()

    async def call_all(self, method: str, call: Callable[[EngineCore], Any]) -> list[Any]:
        self._alive()
        return list(
            await asyncio.gather(
                *(core.utility(method, functools.partial(call, core)) for core in self.cores)
            )
        )

    async def call(self, method: str, call: Callable[[EngineCore], Any]) -> Any:
        """Every engine; the first engine's answer (cc:1449-1457@0.26.0, cc:1881-1883@0.34.0)."""
        return (await self.call_all(method, call))[0]

    async def call_consensus(self, method: str, call: Callable[[EngineCore], Any]) -> Any:
        """0.34: the engines must agree (cc:1346-1352@0.34.0); 0.26: the first engine's answer."""
        results = await self.call_all(method, call)
        if self.profile.dp_combines_answers and any(r != results[0] for r in results):
            raise RuntimeError(f"Engines returned different {method} results: {results}")
        return results[0]

    # --- the RL surface --------------------------------------------------------------------------

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        """alm:750-793@0.26.0 (pause_scheduler), alm:1003-1038@0.34.0 (pause_generation); then a 0.02 s
        sleep before answering."""
        if self.profile.paused_requests_refused:
            await self.call("pause_generation", lambda c: c.pause_generation(mode, clear_cache))
        else:
            await self.call("pause_scheduler", lambda c: c.pause_scheduler(mode, clear_cache))
        await asyncio.sleep(0.02)

    async def resume_generation(self) -> None:
        await self.call("resume_scheduler", lambda c: c.resume_scheduler())

    async def is_paused(self) -> bool:
        return bool(await self.call_consensus("is_scheduler_paused", lambda c: c.is_scheduler_paused()))

    async def sleep(self, level: int, mode: str) -> None:
        await self.call("sleep", lambda c: c.sleep(level, mode))
        self.record_sleep_state(1, level)

    async def wake_up(self, tags: list[str] | None) -> bool:
        results = await self.call_all("wake_up", lambda c: c.wake_up(tags))
        fully_awake = all(results) if self.profile.dp_combines_answers else bool(results[0])
        if fully_awake or not self.profile.wake_records_awake_only_when_fully_awake:
            self.record_sleep_state(0, 0)
        return fully_awake

    async def is_sleeping(self) -> bool:
        return bool(await self.call_consensus("is_sleeping", lambda c: c.is_sleeping()))

    async def release_kv_cache_memory(self) -> None:
        await self.call("release_kv_cache_memory", lambda c: c.release_kv_cache_memory())
        self.record_sleep_state(1, 0)

    async def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        results = await self.call_all(
            "reset_prefix_cache", lambda c: c.reset_prefix_cache(reset_running_requests)
        )
        return all(results) if self.profile.dp_combines_answers else bool(results[0])

    async def collective_rpc(
        self, method: str, timeout: float | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        return list(
            await self.call("collective_rpc", lambda c: c.collective_rpc(method, timeout, args, kwargs))
        )

    async def set_weight_version(self, version: str) -> None:
        await self.call("set_weight_version", lambda c: c.set_weight_version(version))

    async def get_weight_version(self) -> str:
        return str(await self.call_consensus("get_weight_version", lambda c: c.get_weight_version()))

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        per_engine = await self.call_all("compute_weight_checksums", lambda c: c.compute_weight_checksums())
        return [worker for engine in per_engine for worker in engine]

    # --- requests --------------------------------------------------------------------------------

    def _choose(self) -> EngineCore:
        """The least loaded engine, ties rotated (DPLBAsyncMPClient.get_core_engine_for_request)."""
        start = self._next % len(self.cores)
        self._next += 1
        order = self.cores[start:] + self.cores[:start]
        return min(order, key=lambda c: len(c.scheduler.waiting) * 4 + len(c.scheduler.running))

    async def generate(self, req: Request) -> Request:
        self._alive()
        core = self._choose()
        self.tracked[req.request_id] = req
        try:
            core.add_request(req)
            await req.done.wait()
        except asyncio.CancelledError:  # the client went away: vLLM aborts the request
            core.abort_requests({req.request_id})
            raise
        finally:
            self.tracked.pop(req.request_id, None)
        if req.error is not None:
            raise req.error
        return req

    def abort(self, external_ids: list[str] | None) -> int:
        """/abort_requests: the given (client) ids, or every tracked request."""
        if external_ids:
            wanted = {r.request_id for r in self.tracked.values() if r.external_id in set(external_ids)}
            count = len(external_ids)
        else:
            wanted = set(self.tracked)
            count = len(wanted)
        for core in self.cores:
            with contextlib.suppress(Exception):
                core.abort_requests(wanted)
        return count
