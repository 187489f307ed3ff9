"""Rollout statistics while Serving, into AgentState.rollout (reset at each resume); docs/profiling.md
defines each signal and its source.

- At the resume that opens rollout (`begin`, just before the stage becomes Serving) the sampler takes a
  baseline: the engine's cumulative token counters (Engine.read_counters) and the start of the GPU
  probe's busy interval.
- Every `sample_s` while Serving, and once more as a drain starts (`final_sample`, while requests still
  run): the engine's load (running and waiting requests, the last prefill batch's cache hit rate, its
  generation throughput), the counters again (their increase since the baseline) and each GPU's busy
  fraction since the previous sample. Means are weighted by the time each sample stands for.
- A signal the engine did not measure stays unset and is listed in `unmeasured` with the reason: an engine
  that measures no counters (`read_counters` is None) has no rates in its load either (`metrics_off` says
  why), so they are not read.

Rollout-only changes bump the revision at most every `report_s`, so long-polls are not woken every second
for numbers nobody waits on."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from rljob.agent.engines.base import Counter, Engine, EngineError, EngineUnreachable, LoadSample
from rljob.agent.gpu_probe import GpuProbe
from rljob.agent.state import StateStore
from rljob.api.agent import RolloutReport, Stage
from rljob.api.status import Signal, Unmeasured, UnmeasuredReason

log = logging.getLogger("rljob.agent")

# The signals an engine measures only when it measures its counters.
METRICS_SIGNALS = (Signal.CACHE_HIT_RATE, Signal.GENERATION_TOKENS_PER_SECOND, Signal.TOKEN_COUNTS)


@dataclass
class _Window:
    """The sums one rollout's report is computed from."""

    started: float  # monotonic time of the baseline
    counters: dict[Counter, float] | None  # the counters at the baseline; None: not read (yet)
    last_load: float = 0.0  # monotonic time of the previous load sample (the baseline at first)
    last_busy: float = 0.0  # monotonic time the probe's current busy interval started
    load_seconds: float = 0.0
    running_seconds: float = 0.0  # running requests x seconds
    waiting_seconds: float = 0.0
    busy_seconds: float = 0.0  # busy fraction x seconds
    busy_span: float = 0.0
    tput_sum: float = 0.0
    tput_busy: int = 0
    failed: set[str] = field(default_factory=set)


