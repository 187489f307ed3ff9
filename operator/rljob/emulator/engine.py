"""The emulated server's state: memory regions and their offload tags, loaded weights and version,
health, and the memory lifecycle calls (flush, release, resume) with SGLang's fatal guards."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from rljob.emulator import fatal
from rljob.emulator.config import EmulatorConfig
from rljob.emulator.memory import REGIONS, RegionBackend
from rljob.emulator.radix import PrefixCache
from rljob.emulator.scheduler import Scheduler
from rljob.emulator.weights import LoadedWeights, launch_weights

log = logging.getLogger("sglang.emulator")


class Engine:
    def __init__(self, cfg: EmulatorConfig, backend: RegionBackend) -> None:
        self.cfg = cfg
        self.profile = cfg.profile
        self.faults = cfg.faults
        self.backend = backend
        self.weights: LoadedWeights = launch_weights(cfg.model_path)
        self.weight_version = cfg.weight_version
        self.model_path = cfg.model_path
        self.served_model_name = cfg.served_model_name
        self.offload_tags: set[str] = set()
        self.status = "Up"  # Up | UnHealthy (a health check timed out)
        self.startup_time = time.time()
        self.calls: Counter[str] = Counter()  # requests received per route, for tests and debugging
        self.weight_load_seconds: dict[str, float] = {}
        self._flush_in_progress = False
        self.scheduler = Scheduler(
            tokens_per_second=cfg.tokens_per_second,
            lag_seconds=cfg.scheduler_lag_seconds,
            cache=PrefixCache(cfg.max_total_tokens),
            max_running_requests=cfg.max_running_requests,
            memory_guard=self.memory_guard,
            weights_id=lambda: (self.weights.id, self.weights.valid),
            weight_version=lambda: self.weight_version,
            zero_throughput_on_retract=self.profile.key >= (0, 5, 23),
        )

    @property
    def weight_cache_active(self) -> bool:
        return self.cfg.weight_cache_mode != "off"

    # --- guards that kill the server ------------------------------------------------------------

    def memory_guard(self) -> None:
        """A kernel that reaches an unmapped region: CUDA illegal address, server dead (contract §3.1)."""
        unmapped = [r for r in REGIONS if self.backend.is_paused(r)]
        if unmapped:
            fatal.scheduler_exception(
                "RuntimeError",
                "CUDA error: an illegal memory access was encountered "
                f"(released regions: {', '.join(unmapped)})",
            )

    def refuse_under_weight_cache(self, operation: str) -> None:
        if self.weight_cache_active:
            fatal.scheduler_exception(
                "RuntimeError",
                f"[weight_cache] {operation} is not supported while the weight cache is active "
                f"(--weight-cache-mode {self.cfg.weight_cache_mode}). Restart with --weight-cache-mode off",
            )

    def require_weights_mapped(self) -> None:
        if self.backend.is_paused("weights"):
            fatal.scheduler_exception("RuntimeError", "CUDA error: an illegal memory access was encountered")

    # --- flush / release / resume ---------------------------------------------------------------

    async def flush_cache(self, timeout: float) -> tuple[int, str]:
        if self._flush_in_progress:
            return 400, "Another flush_cache is already in progress."
        self._flush_in_progress = True
        try:
            sched = self.scheduler
            if self.profile.flush_cache_takes_timeout and timeout > 0:
                if not await sched.wait_for(sched.is_idle, timeout):
                    return 400, "Timed out waiting for idle state."
            elif not sched.is_idle():
                return 400, "Flush cache failed."
            sched.reset_cache()
            return 200, (
                "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                "waiting requests, the operation will not be performed.)"
            )
        finally:
            self._flush_in_progress = False

    def _effective(self, tag: str) -> bool:
        """Does pausing this tag unmap anything? Not without the memory saver; cuda_graph needs the env."""
        if not self.cfg.enable_memory_saver:
            return False
        return tag != "cuda_graph" or self.cfg.cuda_graph_in_memory_saver

    def _pause_region(self, tag: str) -> None:
        if not self._effective(tag):
            return
        if self.backend.is_paused(tag):
            fatal.memory_saver_exit("Cannot pause allocation that is not active")
        self.backend.pause(tag, unmap_delay_s=self.faults.release_unmap_delay_s)

    def release(self, tags: list[str]) -> None:
        """Order of the scheduler's weight_updater.release_memory_occupation (contract §2.3)."""
        if not self.scheduler.is_idle():
            fatal.scheduler_exception("AssertionError", self.profile.idle_assert_text)
        self.offload_tags.update(tags)
        if "kv_cache" in tags:
            self._pause_region("kv_cache")
            self.scheduler.reset_cache()
        if "weights" in tags:
            self.refuse_under_weight_cache("release_memory_occupation(weights)")
            if self._effective("weights") and self.backend.is_paused("weights"):
                # A second release reads the model buffers from unmapped memory before TMS gives up.
                fatal.memory_saver_exit("Cannot pause allocation that is not active")
            self._pause_region("weights")
            if self._effective("weights") and not self.cfg.enable_weights_cpu_backup:
                self.weights.lose_contents()  # sglang#6367: resume brings back addresses, not contents
        if "cuda_graph" in tags:
            self._pause_region("cuda_graph")  # graphs are captured with CPU backup

    async def resume(self, tags: list[str]) -> None:
        for tag in tags:
            if tag not in self.offload_tags:
                fatal.scheduler_exception("KeyError", repr(tag))
            self.offload_tags.remove(tag)
        oom = self.faults.resume_oom_tags.intersection(tags)
        if oom:
            log.error(
                "[torch_memory_saver.cpp] CUresult error: 2 (out of memory) file=csrc/core.cpp "
                "func=cu_mem_create (resume of %s)",
                ", ".join(sorted(oom)),
            )
            await asyncio.Event().wait()  # sgl-project/sglang#14092: the call never completes
        for tag in ("cuda_graph", "weights", "kv_cache"):
            if tag not in tags:
                continue
            if tag == "weights":
                self.refuse_under_weight_cache("resume_memory_occupation(weights)")
            if self._effective(tag):
                self.backend.resume(tag)

    # --- health ----------------------------------------------------------------------------------

    async def health_generate(self) -> int:
        """One-token generation: blocks while paused; 503 after the health timeout, marking UnHealthy."""
        sched = self.scheduler
        if not await sched.wait_for(lambda: not sched.is_pause, self.cfg.health_check_timeout):
            self.status = "UnHealthy"
            return 503
        self.memory_guard()
        self.status = "Up"
        return 200

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version
