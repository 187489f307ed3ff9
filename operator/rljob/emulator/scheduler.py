"""The request side of the emulated server, split as SGLang splits it (row IDs of docs/sglang-conformance.md):

- `Tokenizer`: one per server. The pause gate (`is_pause`), the model-update reader/writer lock, the
  per-route control communicators (FIFO, C-DP-FANOUT) and the request counters of /metrics.
- `Scheduler`: one per data-parallel rank (`--dp-size N`, C-DP-FANOUT). Its running/waiting requests,
  `_engine_paused` (retract / in_place), its radix cache, its control inbox (one control message at a
  time; a blocked inbox stalls generation too, C-REFIT-GROUP-BLOCK), the three idle predicates
  (C-IDLE-FLUSH) and its load numbers (C-METRIC-*).

One asyncio task per request stands in for SGLang's batch loop; the point is the observable contract
(what blocks, what aborts, when a rank is idle), not batching. What the profile reads (docs/profiling.md)
follows a simple model of one rank's GPUs: at most --max-running-requests run, the rest wait in the queue
(SGLang's scheduler admits no more, …/managers/schedule_policy.py); up to `saturation_batch` running
requests each decode at `tokens_per_second`, beyond it they share that capacity, and the GPUs are busy
for the fraction of it in use: `busy_seconds` integrates min(1, running / saturation_batch) over time
(0 while the scheduler is paused or blocked), so busy falls as batches shrink."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from rljob.emulator import tokens
from rljob.emulator.radix import PrefixCache
from rljob.emulator.versions import IDLE_IGNORES_WAITING, IDLE_IGNORES_WAITING_WHEN_PAUSED, IDLE_STRICT

# An abort's finish_reason (C-GEN-FINISH). A request still in the waiting queue (never admitted, or
# retracted) is popped by the scheduler, which sends AbortReq(rid) back; the tokenizer writes a reason of two
# keys (…/managers/scheduler.py:3892-3899@0.5.15.post1; …/managers/tokenizer_manager.py:2042-2046@0.5.6,
# tokenizer_manager.py:2714-2718@0.5.15.post1, tokenizer_manager.py:3596@0.5.23).
ABORT_WAITING: dict[str, Any] = {"type": "abort", "message": "Abort in waiting queue"}


def abort_running() -> dict[str, Any]:
    """A running request gets `to_finish = FINISH_ABORT()`, whose to_json has four keys: no status code and
    no error type (…/managers/scheduler.py:2424@0.5.6, …/managers/schedule_batch.py:158-171@0.5.6;
    scheduler.py:3991@0.5.15.post1, schedule_batch.py:202-215@0.5.15.post1; scheduler.py:5370@0.5.20,
    schedule_batch.py:312-325@0.5.20; scheduler.py:5584@0.5.21; scheduler.py:5812@0.5.23,
    schedule_batch.py:332-345@0.5.23). 0.5.23's timeout abort (message + 503, scheduler.py:5806-5810) is
    not emulated."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass
class GenRequest:
    rid: str
    prompt: list[int]
    max_new_tokens: int
    sampler: tokens.Sampler
    dp_rank: int = 0
    output: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # weight_version that produced each output token
    weights_ids: list[str] = field(default_factory=list)  # the loaded weights that produced each token
    on_token: Callable[[GenRequest], None] | None = None  # streaming: called after each emitted token
    cached_tokens: int = 0
    retractions: int = 0  # times a retract pause sent it back to the queue
    phase: str = "waiting"  # waiting | running | finished (then already out of the scheduler)
    holds_kv: bool = False
    prefilled: bool = False
    aborted: bool = False
    garbage: bool = False
    finish_reason: dict[str, Any] | None = None
    abort_reason: dict[str, Any] | None = None  # set by Scheduler.abort from where the request was
    started: float = field(default_factory=time.monotonic)
    forward_at: float = 0.0  # monotonic: first prefill (SGLang's forward_entry_time)
    prefill_done_at: float = 0.0  # monotonic: first token drawn (prefill_finished_time)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Counters:
    """The tokenizer's Prometheus counters, bumped when a request finishes (observe_one_finished_request,
    …/observability/metrics_collector.py:1639-1675@0.5.15.post1)."""

    num_requests: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0


