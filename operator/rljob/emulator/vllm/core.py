"""One vLLM engine core (one per DP rank): its busy loop, which steps the scheduler and runs utility
calls one at a time between steps, and the utility methods the RL routes reach (rows of
docs/vllm-conformance.md).

- Utility calls run inline in the busy loop, one at a time; an exception becomes
  "Call to {method} method failed: …" (V-ROUTE-ERRORS). A call that blocks (an NCCL init waiting for the
  trainer) stops stepping and holds every other utility call behind it (V-HANG).
- A pause that must wait for running requests returns a future completed from the idle callback when
  the core has no work left (V-DRAIN-TIMING); the busy loop meanwhile serves other calls.
- Every step is a forward: if the workers' memory is unmapped, their layers on the meta device or their
  CUDA context poisoned, the step raises and the engine core dies (V-DEATH-EXC)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

from rljob.emulator import tokens
from rljob.emulator.memory import RegionBackend
from rljob.emulator.tensor_refit import Unmodelled
from rljob.emulator.vllm.config import LaunchConfig
from rljob.emulator.vllm.errors import EngineDeadError, RetryableRequestError, UtilityError
from rljob.emulator.vllm.executor import Executor
from rljob.emulator.vllm.scheduler import BLOCK_SIZE, PauseState, Request, Scheduler
from rljob.emulator.vllm.worker import Worker

log = logging.getLogger("vllm.emulator")

PAUSE_MODES = ("abort", "wait", "keep")


class EngineCore:
    def __init__(
        self, cfg: LaunchConfig, backend: RegionBackend, dp_index: int, on_death: Callable[[str], None]
    ) -> None:
        self.cfg = cfg
        self.profile = cfg.profile
        self.dp_index = dp_index
        self.scheduler = Scheduler(
            max_num_seqs=cfg.max_num_seqs,
            kv_blocks=max(1, cfg.region_sizes["kv_cache"] // (BLOCK_SIZE * 128 * 1024)),
            cache_tokens=1 << 20,
        )
        self.worker = Worker(cfg, backend, dp_index)
        self.executor = Executor(cfg.profile, self.worker, cfg.world_size)
        self.weight_version = "default"  # 0.34 (core:161@0.34.0)
        self.reject_new_requests = False  # 0.34: set by a user pause in abort/wait mode (V-REQ-PAUSED)
        self.dead = False
        self.busy_seconds = 0.0  # emulated GPU time, for the GPU probe
        self._on_death = on_death
        self._utility_lock = asyncio.Lock()
        self._in_utility = False
        self._idle_callbacks: list[Callable[[], None]] = []
        self._pending: set[asyncio.Future[Any]] = set()
        self._tasks: set[asyncio.Future[None]] = set()
        self._work = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.ensure_future(self._busy_loop())

    def stop(self) -> None:
        """The server stopped (not vLLM: a process ends with its server): its loop and tasks end too."""
        for task in [self._loop, *self._tasks]:
            if task is not None:
                task.cancel()

    def notify(self) -> None:
        self._work.set()

    # --- the busy loop ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_requests()

    async def _busy_loop(self) -> None:
        interval = 1.0 / self.cfg.tokens_per_second if self.cfg.tokens_per_second > 0 else 0.0
        while not self.dead:
            if self._in_utility or not self.scheduler.can_step():
                self._run_idle_callbacks()
                self._work.clear()
                await self._work.wait()
                continue
            self._step(interval)
            self._run_idle_callbacks()
            await asyncio.sleep(interval)

    def _run_idle_callbacks(self) -> None:
        if self.dead or self.has_work() or not self._idle_callbacks:
            return
        callbacks, self._idle_callbacks = self._idle_callbacks, []
        for cb in callbacks:
            cb()

    def _step(self, interval: float) -> None:
        sched = self.scheduler
        sched.admit()
        if sched.pause_state == PauseState.PAUSED_ALL or not sched.running:
            return
        fault = self.worker.forward_fault()
        if fault is not None:
            self.die(fault)
            return
        for req in list(sched.running):
            if not req.computed:
                sched.prefill(req)
            self._sample(req)
        sched.publish()
        self.busy_seconds += interval * min(1.0, len(sched.running) / self.cfg.saturation_batch)

    def _sample(self, req: Request) -> None:
        worker = self.worker
        weights_id = "garbage" if worker.serves_garbage else worker.weights.id
        token = req.sampler.next_token(weights_id, req.prompt + req.output)
        req.output.append(token)
        req.versions.append(self.weight_version)
        req.weights_ids.append(weights_id)
        req.garbage = req.garbage or worker.serves_garbage
        self.scheduler.stats.generation_tokens += 1
        stop = req.sampler.stop_reason(req.output, req.max_tokens)
        if stop is not None:
            matched = stop.get("matched")
            eos = matched == tokens.EOS_TOKEN_ID and matched not in req.sampler.params.stop_token_ids
            self.scheduler.finish(req, "stop", None if eos else matched)
        elif len(req.output) >= req.max_tokens:
            self.scheduler.finish(req, "length")

    # --- requests --------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """V-REQ-PAUSED: 0.34 finishes a new request at once while a user pause rejects them."""
        if self.dead:
            req.error = EngineDeadError()
            req.done.set()
            return
        if self.reject_new_requests:
            req.status, req.finish_reason = "finished", "error"
            req.error = RetryableRequestError("Generation is paused. Please retry after it resumes.")
            req.done.set()
            return
        self.scheduler.add(req)
        self.notify()

    def abort_requests(self, request_ids: set[str]) -> None:
        """Aborts reach the busy loop through its input queue: while a utility call blocks it (V-HANG)
        they wait behind it."""
        if self._utility_lock.locked():
            task = asyncio.ensure_future(self._abort_after_utility(request_ids))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self.scheduler.finish_requests(request_ids, "abort")
        self.notify()

    async def _abort_after_utility(self, request_ids: set[str]) -> None:
        async with self._utility_lock:
            self.scheduler.finish_requests(request_ids, "abort")
            self.notify()

    # --- death (V-DEATH-EXC) ---------------------------------------------------------------------

    def die(self, reason: str) -> None:
        if self.dead:
            return
        log.error(
            "EngineCore encountered a fatal error.\nTraceback (most recent call last):\n"
            '  File "vllm/v1/engine/core.py", in run_busy_loop\n%s',
            reason,
        )
        self.dead = True
        for req in self.scheduler.all_requests():
            req.status, req.error = "finished", EngineDeadError()
            req.done.set()
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(EngineDeadError())
        self._work.set()
        self._on_death(reason)

    # --- utility calls ---------------------------------------------------------------------------

    async def utility(self, method: str, call: Callable[[], Any]) -> Any:
        """Run `call` in the busy loop, alone; a returned future (a pause that waits for idle) is
        awaited outside, as the engine core defers the utility's output until it completes."""
        async with self._utility_lock:
            if self.dead:
                raise EngineDeadError()
            self._in_utility = True
            try:
                result = call()
                if inspect.isawaitable(result) and not isinstance(result, asyncio.Future):
                    result = await result
            except (EngineDeadError, UtilityError):
                raise
            except Unmodelled as e:
                raise UtilityError(method, f"the emulator does not model {e}") from e
            except Exception as e:
                log.error("Invocation of %s method failed: %s", method, e)
                raise UtilityError(method, str(e)) from e
            finally:
                self._in_utility = False
                self.notify()
        if isinstance(result, asyncio.Future):
            try:
                result = await result
            except EngineDeadError:
                raise
            except Exception as e:
                raise UtilityError(method, str(e)) from e
        return result

    def _future(self) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending.add(fut)
        fut.add_done_callback(self._pending.discard)
        return fut

    # pause / resume (V-DRAIN-*, V-ROUTE-PAUSE, V-ROUTE-RESUME)

    def _reset_caches(self) -> None:
        ok = self.scheduler.reset_prefix_cache(reset_running_requests=True)
        if not ok and self.profile.key >= (0, 34, 0):
            raise RuntimeError("Failed to reset the KV connector cache.")

    def pause_scheduler(self, mode: str, clear_cache: bool) -> asyncio.Future[Any] | None:
        """core:1764-1811@0.26.0, core:2409-2463@0.34.0."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "abort":
            self.scheduler.finish_requests(None, "abort")
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW)
        if not self.has_work():
            if clear_cache:
                self._reset_caches()
            return None
        fut = self._future()

        def on_idle() -> None:
            try:
                if clear_cache:
                    self._reset_caches()
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)

        self._idle_callbacks.append(on_idle)
        self.notify()
        return fut

    def pause_generation(self, mode: str, clear_cache: bool) -> asyncio.Future[Any] | None:
        """0.34: a user pause in abort/wait mode also rejects new requests until a resume."""
        fut = self.pause_scheduler(mode, clear_cache)
        self.reject_new_requests = mode != "keep"
        return fut

    def resume_scheduler(self) -> None:
        """Unpauses whatever paused the scheduler, a sleep included (V-KILL-RESUME-ASLEEP)."""
        self.scheduler.set_pause_state(PauseState.UNPAUSED)
        self.reject_new_requests = False
        self.notify()

    def is_scheduler_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    # sleep / wake (V-MEM-*)

    def sleep(self, level: int, mode: str) -> asyncio.Future[Any] | None:
        """core:860-896@0.26.0, core:1090-1141@0.34.0: pause (its mode; caches cleared from level 1),
        then the executor sleeps once the pause completed."""
        pause = self.pause_scheduler(mode, clear_cache=level >= 1)
        if level < 1:
            return pause
        if pause is None:
            self.executor.sleep(level)
            return None
        fut = self._future()

        def after_pause(done: asyncio.Future[Any]) -> None:
            if fut.done():
                return
            if done.exception() is not None:
                fut.set_exception(done.exception())  # type: ignore[arg-type]
                return
            try:
                self.executor.sleep(level)
            except Exception as e:
                fut.set_exception(e)
            else:
                fut.set_result(None)

        log.info("Waiting for in-flight requests to complete before sleeping...")
        pause.add_done_callback(after_pause)
        return fut

    def wake_up(self, tags: list[str] | None) -> bool:
        """Scheduling resumes only once nothing sleeps, and then unconditionally (V-MEM-WAKE-ORDER)."""
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if tags is None or tags:
            self.executor.wake_up(tags)
        fully_awake = not self.executor.is_sleeping
        if fully_awake:
            self.resume_scheduler()
        return fully_awake

    def is_sleeping(self) -> bool:
        return self.is_scheduler_paused() or self.executor.is_sleeping

    def release_kv_cache_memory(self) -> None:
        """0.34 (core:1174-1200@0.34.0)."""
        if not (self.is_scheduler_paused() and not self.scheduler.has_requests()):
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first")
        if self.executor.is_sleeping:
            raise RuntimeError("release_kv_cache_memory() requires all executor memory to be resident")
        self._reset_caches()
        self.executor.discard(("kv_cache",))

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        ok = self.scheduler.reset_prefix_cache(reset_running_requests)
        self.notify()
        return ok

    async def collective_rpc(
        self, method: str, timeout: float | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> list[Any]:
        return await self.executor.collective_rpc(method, timeout, args, kwargs)

    # weight version and checksums (0.34)

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def get_weight_version(self) -> str:
        return self.weight_version

    def compute_weight_checksums(self) -> list[dict[str, str]]:
        return [self.executor.worker.compute_weight_checksums()]

    # state for the debug routes

    def snapshot(self) -> dict[str, Any]:
        w = self.worker
        return {
            "dp_rank": self.dp_index,
            "pause_state": self.scheduler.pause_state.value,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "sleeping_tags": sorted(self.executor.sleeping_tags),
            "executor_is_sleeping": self.executor.is_sleeping,
            "unmapped_tags": sorted(w.asleep),
            "layers_on_meta": w.on_meta,
            "cuda_error": w.cuda_error,
            "weight_update_active": w.update_active,
            "buffers_lost": w.buffers_lost,
            "host_backup_bytes": w.host_backup_bytes,
            "reject_new_requests": self.reject_new_requests,
            "weight_version": self.weight_version,
            "model_path": w.model_path,
            "in_utility": self._in_utility,
            "dead": self.dead,
            "monotonic": time.monotonic(),
        }