class RolloutSampler:
    def __init__(
        self,
        store: StateStore,
        engine: Engine,
        sample_s: float,
        report_s: float,
        probe: GpuProbe | None = None,
    ) -> None:
        self._store = store
        self._engine = engine
        self._probe = probe
        self._sample_s = sample_s
        self._report_s = report_s
        self._report: RolloutReport | None = None  # the report object the window below belongs to
        self._window: _Window | None = None
        self._pending: _Window | None = None  # the baseline `begin` took for the next report
        self._devices: tuple[int, str | None] | None = None  # GPU count and name, read once
        # Why the last read gave no counters (the engine measures none, or did not answer); None: it answered
        self._counters_missing: UnmeasuredReason | None = None

    async def run(self) -> None:
        while self._store.state.stage != Stage.FAILED:
            await asyncio.sleep(self._sample_s)
            if self._store.state.stage == Stage.SERVING:
                await self.sample()

    async def begin(self) -> None:
        """Called by the resume that opens rollout, after the engine's generation check and before the
        stage becomes Serving: nothing the trainer sends can have finished yet."""
        window = _Window(started=time.monotonic(), counters=await self._counters())
        await self._utilization()  # starts the probe's busy interval
        window.last_load = window.last_busy = time.monotonic()
        self._pending = window

    async def final_sample(self) -> None:
        """Called as a drain starts: a rollout shorter than the sampling period still gets its numbers."""
        if self._store.state.stage == Stage.SERVING:
            await self.sample(force=True)

    async def sample(self, force: bool = False) -> None:
        if self._store.state.stage != Stage.SERVING:
            return
        report = self._store.state.rollout
        if report is not self._report:
            self._report, self._window, self._pending = report, self._pending, None
            if self._window is None:  # the agent restarted mid-rollout: measure from now on
                self._window = _Window(started=time.monotonic(), counters=None)
                self._window.last_load = self._window.last_busy = self._window.started
            await self._describe_devices(report)
        window = self._window
        assert window is not None
        try:
            load = await self._engine.read_load()
        except (EngineError, EngineUnreachable, TimeoutError):
            return  # death is the watch's business
        counters = await self._counters()
        busy = await self._utilization()
        if self._store.state.stage != Stage.SERVING or self._store.state.rollout is not report:
            return
        now = time.monotonic()
        report.samples += 1
        report.window_seconds = round(now - window.started, 6)
        if self._counters_missing == UnmeasuredReason.METRICS_DISABLED:
            # an engine that measures no counters measures no rates either (Engine.metrics_off)
            report.cache_hit_rate = report.generation_tokens_per_second = None
        else:
            self._rates(report, window, load)
        self._queue(report, window, load, now)
        self._increase(report, window, counters)
        report.unmeasured = self._unmeasured(
            report, self._counters_missing, self._engine.name, self._engine.metrics_off
        )
        if busy is not None:
            window.busy_seconds += busy * (now - window.last_busy)
            window.busy_span += now - window.last_busy
            if window.busy_span > 0:
                report.gpu_busy_fraction = round(min(1.0, window.busy_seconds / window.busy_span), 6)
        window.last_busy = now
        if force or report.samples == 1 or time.monotonic() - self._store.last_commit >= self._report_s:
            self._store.commit()

    # --- the parts of a sample -----------------------------------------------------------------------

    @staticmethod
    def _rates(report: RolloutReport, window: _Window, load: LoadSample) -> None:
        """The load's last-prefill-batch cache hit rate and its generation throughput (averaged over the
        busy samples: idle tails say nothing)."""
        if load.cache_hit_rate is not None:
            report.cache_hit_rate = min(1.0, max(0.0, load.cache_hit_rate))
        tput = load.gen_throughput
        if tput is not None and tput > 0:
            window.tput_sum += tput
            window.tput_busy += 1
            report.generation_tokens_per_second = window.tput_sum / window.tput_busy

    @staticmethod
    def _unmeasured(
        report: RolloutReport,
        counters_missing: UnmeasuredReason | None,
        engine: str = "the engine",
        metrics_off: str = "the engine measures no counters",
    ) -> list[Unmeasured]:
        """The engine's signals this report leaves unset, and why. A rate the load gave while the counters
        did not answer is still the engine's measurement; only the counters are then missing."""
        if counters_missing == UnmeasuredReason.METRICS_DISABLED:
            return [
                Unmeasured(signal=signal, reason=counters_missing, message=metrics_off)
                for signal in METRICS_SIGNALS
            ]
        if report.prompt_tokens is not None:
            return []
        if counters_missing == UnmeasuredReason.METRICS_UNANSWERED:
            message = f"{engine}'s metrics did not answer during the rollout"
        else:
            message = "no counter baseline: the agent started during this rollout"
        return [
            Unmeasured(
                signal=Signal.TOKEN_COUNTS,
                reason=counters_missing or UnmeasuredReason.NOT_REPORTED,
                message=message,
            )
        ]

    @staticmethod
    def _queue(report: RolloutReport, window: _Window, load: LoadSample, now: float) -> None:
        """Running and waiting requests (the engine's load, summed over DP ranks), each sample weighted by
        the time since the previous one."""
        dt, window.last_load = now - window.last_load, now
        if load.running is None or load.waiting is None or dt <= 0:
            return
        window.load_seconds += dt
        window.running_seconds += load.running * dt
        window.waiting_seconds += load.waiting * dt
        report.mean_running_requests = round(window.running_seconds / window.load_seconds, 4)
        report.mean_waiting_requests = round(window.waiting_seconds / window.load_seconds, 4)

    @staticmethod
    def _increase(report: RolloutReport, window: _Window, counters: dict[Counter, float] | None) -> None:
        """The counters' increase since the baseline (a counter absent is 0)."""
        if counters is None:
            return
        if window.counters is None:  # no baseline (the agent restarted mid-rollout): start here
            window.counters = counters
            return
        for counter in Counter:
            increase = counters.get(counter, 0.0) - window.counters.get(counter, 0.0)
            setattr(report, counter.value, max(0, round(increase)))

    async def _counters(self) -> dict[Counter, float] | None:
        """The engine's counters, or None when it measures none or did not answer; `_counters_missing` says
        which."""
        try:
            counters = await self._engine.read_counters()
        except (EngineError, EngineUnreachable, TimeoutError):
            self._counters_missing = UnmeasuredReason.METRICS_UNANSWERED
            return None
        self._counters_missing = UnmeasuredReason.METRICS_DISABLED if counters is None else None
        return counters

    async def _utilization(self) -> float | None:
        """Mean busy fraction over the pod's GPUs since the probe's previous call."""
        if self._probe is None:
            return None
        try:
            per_gpu = await self._probe.utilization()
        except Exception as e:  # NVML errors have no common base worth naming; the probe's, not ours
            log.debug("GPU busy not read: %s: %s", e.__class__.__name__, e)
            return None
        if not per_gpu:
            return None
        return sum(per_gpu) / len(per_gpu)

    async def _describe_devices(self, report: RolloutReport) -> None:
        """GPU count and name (for the decode roofline's bandwidth) and the engine's TP size, once per
        agent."""
        if self._devices is None and self._probe is not None:
            try:
                gpus = await self._probe.sample()
                self._devices = (len(gpus), next((g.name for g in gpus if g.name), None))
            except Exception as e:  # as in _utilization
                log.debug("GPUs not described: %s: %s", e.__class__.__name__, e)
        if self._devices is not None:
            report.gpus, report.gpu_name = self._devices
        facts = self._store.facts
        report.tp_size = facts.tp_size if facts is not None else None
