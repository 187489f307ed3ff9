"""One DP engine's request queues as vLLM's V1 scheduler keeps them (rows of docs/vllm-conformance.md):
waiting and running requests, the pause state (V-DRAIN-*), the prefix cache and its reset (V-ROUTE-FLUSH),
preemption back to the waiting queue, and the counts `/metrics` publishes.

The engine core (`core.py`) steps it; this module holds state only and never awaits."""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from rljob.emulator import tokens
from rljob.emulator.radix import PrefixCache

BLOCK_SIZE = 16  # tokens per KV block (vLLM's CUDA default)


class PauseState(enum.Enum):
    """…/v1/core/sched/interface.py PauseState: PAUSED_NEW stops admitting waiting requests, PAUSED_ALL
    stops stepping too (sched:446-448,666@0.26.0)."""

    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"
    PAUSED_ALL = "paused_all"


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    sampler: tokens.Sampler
    external_id: str = ""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    output: list[int] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)  # the weight version that sampled each token (0.34)
    weights_ids: list[str] = field(default_factory=list)  # the loaded weights that sampled each token
    status: str = "waiting"  # waiting | running | finished
    holds_kv: bool = False
    computed: bool = False  # prefilled since it last entered the running queue
    cached_tokens: int = 0
    num_preemptions: int = 0
    garbage: bool = False  # a token was sampled from lost weights (V-KILL-L2-NO-REFIT, V-KILL-L3)
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: BaseException | None = None
    arrival: float = field(default_factory=time.monotonic)
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class Stats:
    """What one step publishes (SchedulerStats) and the counters the API server accumulates."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tokens_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, *, max_num_seqs: int, kv_blocks: int, cache_tokens: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.kv_blocks = max(1, kv_blocks)
        self.cache = PrefixCache(cache_tokens)
        self.pause_state = PauseState.UNPAUSED
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = Stats()  # counters live; gauges as last published (`publish`)

    # --- pause (V-DRAIN-*) -----------------------------------------------------------------------

    def set_pause_state(self, state: PauseState) -> None:
        self.pause_state = state

    def get_num_unfinished_requests(self) -> int:
        """sched:2289-2299@0.26.0: PAUSED_ALL counts nothing, PAUSED_NEW only the running requests."""
        if self.pause_state == PauseState.PAUSED_ALL:
            return 0
        if self.pause_state == PauseState.PAUSED_NEW:
            return len(self.running)
        return len(self.waiting) + len(self.running)

    def has_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def can_step(self) -> bool:
        """Something to schedule in this pause state: running requests, or waiting ones when unpaused."""
        if self.pause_state == PauseState.PAUSED_ALL:
            return False
        if self.pause_state == PauseState.PAUSED_NEW:
            return bool(self.running)
        return bool(self.running or self.waiting)

    # --- requests --------------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def all_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        if req.status == "finished":
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.computed:
            self.cache.insert(req.prompt + req.output)
        req.status, req.holds_kv, req.finish_reason, req.stop_reason = "finished", False, reason, stop_reason
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        req.done.set()

    def finish_requests(self, request_ids: set[str] | None, reason: str) -> list[Request]:
        """`finish_requests(None, FINISHED_ABORTED)` finishes every request, running and waiting."""
        done = [r for r in self.all_requests() if request_ids is None or r.request_id in request_ids]
        for r in done:
            self.finish(r, reason)
        return done

    def admit(self) -> list[Request]:
        """Move waiting requests to running while slots are free; only when unpaused (sched:666@0.26.0)."""
        admitted: list[Request] = []
        while (
            self.pause_state == PauseState.UNPAUSED and self.waiting and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting.popleft()
            req.status, req.holds_kv, req.computed = "running", True, False
            self.running.append(req)
            admitted.append(req)
        return admitted

    def prefill(self, req: Request) -> None:
        """The first forward of a (re)admitted request: prefix-cache lookup in whole blocks, the last
        prompt token always computed."""
        seq = req.prompt + req.output
        hit = min(self.cache.match(seq), max(0, len(seq) - 1)) // BLOCK_SIZE * BLOCK_SIZE
        if not req.output and not req.num_preemptions:
            req.cached_tokens = hit
            self.stats.prompt_tokens += len(req.prompt)
            self.stats.prompt_tokens_cached += hit
        self.stats.prefix_cache_queries += len(seq)
        self.stats.prefix_cache_hits += hit
        self.cache.insert(req.prompt)
        req.computed = True

    def preempt_running(self) -> None:
        """reset_prefix_cache(reset_running_requests=True): every running request back to the front of the
        waiting queue, its KV blocks freed, recomputed once scheduled (sched:2326-2348@0.26.0)."""
        while self.running:
            req = self.running.pop()
            req.status, req.holds_kv, req.computed = "waiting", False, False
            req.num_preemptions += 1
            self.stats.preemptions += 1
            self.waiting.appendleft(req)

    def num_used_blocks(self) -> int:
        return sum(-(-(len(r.prompt) + len(r.output)) // BLOCK_SIZE) for r in self.running if r.holds_kv)

    def reset_prefix_cache(self, reset_running_requests: bool) -> bool:
        """False while any KV block is in use (block_pool.py:761-791@0.26.0: `num_used_blocks != 1`)."""
        if reset_running_requests:
            self.preempt_running()
        if self.num_used_blocks() > 0:
            return False
        self.cache.reset()
        return True

    def publish(self) -> None:
        """The gauges a step publishes; between steps /metrics keeps the last ones (V-METRIC-PROM)."""
        self.stats.running = len(self.running)
        self.stats.waiting = len(self.waiting)
        self.stats.kv_cache_usage = min(1.0, self.num_used_blocks() / self.kv_blocks)
