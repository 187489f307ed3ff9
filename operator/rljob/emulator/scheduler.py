"""The request side of the emulated server: the tokenizer's pause gate, the model-update reader/writer
lock, the scheduler's running/waiting queues, the idle predicate (contract §3.1) and token generation.

One asyncio task per request stands in for SGLang's batch loop; the point is the observable contract
(what blocks, what aborts, when the server is idle), not batching."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rljob.emulator import tokens
from rljob.emulator.radix import PrefixCache


@dataclass
class GenRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    sample: int
    output: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight_version that produced each output token
    cached_tokens: int = 0
    phase: str = "waiting"  # waiting | running | finished (finished = still in the batch until reaped)
    holds_kv: bool = False
    aborted: bool = False
    garbage: bool = False
    finish_reason: dict[str, Any] | None = None
    started: float = field(default_factory=time.monotonic)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Counters:
    num_requests: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    # Since the last cache flush: the hit rate SGLang reports restarts with an empty radix tree.
    window_prompt_tokens: int = 0
    window_cached_tokens: int = 0


class Scheduler:
    def __init__(
        self,
        *,
        tokens_per_second: float,
        lag_seconds: float,
        cache: PrefixCache,
        max_running_requests: int,
        memory_guard: Callable[[], None],
        weights_id: Callable[[], tuple[str, bool]],
        weight_version: Callable[[], str],
        zero_throughput_on_retract: bool,
    ) -> None:
        self.tps = tokens_per_second
        self.lag = lag_seconds
        self.cache = cache
        self.max_running_requests = max_running_requests
        self._memory_guard = memory_guard  # dies when a kernel would touch released memory
        self._weights_id = weights_id
        self._weight_version = weight_version
        self._zero_throughput_on_retract = zero_throughput_on_retract
        self.requests: dict[str, GenRequest] = {}
        self.is_pause = False  # tokenizer: new requests block
        self.scheduler_paused = False  # retract / in_place: no progress
        self.pause_mode: str | None = None
        self.writer_active = False  # a refit holds the model-update writer lock
        self.in_flight = 0  # admitted requests whose client has not been answered (reader lock holders)
        self.counters = Counters()
        self._changed = asyncio.Condition()
        self._gen_events: deque[tuple[float, int]] = deque()
        self._tasks: set[asyncio.Future[None]] = set()

    # --- state change notification ---------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until `predicate()` holds; False on timeout."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait_for(predicate)
            return True
        except TimeoutError:
            return predicate()

    # --- idle predicate (contract §3.1) ----------------------------------------------------------

    def is_idle(self) -> bool:
        for r in self.requests.values():
            if r.phase != "waiting" or r.holds_kv:
                return False  # running, or finished but not yet filtered out of the batch
            if not self.scheduler_paused:
                return False  # waiting requests count unless the scheduler is paused
        return True

    # --- admission (tokenizer) -------------------------------------------------------------------

    async def admit(self) -> None:
        """New requests block while paused or while a refit holds the writer lock; they are not rejected."""
        await self.wait_for(lambda: not self.is_pause and not self.writer_active)

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        """Admission plus the model-update reader lock, held until the client has its answer."""
        await self.admit()
        self.in_flight += 1  # no await since admit() saw the gate open: nothing can slip in between
        try:
            yield
        finally:
            self.in_flight -= 1
            await self._notify()

    async def generate(
        self, prompt: list[int], max_new_tokens: int, sample: int, rid: str | None
    ) -> GenRequest:
        """Run one admitted request to completion (or abort) and return it."""
        req = GenRequest(rid or uuid.uuid4().hex, prompt, max_new_tokens, sample)
        self.requests[req.rid] = req
        self.counters.num_requests += 1
        try:
            await self._run(req)
        finally:
            req.phase, req.holds_kv = "finished", False
            self.cache.insert(req.prompt + req.output)
            req.done.set()
            asyncio.get_running_loop().call_later(self.lag, self._reap, req.rid)
        return req

    def _reap(self, rid: str) -> None:
        self.requests.pop(rid, None)
        task = asyncio.ensure_future(self._notify())
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)

    async def _run(self, req: GenRequest) -> None:
        self._prefill(req, first=True)
        await self._notify()
        while len(req.output) < req.max_new_tokens:
            await self._step_gate(req)
            if req.aborted:
                break
            if self.tps > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(req.wake.wait(), 1.0 / self.tps)
                if req.aborted:
                    break
                if self.scheduler_paused:
                    continue
            self._emit_token(req)
        req.finish_reason = (
            {"type": "abort", "message": "Abort in waiting queue" if not req.output else "Abort request"}
            if req.aborted
            else {"type": "length", "length": req.max_new_tokens}
        )

    def _prefill(self, req: GenRequest, *, first: bool) -> None:
        self._memory_guard()
        seq = req.prompt + req.output
        cached = self.cache.match(seq)
        if first:
            req.cached_tokens = cached
            c = self.counters
            c.prompt_tokens += len(req.prompt)
            c.cached_tokens += cached
            c.window_prompt_tokens += len(req.prompt)
            c.window_cached_tokens += min(cached, len(req.prompt))
        self.cache.insert(req.prompt)
        req.phase, req.holds_kv = "running", True

    async def _step_gate(self, req: GenRequest) -> None:
        """A paused scheduler makes no progress; a retracted request is re-prefilled on continue."""
        while self.scheduler_paused and not req.aborted:
            req.wake.clear()
            waiter = asyncio.ensure_future(self.wait_for(lambda: not self.scheduler_paused))
            woken = asyncio.ensure_future(req.wake.wait())
            _, pending = await asyncio.wait({waiter, woken}, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
        if not req.aborted and not req.holds_kv:
            self._prefill(req, first=False)

    def _emit_token(self, req: GenRequest) -> None:
        self._memory_guard()
        weights_id, valid = self._weights_id()
        req.output.append(tokens.next_token(weights_id, req.prompt, len(req.output), req.sample))
        req.versions.append(self._weight_version())
        req.garbage = req.garbage or not valid
        self.counters.generation_tokens += 1
        self._gen_events.append((time.monotonic(), 1))

    # --- pause / continue / abort ----------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        self.is_pause = True
        self.pause_mode = mode
        if mode == "abort":
            # Abort-all, then wait up to 1 s for the readers to leave; repeat until none is left.
            while self.in_flight > 0:
                self.abort(abort_all=True)
                await self.wait_for(lambda: self.in_flight == 0, timeout=1.0)
        else:
            self.scheduler_paused = True
            if mode == "retract":
                for r in self.requests.values():
                    if r.phase == "running":
                        r.phase, r.holds_kv = "waiting", False  # back to the queue; KV freed
                if self._zero_throughput_on_retract:
                    self._gen_events.clear()
        await self._notify()

    async def continue_generation(self) -> None:
        self.is_pause = False
        self.scheduler_paused = False
        self.pause_mode = None
        await self._notify()

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        n = 0
        for r in list(self.requests.values()):
            if r.phase == "finished" or r.aborted:
                continue
            if abort_all or (rid and r.rid.startswith(rid)):
                r.aborted = True
                r.wake.set()
                self.counters.num_aborted += 1
                n += 1
        return n

    async def writer_lock_acquire(self, abort_all: bool) -> None:
        """A refit outside a pause waits for every in-flight request (the writer lock)."""
        self.writer_active = True
        if abort_all:
            self.abort(abort_all=True)
        await self.wait_for(lambda: self.in_flight == 0)

    async def writer_lock_release(self) -> None:
        self.writer_active = False
        await self._notify()

    # --- load numbers ----------------------------------------------------------------------------

    def num_running(self) -> int:
        return sum(1 for r in self.requests.values() if r.phase == "running")

    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.phase == "waiting")

    def num_used_tokens(self) -> int:
        return sum(len(r.prompt) + len(r.output) for r in self.requests.values() if r.holds_kv)

    def gen_throughput(self, window: float = 2.0) -> float:
        now = time.monotonic()
        while self._gen_events and self._gen_events[0][0] < now - window:
            self._gen_events.popleft()
        return sum(n for _, n in self._gen_events) / window

    def cache_hit_rate(self) -> float:
        c = self.counters
        return c.window_cached_tokens / c.window_prompt_tokens if c.window_prompt_tokens else 0.0

    def utilization(self) -> float:
        return min(1.0, self.num_running() / max(1, self.max_running_requests))

    def reset_cache(self) -> None:
        self.cache.reset()
        self.counters.window_prompt_tokens = self.counters.window_cached_tokens = 0
