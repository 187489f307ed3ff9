"""The emulated server's state and its control plane: the tokenizer, one scheduler per DP rank, memory
regions and their offload tags, loaded weights and version, health, and the memory lifecycle calls (pause,
flush, release, resume) with SGLang's fatal guards. Row IDs are those of docs/sglang-conformance.md."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rljob.emulator import fatal
from rljob.emulator.config import EmulatorConfig
from rljob.emulator.memory import REGIONS, RegionBackend
from rljob.emulator.parameters import Loaded, Parameters, checkpoint_of
from rljob.emulator.radix import PrefixCache
from rljob.emulator.scheduler import Scheduler, Tokenizer
from rljob.emulator.tensor_refit import set_ipc_stand_in_dir
from rljob.emulator.weights import LoadedWeights, launch_weights
from rljob.trainer.engines.sglang.digest import ModelLayout

if TYPE_CHECKING:
    from rljob.emulator.nodes import NodeLink

log = logging.getLogger("sglang.emulator")

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
Reply = tuple[float, bool, str | None]  # (arrival, success, message) of one DP rank


class Engine:
    def __init__(self, cfg: EmulatorConfig, backend: RegionBackend) -> None:
        self.cfg = cfg
        self.profile = cfg.profile
        self.faults = cfg.faults
        self.backend = backend
        self.weights, launched = launch_weights(cfg.model_path)
        # What the parameters hold (/weights_checker) and how names map to them: the launch checkpoint's, then
        # the last disk load's layout; the launch state is kept for the refit_loads_launch fault.
        self.layout: ModelLayout = checkpoint_of(cfg.model_path)
        self.parameters = Parameters()
        self.parameters.replace(launched, self.layout)
        self._launched = (LoadedWeights(**vars(self.weights)), Parameters())
        self._launched[1].copy_from(self.parameters)
        set_ipc_stand_in_dir(cfg.ipc_stand_in_dir)
        self.weight_version = cfg.weight_version
        self.model_path = cfg.model_path
        self.served_model_name = cfg.served_model_name
        self.offload_tags: set[str] = set()
        self.status = "Up"  # Up | UnHealthy (a health check timed out)
        self.scheduler_dead = False  # 0.5.6 zombie: the scheduler process is gone, HTTP is up (C-DEATH-HARD)
        self.startup_time = time.time()
        self.calls: Counter[str] = Counter()  # requests received per route, for tests and debugging
        self.weight_load_seconds: dict[str, float] = {}
        self.tokenizer = Tokenizer()
        self.ranks = [
            Scheduler(
                dp_rank=dp_rank,
                idle_predicate=self.profile.idle_predicate,
                tokens_per_second=cfg.tokens_per_second,
                cache=PrefixCache(cfg.max_total_tokens),
                max_running_requests=cfg.max_running_requests,
                memory_guard=self.memory_guard,
                weights_id=lambda: (self.weights.id, self.weights.valid),
                weight_version=lambda: self.weight_version,
                retract_zeroes_throughput=self.profile.retract_zeroes_gen_throughput,
                tokenizer=self.tokenizer,
                saturation_batch=cfg.saturation_batch,
            )
            for dp_rank in range(cfg.dp_size)
        ]
        self._round_robin = 0
        self._get_load: asyncio.Future[list[dict[str, Any]]] | None = None
        self._tasks: set[asyncio.Future[None]] = set()
        # With --nnodes > 1 on node 0: the other nodes' ranks, reached as SGLang's TP broadcast does.
        self.nodes: NodeLink | None = None

    def gpu_busy_seconds(self, gpu: int) -> float:
        """GPU time the emulated decode cost on `gpu`: each DP rank runs on tp_size GPUs of its own."""
        per_rank = max(1, self.cfg.gpus // len(self.ranks))
        return self.ranks[min(gpu // per_rank, len(self.ranks) - 1)].busy_seconds

    @property
    def scheduler(self) -> Scheduler:
        """DP rank 0: with --dp-size 1 (the default) the only scheduler."""
        return self.ranks[0]

    @property
    def weight_cache_active(self) -> bool:
        return self.cfg.weight_cache_mode != "off"

    # --- guards that kill the server ------------------------------------------------------------

    def memory_guard(self) -> None:
        """A kernel that reaches an unmapped region: CUDA illegal address, server dead."""
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

    def kill_scheduler(self, reason: str) -> None:
        """The scheduler process exits without a Python exception (C-DEATH-HARD): the server exits where a
        watchdog sees it (≥0.5.10); on 0.5.6 every rank stops for good and HTTP stays up."""
        fatal.scheduler_process_exit(reason, watchdog=self.profile.subprocess_watchdog, zombie=self._zombie)

    def _zombie(self) -> None:
        self.scheduler_dead = True
        for rank in self.ranks:
            rank.blocked = True  # nothing generates, nothing answers
            rank.update_busy()  # nor keeps a GPU busy

    def _memory_saver_exit(self, message: str) -> None:
        """torch_memory_saver calls exit(1) in the scheduler (C-MEM-DOUBLE-RELEASE)."""
        fatal.memory_saver_message(message)
        self.kill_scheduler(f"torch_memory_saver: {message}")
        raise fatal.SchedulerDied(message)

    # --- the control plane: messages to the schedulers ------------------------------------------

    async def _alive(self) -> None:
        if self.scheduler_dead:
            await asyncio.Event().wait()  # no scheduler will ever answer

    @contextlib.asynccontextmanager
    async def inboxes(self, *, block: bool = False) -> AsyncIterator[list[Scheduler]]:
        """One control message fanned out to every DP rank, processed once every rank's inbox is free, and
        answered once every rank replied (C-DP-FANOUT). `block`: the ranks' event loops are stuck meanwhile
        (nothing generates, C-REFIT-GROUP-BLOCK)."""
        async with contextlib.AsyncExitStack() as stack:
            for rank in self.ranks:
                await stack.enter_async_context(rank.inbox)
            await self._alive()
            if block:
                for rank in self.ranks:
                    await rank.set_blocked(True)
            try:
                yield self.ranks
            finally:
                if block and not self.scheduler_dead:
                    for rank in self.ranks:
                        await rank.set_blocked(False)
        self.tokenizer.received()  # control replies are scheduler output too (C-HEALTH-GENERATE)

    @contextlib.asynccontextmanager
    async def control(self, route: str, *, block: bool = False) -> AsyncIterator[list[Scheduler]]:
        """A control route: its tokenizer communicator (FIFO per route), then the schedulers."""
        async with self.tokenizer.communicator(route), self.inboxes(block=block) as ranks:
            yield ranks

    def post(self, message: Callable[[Scheduler], Awaitable[None]]) -> None:
        """A message whose HTTP reply comes once it is sent, not once it is processed (pause, continue,
        C-DRAIN-RETRACT). Delivered in order with the other control messages."""

        async def deliver() -> None:
            async with self.inboxes() as ranks:
                for rank in ranks:
                    await message(rank)

        task = asyncio.ensure_future(deliver())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def dispatch(self, dp_rank: int | None) -> Scheduler:
        """The DP controller: the request's routed rank, else round robin (load_balance_method default;
        …/managers/data_parallel_controller.py:466-474@0.5.6)."""
        if dp_rank is not None:
            return self.ranks[dp_rank]
        rank = self.ranks[self._round_robin % len(self.ranks)]
        self._round_robin += 1
        return rank

    # --- pause / continue / abort (C-DRAIN-*) ----------------------------------------------------

    async def pause(self, mode: str) -> None:
        """C-DRAIN-TIMING: under `is_pause_cond`. Abort is tokenizer-only (the scheduler is not paused):
        send abort-all, then if the model-update lock has a reader or the writer, sleep 1 s and repeat.
        So it answers at once with nothing in flight, else after a whole number of seconds (≥ 1)."""
        tok = self.tokenizer
        async with tok.pause_cond:
            tok.is_pause, tok.pause_mode = True, mode
            if mode == "abort":
                while True:
                    self.abort(abort_all=True)
                    if not tok.model_update_locked():
                        break
                    await asyncio.sleep(1.0)
            else:
                self.post(lambda rank: rank.pause(mode))
        await tok.changes.notify()

    async def continue_generation(self) -> None:
        """Waits for `is_pause_cond`, so it waits for an abort drain in progress (C-DRAIN-TIMING)."""
        tok = self.tokenizer
        async with tok.pause_cond:
            tok.is_pause, tok.pause_mode = False, None
            self.post(lambda rank: rank.continue_generation())
        await tok.changes.notify()

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        """AbortReq goes to every DP rank; no reply is awaited."""
        return sum(rank.abort(rid=rid, abort_all=abort_all) for rank in self.ranks)

    # --- flush (C-ROUTE-FLUSH, C-IDLE-FLUSH, C-IDLE-FLUSH-DEFERRED, C-DP-FLUSH-FIRST) -------------

    async def flush_cache(self, timeout: float) -> tuple[int, str]:
        """Every rank flushes if it is idle; the reply is the first rank's answer to arrive
        (…/managers/tokenizer_communicator_mixin.py:307-308@0.5.6, tokenizer_control_mixin.py:325-333
        @0.5.23). A second flush waits in the communicator behind a deferred one."""
        async with self.tokenizer.communicator("flush_cache"):
            replies = await asyncio.gather(*(self._flush_rank(rank, timeout) for rank in self.ranks))
        self.tokenizer.received()
        _, ok, message = min(replies, key=lambda r: r[0])
        if ok:
            return 200, FLUSHED
        if not self.profile.flush_cache_takes_timeout:
            return 400, FLUSHED  # 0.5.6 answers the success text with 400 (http_server.py:659-667@0.5.6)
        return 400, message or "Flush cache failed.\n"  # http_server.py:862-877@0.5.15.post1

    async def _flush_rank(self, rank: Scheduler, timeout: float) -> Reply:
        """SchedulerFlushWrapper (…/managers/scheduler_components/flush_wrapper.py:21-62@0.5.23): timeout 0
        is the plain flush with the version's predicate; a deferred one flushes at once if is_fully_idle(),
        else it is parked and re-checked (is_fully_idle(): waiting requests count, paused or not) after
        inbox passes until the deadline."""
        async with rank.inbox:
            await self._alive()
            if timeout <= 0 or rank.is_fully_idle():
                return time.monotonic(), rank.flush_cache(), None
        deadline = time.monotonic() + timeout
        while True:
            await rank.wait_for(rank.is_fully_idle, max(0.0, deadline - time.monotonic()))
            async with rank.inbox:
                await self._alive()
                if rank.is_fully_idle():
                    return time.monotonic(), rank.flush_cache(), None
                if time.monotonic() >= deadline:
                    log.warning("Deferred flush_cache timed out while waiting for idle state.")
                    return time.monotonic(), False, "Timed out waiting for idle state."

    def post_refit_flush(self, ranks: list[Scheduler]) -> bool:
        """flush_cache_after_weight_update on every rank, with the version's non-deferred predicate
        (C-REFIT-FLUSH-FAIL, C-REFIT-FLUSH-RETRACT)."""
        return all([rank.flush_cache() for rank in ranks])  # every rank flushes what it can

    # --- release / resume (C-IDLE-RELEASE, C-MEM-*, C-DP-RELEASE-ALL) ----------------------------

    def _effective(self, tag: str) -> bool:
        """Does pausing this tag unmap anything? Not without the memory saver; cuda_graph needs the env."""
        if not self.cfg.enable_memory_saver:
            return False
        return tag != "cuda_graph" or self.cfg.cuda_graph_in_memory_saver

    def _pause_region(self, tag: str) -> None:
        if not self._effective(tag):
            return
        if self.backend.is_paused(tag):
            self._memory_saver_exit("Cannot pause allocation that is not active.")
        self.backend.pause(tag, unmap_delay_s=self.faults.release_unmap_delay_s)

    async def release(self, tags: list[str] | None) -> None:
        """Order of release_memory_occupation (…/managers/scheduler_update_weights_mixin.py:110-143@0.5.6,
        …/managers/scheduler_components/weight_updater.py:337-381@0.5.23), on every DP rank: each asserts
        idleness, so one busy rank kills the server."""
        async with self.control("release_memory_occupation") as ranks:
            for rank in ranks:
                if not rank.is_idle():
                    fatal.scheduler_exception("AssertionError", self.profile.idle_assert_text)
            tags = tags or list(REGIONS)
            self.offload_tags.update(tags)  # a set: a repeated tag is paused once (C-MEM-DUP-TAG-RELEASE)
            if "kv_cache" in tags:
                self._pause_region("kv_cache")
                for rank in ranks:
                    rank.reset_cache()
            if "weights" in tags:
                self.refuse_under_weight_cache("release_memory_occupation(weights)")
                self._pause_region("weights")
                if self._effective("weights") and not self.cfg.enable_weights_cpu_backup:
                    self.weights.lose_contents()  # sglang#6367: resume brings back addresses, not contents
                    self.parameters.lose_contents()
            if "cuda_graph" in tags:
                self._pause_region("cuda_graph")  # graphs are captured with CPU backup
            if self.nodes is not None:  # every node's ranks release theirs (C-NODE, C-TP-REPLY)
                await self.nodes.broadcast("release", tags=list(dict.fromkeys(tags)))

    async def resume(self, tags: list[str] | None) -> None:
        """Tags are removed from offload_tags one by one: a tag never released, or repeated in the list,
        raises KeyError in the scheduler (C-MEM-RESUME-UNRELEASED)."""
        async with self.control("resume_memory_occupation") as ranks:
            tags = tags or list(REGIONS)
            for tag in tags:
                if tag not in self.offload_tags:
                    fatal.scheduler_exception("KeyError", repr(tag))
                self.offload_tags.remove(tag)
            mapped = [t for t in tags if self._effective(t)]
            oom = self.faults.resume_oom_tags.intersection(tags)
            if not oom and not self.backend.resume_fits(mapped):
                oom = set(mapped)  # another process holds the memory the regions need
            if oom:
                # C-MEM-RESUME-OOM: torch_memory_saver cannot map the region again and exits the scheduler
                # process with code 1 (seen on an H100 at 0.5.15.post1, tests/gpu/RESULTS.md): a death the
                # watchdog sees (≥0.5.10); 0.5.6's HTTP stays up and the call never completes (sglang#14092).
                fatal.memory_saver_message(
                    "cuMemCreate CUDA_ERROR_OUT_OF_MEMORY (may not be an issue e.g. torch allocator will "
                    f"free cache and retry) (resume of {', '.join(sorted(oom))})"
                )
                fatal.memory_saver_message(
                    "cudaError error: 2 (out of memory)  file=csrc/core.cpp func=resume line=243"
                )
                self.kill_scheduler("torch_memory_saver resume: out of memory")
                for rank in ranks:
                    await rank.set_blocked(True)
                await asyncio.Event().wait()
            for tag in ("cuda_graph", "weights", "kv_cache"):
                if tag not in tags:
                    continue
                if tag == "weights":
                    self.refuse_under_weight_cache("resume_memory_occupation(weights)")
                if self._effective(tag):
                    self.backend.resume(tag)
            if self.nodes is not None:
                await self.nodes.broadcast("resume", tags=tags)

    # --- health (C-HEALTH-GENERATE, C-HEALTH-RELEASED) -------------------------------------------

    async def health_generate(self) -> int:
        """`/health`: submit a 1-token probe, then poll until any scheduler output arrived after the start
        (control replies count); none within the health timeout: 503 and UnHealthy
        (…/entrypoints/http_server.py:721-800@0.5.23, http_server.py:409-484@0.5.6)."""
        tok, timeout = self.tokenizer, self.cfg.health_check_timeout
        tic = time.time()
        probe = asyncio.ensure_future(self._health_probe())
        try:
            while time.time() < tic + timeout:
                await asyncio.sleep(min(self.cfg.health_poll_seconds, max(0.0, tic + timeout - time.time())))
                if tok.last_receive_tstamp > tic:
                    self.status = "Up"
                    return 200
        finally:
            probe.cancel()
        log.error(
            "Health check failed. Server couldn't get a response from detokenizer for last %gs", timeout
        )
        self.status = "UnHealthy"
        return 503

    async def _health_probe(self) -> None:
        await self.tokenizer.admit()  # blocks while paused (is_pause_cond)
        rank = self.dispatch(None)
        if rank.blocked:
            await rank.wait_for(lambda: not rank.blocked)
        if rank.num_running() > 0:
            return  # dropped: the running requests' output says the scheduler is alive
        if self.profile.health_skips_when_released and self.offload_tags:
            return  # dropped while any tag is released (scheduler.py:1173-1181@0.5.6)
        self.memory_guard()  # a real one-token generate: it touches the weights and KV cache
        self.tokenizer.received()

    # --- load (C-METRIC-LOAD-ROUTE) --------------------------------------------------------------

    async def get_load(self) -> list[dict[str, Any]]:
        """0.5.6 `/get_load`: a watching call, concurrent callers share the one in flight
        (tokenizer_communicator_mixin.py:120-132@0.5.6)."""
        if self._get_load is None or self._get_load.done():
            self._get_load = asyncio.ensure_future(self._fetch_load())
        return await asyncio.shield(self._get_load)

    async def _fetch_load(self) -> list[dict[str, Any]]:
        async with self.inboxes() as ranks:
            return [
                {
                    "dp_rank": r.dp_rank,
                    "num_reqs": r.num_running() + r.num_waiting(),
                    "num_waiting_reqs": r.num_waiting(),
                    "num_tokens": r.num_used_tokens() + r.num_waiting_tokens(),
                }
                for r in ranks
            ]

    # --- weights ---------------------------------------------------------------------------------

    def load_parameters(
        self, tensors: list[Loaded], *, replace: bool, layout: ModelLayout | None = None
    ) -> bool:
        """Tensors a refit loads into the parameters (a whole checkpoint with `replace`), unless a fault keeps
        other weights: False then (the refit still answers success)."""
        faults = self.faults
        if faults.refit_loads_launch:
            weights, params = self._launched
            self.weights = LoadedWeights(**vars(weights))
            self.parameters.copy_from(params)
            return False
        if faults.refit_noop:
            return False
        if faults.refit_store_as:
            tensors = self.parameters.rename(faults.refit_store_as, tensors)
        if replace:
            self.layout = layout or self.layout
            self.parameters.replace(tensors, self.layout)
        else:
            self.parameters.write(tensors, self.layout)
        return True

    # --- version ---------------------------------------------------------------------------------

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version