class _Changes:
    """A condition to wait on a predicate over state that handlers change."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()

    async def notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until `predicate()` holds; False on timeout."""
        try:
            async with asyncio.timeout(timeout), self._cond:
                await self._cond.wait_for(predicate)
            return True
        except TimeoutError:
            return predicate()


class Tokenizer:
    def __init__(self) -> None:
        self.is_pause = False  # new requests block (C-DRAIN-*)
        self.pause_mode: str | None = None
        self.writer_active = False  # a refit holds the model-update writer lock (C-REFIT-LOCK)
        self.in_flight = 0  # admitted requests whose client has not been answered (reader lock holders)
        self.counters = Counters()
        self.last_receive_tstamp = 0.0  # wall time of the last scheduler output (C-HEALTH-GENERATE)
        self.changes = _Changes()
        self._communicators: dict[str, asyncio.Lock] = {}
        # `is_pause_cond`'s lock: held by pause (an abort drain keeps it for the whole loop) and continue;
        # a refit takes it to read is_pause (C-DRAIN-TIMING)
        self.pause_cond = asyncio.Lock()

    def model_update_locked(self) -> bool:
        """`model_update_lock.is_locked()`: a reader (an unanswered generate) or the writer (a refit)."""
        return self.in_flight > 0 or self.writer_active

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        return await self.changes.wait_for(predicate, timeout)

    def communicator(self, route: str) -> asyncio.Lock:
        """Calls to one control route are serialized FIFO (queueing_call, …/managers/communicator.py:38-58
        @0.5.15.post1, …/managers/tokenizer_communicator_mixin.py:98-118@0.5.6)."""
        return self._communicators.setdefault(route, asyncio.Lock())

    def received(self) -> None:
        self.last_receive_tstamp = time.time()

    def finished(self, req: GenRequest) -> None:
        c = self.counters
        c.num_requests += 1
        c.prompt_tokens += len(req.prompt)
        c.generation_tokens += len(req.output)
        c.cached_tokens += req.cached_tokens
        c.num_aborted += int(req.aborted)

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
            await self.changes.notify()

    async def writer_lock_acquire(self, abort_all: Callable[[], None] | None) -> None:
        """A refit outside a pause waits for every in-flight request (the writer lock)."""
        self.writer_active = True
        if abort_all is not None:
            abort_all()
        await self.wait_for(lambda: self.in_flight == 0)

    async def writer_lock_release(self) -> None:
        self.writer_active = False
        await self.changes.notify()


@dataclass(frozen=True)
class LoadCounts:
    """One rank's request and token counts, as its load snapshot carries them."""

    running: int
    waiting: int
    waiting_tokens: int
    used_tokens: int


class Scheduler:
    def __init__(
        self,
        *,
        dp_rank: int,
        idle_predicate: str,
        tokens_per_second: float,
        cache: PrefixCache,
        max_running_requests: int,
        memory_guard: Callable[[], None],
        weights_id: Callable[[], tuple[str, bool]],
        weight_version: Callable[[], str],
        retract_zeroes_throughput: bool,
        tokenizer: Tokenizer,
        saturation_batch: int = 64,
    ) -> None:
        self.dp_rank = dp_rank
        self.idle_predicate = idle_predicate
        self.tps = tokens_per_second
        self.cache = cache
        self.max_running_requests = max_running_requests
        self.saturation_batch = max(1, saturation_batch)
        # busy seconds up to _busy_at, and the level since (min(1, running / saturation_batch), 0 paused):
        # read from the cuda backend's thread too, so kept under a lock and never derived there
        self._busy_lock = threading.Lock()
        self._busy_integral = 0.0
        self._busy_at = time.monotonic()
        self._busy_level = 0.0
        self._memory_guard = memory_guard  # dies when a kernel would touch released memory
        self._weights_id = weights_id
        self._weight_version = weight_version
        self._retract_zeroes_throughput = retract_zeroes_throughput
        self.tokenizer = tokenizer
        self.requests: dict[str, GenRequest] = {}
        self.scheduler_paused = False  # `_engine_paused`: retract / in_place, never abort
        self.counts_at_pause: LoadCounts | None = None
        self.blocked = False  # the event loop is stuck in a control call (group init) or dead: no progress
        self.inbox = asyncio.Lock()  # one control message at a time, FIFO
        self.cache_hit_rate = 0.0  # of the last prefill batch (C-METRIC-CACHE-HIT)
        self._batch: list[int] | None = None  # [hit tokens, prompt tokens] of the batch being prefilled
        self.prefill_uncached_tokens = 0  # /v1/loads total_prefill_uncached_tokens (≥0.5.20)
        self.changes = _Changes()
        self._gen_events: deque[tuple[float, int]] = deque()
        self._tasks: set[asyncio.Future[None]] = set()

    async def _notify(self) -> None:
        await self.changes.notify()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        return await self.changes.wait_for(predicate, timeout)

    def update_busy(self) -> None:
        """Called after the running set or the paused/blocked state changed (on the event loop): close
        the busy integral at the old level, take the new one."""
        now = time.monotonic()
        level = 0.0
        if not self.scheduler_paused and not self.blocked:
            level = min(1.0, self.num_running() / self.saturation_batch)
        with self._busy_lock:
            self._busy_integral += (now - self._busy_at) * self._busy_level
            self._busy_at, self._busy_level = now, level

    @property
    def busy_seconds(self) -> float:
        """GPU time the emulated decode kept this rank's GPUs busy (the module docstring's model); safe
        from any thread."""
        with self._busy_lock:
            return self._busy_integral + (time.monotonic() - self._busy_at) * self._busy_level

    async def set_blocked(self, blocked: bool) -> None:
        self.blocked = blocked
        self.update_busy()
        await self._notify()

    # --- idle predicates (C-IDLE-FLUSH, C-IDLE-RELEASE) ------------------------------------------

    def _busy(self) -> bool:
        """Running (or holding KV). A finished request is not here: it left before its reply
        (C-IDLE-AFTER-REPLY)."""
        return any(r.phase != "waiting" or r.holds_kv for r in self.requests.values())

    def _waiting(self) -> bool:
        return any(r.phase == "waiting" for r in self.requests.values())

    def is_fully_idle(self) -> bool:
        """`is_fully_idle()` with no arguments: waiting requests always count. The deferred flush checks
        this on every version that has it (flush_wrapper.py:33,45@0.5.23)."""
        return not self._busy() and not self._waiting()

    def is_idle(self) -> bool:
        """The version's non-deferred predicate: the plain flush, the release assert, the post-refit flush."""
        if self.idle_predicate == IDLE_IGNORES_WAITING:
            return not self._busy()
        if self.idle_predicate == IDLE_STRICT:
            return self.is_fully_idle()
        assert self.idle_predicate == IDLE_IGNORES_WAITING_WHEN_PAUSED
        return not self._busy() and (self.scheduler_paused or not self._waiting())

    def flush_cache(self) -> bool:
        """The scheduler's flush_cache(): resets the radix cache only when idle."""
        if not self.is_idle():
            return False
        self.reset_cache()
        return True

    # --- requests --------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        sampler: tokens.Sampler,
        rid: str | None,
        on_token: Callable[[GenRequest], None] | None = None,
    ) -> GenRequest:
        """Run one admitted request to completion (or abort) and return it."""
        req = GenRequest(rid or uuid.uuid4().hex, prompt, max_new_tokens, sampler, dp_rank=self.dp_rank)
        req.on_token = on_token
        self.requests[req.rid] = req
        try:
            await self._run(req)
        finally:
            # Out of the scheduler before the reply leaves (C-IDLE-AFTER-REPLY): a control message sent
            # after the reply finds this rank idle unless other requests run.
            req.phase, req.holds_kv = "finished", False
            if self.requests.get(req.rid) is req:
                del self.requests[req.rid]
            self.update_busy()
            self._notify_soon()  # a slot is free for a queued request
            if req.prefilled:  # one aborted in the queue never reached the cache
                self.cache.insert(req.prompt + req.output)
            self.tokenizer.finished(req)
            self.tokenizer.received()
            req.done.set()
        return req

    def _notify_soon(self) -> None:
        task = asyncio.ensure_future(self._notify())
        self._tasks.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._tasks.discard)

    async def _run(self, req: GenRequest) -> None:
        if self.blocked:
            await self.wait_for(lambda: not self.blocked)
        await self._admission(req)
        if req.aborted:
            req.finish_reason = dict(ABORT_WAITING)
            return
        self._prefill(req, first=True)
        await self._notify()
        while len(req.output) < req.max_new_tokens:
            await self._step_gate(req)
            if req.aborted:
                break
            if self.tps > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(req.wake.wait(), 1.0 / self._per_request_tps())
                if self.blocked or (self.scheduler_paused and not req.aborted):
                    continue  # a stuck or paused scheduler emits nothing
                if req.aborted:
                    break
            self._emit_token(req)
            if (stop := req.sampler.stop_reason(req.output, req.max_new_tokens)) is not None:
                req.finish_reason = stop
                break
            if req.on_token is not None:
                req.on_token(req)
        req.finish_reason = (
            (req.abort_reason or dict(ABORT_WAITING))
            if req.aborted
            else req.finish_reason or {"type": "length", "length": req.max_new_tokens}
        )

    async def _admission(self, req: GenRequest) -> None:
        """Wait in the queue while --max-running-requests run; an abort ends the wait ("Abort in waiting
        queue")."""
        while not req.aborted and self.num_running() >= self.max_running_requests:
            req.wake.clear()
            waiter = asyncio.ensure_future(
                self.wait_for(lambda: self.num_running() < self.max_running_requests)
            )
            woken = asyncio.ensure_future(req.wake.wait())
            _, pending = await asyncio.wait({waiter, woken}, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()

    def _per_request_tps(self) -> float:
        """Each running request's decode speed: full up to the saturation batch, then a share of it."""
        return self.tps * min(1.0, self.saturation_batch / max(1, self.num_running()))

    def _prefill(self, req: GenRequest, *, first: bool) -> None:
        self._memory_guard()
        seq = req.prompt + req.output
        cached = self.cache.match(seq)
        if first:
            req.prefilled = True
            req.forward_at = time.monotonic()
            req.cached_tokens = cached
            self._log_prefill(min(cached, len(req.prompt)), len(req.prompt))
        self.cache.insert(req.prompt)
        req.phase, req.holds_kv = "running", True
        self.update_busy()
        self.tokenizer.received()

    def _log_prefill(self, hit: int, prompt: int) -> None:
        """Requests prefilled in the same loop pass form one prefill batch; cache_hit_rate is that batch's
        hit / (input + hit) (…/managers/scheduler_metrics_mixin.py:157-173@0.5.6,
        …/managers/scheduler_components/metrics_reporter.py:825-865@0.5.23). Re-prefills after a retract
        are left out, as ≥0.5.15 nets out reprocessed tokens (metrics_reporter.py:608-625@0.5.15.post1)."""
        if self._batch is None:
            self._batch = [0, 0]
            asyncio.get_running_loop().call_soon(self._close_batch)
        self.prefill_uncached_tokens += prompt - hit
        self._batch[0] += hit
        self._batch[1] += prompt
        self.cache_hit_rate = self._batch[0] / self._batch[1] if self._batch[1] else 0.0

    def _close_batch(self) -> None:
        self._batch = None

    async def _step_gate(self, req: GenRequest) -> None:
        """A paused scheduler makes no progress; a retracted request is re-prefilled on continue. A blocked
        one does not even process aborts."""
        while self.blocked or (self.scheduler_paused and not req.aborted):
            req.wake.clear()
            waiter = asyncio.ensure_future(
                self.wait_for(lambda: not self.blocked and not self.scheduler_paused)
            )
            woken = asyncio.ensure_future(req.wake.wait())
            _, pending = await asyncio.wait({waiter, woken}, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
        if not req.aborted and not req.holds_kv:
            self._prefill(req, first=False)

    def _emit_token(self, req: GenRequest) -> None:
        self._memory_guard()
        weights_id, valid = self._weights_id()
        req.output.append(req.sampler.next_token(weights_id, req.prompt + req.output))
        if not req.prefill_done_at:
            req.prefill_done_at = time.monotonic()
        req.versions.append(self._weight_version())
        req.weights_ids.append(weights_id)
        req.garbage = req.garbage or not valid
        self._gen_events.append((time.monotonic(), 1))
        self.tokenizer.received()

    # --- control messages ------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        """retract / in_place (abort never reaches the scheduler, C-DRAIN-ABORT)."""
        if not self.scheduler_paused:
            self.counts_at_pause = self.load_counts()  # the last snapshot published (C-DP-LOADS-PAUSED)
        self.scheduler_paused = True
        if mode == "retract":
            for r in self.requests.values():
                if r.phase == "running":
                    r.phase, r.holds_kv = "waiting", False  # back to the queue; KV freed
                    r.retractions += 1
            if self._retract_zeroes_throughput:
                self._gen_events.clear()
        self.update_busy()
        await self._notify()

    async def continue_generation(self) -> None:
        self.scheduler_paused = False
        self.counts_at_pause = None
        self.update_busy()
        await self._notify()

    def abort(self, *, rid: str = "", abort_all: bool = False) -> int:
        n = 0
        for r in list(self.requests.values()):
            if r.phase == "finished" or r.aborted:
                continue
            if abort_all or (rid and r.rid.startswith(rid)):
                r.aborted = True
                r.abort_reason = dict(ABORT_WAITING) if r.phase == "waiting" else abort_running()
                r.wake.set()
                n += 1
        return n

    # --- load numbers ----------------------------------------------------------------------------

    def load_counts(self) -> LoadCounts:
        return LoadCounts(
            self.num_running(), self.num_waiting(), self.num_waiting_tokens(), self.num_used_tokens()
        )

    def published_counts(self, frozen_while_paused: bool) -> LoadCounts:
        """What the load route reads: where it reads the snapshots the rank publishes from its loop, a
        paused rank shows the counts it had when it paused (C-DP-LOADS-PAUSED)."""
        if frozen_while_paused and self.scheduler_paused and self.counts_at_pause is not None:
            return self.counts_at_pause
        return self.load_counts()

    def num_running(self) -> int:
        return sum(1 for r in self.requests.values() if r.phase == "running")

    def num_waiting(self) -> int:
        return sum(1 for r in self.requests.values() if r.phase == "waiting")

    def num_used_tokens(self) -> int:
        return sum(len(r.prompt) + len(r.output) for r in self.requests.values() if r.holds_kv)

    def num_waiting_tokens(self) -> int:
        return sum(len(r.prompt) + len(r.output) for r in self.requests.values() if r.phase == "waiting")

    def gen_throughput(self, window: float = 2.0) -> float:
        now = time.monotonic()
        while self._gen_events and self._gen_events[0][0] < now - window:
            self._gen_events.popleft()
        return sum(n for _, n in self._gen_events) / window

    def reset_cache(self) -> None:
        self.cache.reset()
