"""The diagnosis: from one iteration's signals (lifecycle/signals.py), the levers worth pulling, each with
the measured reason, ranked by the share of the iteration's wall time it bears on. Pure.

The lever table is RULES below: each row names its lever, when it fires and the share it is ranked by,
beside the rule itself; every threshold is a field of Thresholds. docs/profiling.md mirrors both
(tests/unit/test_levers.py checks the mirror: `lever_table_markdown()` renders the rows).

"Train-bound" is rollout share < train_bound_share: Balanced iterations get both the trainer's and the
rollout's levers, and the shares rank them.

Each row names the signals it reads: a row whose signal was not measured (signals.unmeasured) never
fires; the Measurement lever names them instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rljob.api.status import MAX_DIAGNOSIS, IterationReport, Lever, LeverName, Signal, Unmeasured
from rljob.lifecycle import signals


@dataclass(frozen=True)
class Thresholds:
    """Every threshold of the lever table, in one place (docs/profiling.md lists the same values)."""

    rollout_bound_share: float = 0.6  # rollout / (rollout + train) above: RolloutBound (profile.py)
    train_bound_share: float = 0.4  # below: TrainBound
    idle_gpu_busy: float = 0.5  # GPU busy during rollout below: the GPUs are half idle
    saturated_gpu_busy: float = 0.8  # at or above: the GPUs are saturated
    queue_per_running: float = 0.1  # mean waiting / mean running requests above: requests queue
    low_prefix_hit: float = 0.2  # token-weighted prefix-cache hit rate below: little reuse
    min_prompt_tokens: int = 256  # fewer prompt tokens in the rollout: too few to judge reuse
    low_roofline_fraction: float = 0.3  # saturated, and tokens/s below this part of the decode roofline
    handoff_share: float = 0.15  # drain + release + refit + resume above this part of the iteration
    control_overhead_share: float = 0.03  # the operator's own time above this part of the iteration


THRESHOLDS = Thresholds()


@dataclass(frozen=True)
class _Iteration:
    """The numbers the rules read, derived once."""

    r: IterationReport
    t: Thresholds
    wall: float
    rollout: float  # rollout / wall
    share: float | None  # rollout / (rollout + train)
    queue: float | None  # mean waiting / mean running
    unmeasured: tuple[Unmeasured, ...]  # signals.unmeasured(r)

    @property
    def missing(self) -> frozenset[Signal]:
        return frozenset(entry.signal for entry in self.unmeasured)

    @property
    def train_bound(self) -> bool:
        return self.share is not None and self.share < self.t.train_bound_share

    @property
    def rollout_bound(self) -> bool:
        return self.share is not None and self.share > self.t.rollout_bound_share


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _load(i: _Iteration) -> str:
    r = i.r
    return (
        f"GPU busy {_pct(r.gpu_busy_fraction)} during rollout, {_num(r.mean_running_requests)} running and "
        f"{_num(r.mean_waiting_requests)} waiting requests on average, rollout {_pct(i.share)} of "
        "rollout+train"
    )


Rule = Callable[[_Iteration], Lever | None]


def _lever(lever: LeverName, reason: str, evidence: str = "", share: float = 0.0) -> Lever:
    """Status strings are bounded (api/status.py): cut, never refuse."""
    return Lever(
        lever=lever, reason=reason[:256], evidence=evidence[:256], share=round(min(1.0, max(0.0, share)), 4)
    )


def _trainer(i: _Iteration) -> Lever | None:
    if i.share is None or i.rollout_bound:
        return None
    s = i.r.seconds
    return _lever(
        lever=LeverName.TRAINER,
        reason="training takes the larger part: speed up the trainer (its step, micro-batches, GPUs); "
        "the engine's settings will not shorten the iteration much",
        evidence=f"training {s.training:.2f}s = {_pct(s.training / i.wall)} of the iteration; rollout "
        f"{_pct(i.share)} of rollout+train",
        share=s.training / i.wall,
    )


def _concurrency(i: _Iteration) -> Lever | None:
    busy = i.r.gpu_busy_fraction
    if i.train_bound or busy is None or busy >= i.t.idle_gpu_busy:
        return None
    if i.queue is not None and i.queue > i.t.queue_per_running:
        return None
    return _lever(
        lever=LeverName.ROLLOUT_CONCURRENCY,
        reason="the GPUs idle through much of the rollout and no request waits: send more requests at "
        "once (the trainer's concurrency) or more samples per prompt",
        evidence=_load(i),
        share=i.rollout * (1 - busy),
    )


def _running_limit(i: _Iteration) -> Lever | None:
    busy = i.r.gpu_busy_fraction
    if i.train_bound or busy is None or i.queue is None or busy >= i.t.saturated_gpu_busy:
        return None
    if i.queue <= i.t.queue_per_running:
        return None
    return _lever(
        lever=LeverName.RUNNING_REQUEST_LIMIT,
        reason="requests wait in the engine's queue while the GPUs have room: raise its limit of running "
        "requests (as far as the KV cache allows)",
        evidence=_load(i),
        share=i.rollout * (1 - busy),
    )


def _capacity(i: _Iteration) -> Lever | None:
    busy = i.r.gpu_busy_fraction
    if i.train_bound or busy is None or busy < i.t.saturated_gpu_busy:
        return None
    queued = i.queue is not None and i.queue > i.t.queue_per_running
    return _lever(
        lever=LeverName.ROLLOUT_CAPACITY,
        reason="the GPUs are saturated during rollout"
        + (" and requests queue" if queued else "")
        + ": more rollout GPUs (replicas) or a faster runtime; more concurrency will not help",
        evidence=_load(i)
        + (
            f", {_num(i.r.tokens_per_second_per_gpu, 0)} tok/s per GPU"
            if i.r.tokens_per_second_per_gpu is not None
            and Signal.GENERATION_TOKENS_PER_SECOND not in i.missing
            else ", tok/s not measured"
        ),
        share=i.rollout * busy,
    )


def _runtime(i: _Iteration) -> Lever | None:
    busy, fraction = i.r.gpu_busy_fraction, i.r.roofline_fraction
    if i.train_bound or busy is None or fraction is None or busy < i.t.saturated_gpu_busy:
        return None
    if fraction >= i.t.low_roofline_fraction:
        return None
    return _lever(
        lever=LeverName.RUNTIME_SPEED,
        reason="the GPUs are busy but generate far below what their memory bandwidth allows: a faster "
        "runtime or kernels (CUDA graphs, quantized weights or KV cache, speculative decoding)",
        evidence=f"{_num(i.r.generation_tokens_per_second, 0)} tok/s = {_pct(fraction)} of the decode "
        f"roofline {_num(i.r.decode_roofline_tokens_per_second, 0)} tok/s, GPU busy {_pct(busy)}",
        share=i.rollout * busy * (1 - fraction),
    )


def _prompts(i: _Iteration) -> Lever | None:
    r = i.r
    if i.train_bound or r.cache_hit_rate is None or r.prompt_tokens is None:
        return None
    if r.prompt_tokens < i.t.min_prompt_tokens or r.cache_hit_rate >= i.t.low_prefix_hit:
        return None
    uncached = r.prompt_tokens - (r.cached_tokens or 0)
    processed = uncached + (r.generation_tokens or 0)
    return _lever(
        lever=LeverName.PROMPT_STRUCTURE,
        reason="little prefix reuse: the prompts share few leading tokens, so no runtime's prefix cache "
        "can help; put shared context first, or sample several completions per prompt",
        evidence=f"prefix-cache hit {_pct(r.cache_hit_rate)} of {r.prompt_tokens} prompt tokens; "
        f"{r.generation_tokens or 0} tokens generated",
        share=i.rollout * (uncached / processed if processed else 0.0),
    )


def _handoff(i: _Iteration) -> Lever | None:
    s = i.r.seconds
    handoff = s.draining + s.releasing + s.refitting + s.resuming
    if handoff / i.wall <= i.t.handoff_share:
        return None
    return _lever(
        lever=LeverName.WEIGHT_HANDOFF,
        reason="handing the GPUs between rollout and training takes a large part: refit by tensor (CUDA "
        "IPC) rather than from disk, and look at the slowest of these phases",
        evidence=f"drain {s.draining:.2f}s, release {s.releasing:.2f}s, refit {s.refitting:.2f}s, resume "
        f"{s.resuming:.2f}s = {_pct(handoff / i.wall)} of the iteration",
        share=handoff / i.wall,
    )


def _control(i: _Iteration) -> Lever | None:
    overhead = i.r.control_overhead_seconds
    if overhead / i.wall <= i.t.control_overhead_share:
        return None
    return _lever(
        lever=LeverName.CONTROL_OVERHEAD,
        reason="the operator's own time between agent calls is a visible part of the iteration: report it "
        "(the operator's log, rljob_control_overhead_seconds)",
        evidence=f"{overhead:.3f}s of {i.wall:.2f}s = {_pct(overhead / i.wall)}",
        share=overhead / i.wall,
    )


def _measurement(i: _Iteration) -> Lever | None:
    """The unmeasured signals, grouped by why: `prefix-cache hit rate, token counts: <message>`."""
    if not i.unmeasured:
        return None
    by_message: dict[str, list[str]] = {}
    for entry in i.unmeasured:
        by_message.setdefault(entry.message or entry.reason.value, []).append(
            signals.SIGNAL_LABELS[entry.signal]
        )
    return _lever(
        lever=LeverName.MEASUREMENT,
        reason="not measured, so not judged: "
        + "; ".join(f"{', '.join(labels)}: {message}" for message, labels in by_message.items()),
        share=0.0,
    )


@dataclass(frozen=True)
class Row:
    lever: LeverName
    rule: Rule
    fires_when: str
    share: str
    reads: tuple[Signal, ...] = ()  # the signals `rule` reads that a source may not measure


# The lever table, in table order (ties in share keep this order). "Not train-bound": rollout share >=
# train_bound_share, so Balanced iterations get both the trainer's and the rollout's levers.
RULES: tuple[Row, ...] = (
    Row(LeverName.TRAINER, _trainer, "rollout share <= rollout_bound_share", "training / wall"),
    Row(
        LeverName.ROLLOUT_CONCURRENCY,
        _concurrency,
        "not train-bound; GPU busy < idle_gpu_busy; waiting / running <= queue_per_running",
        "rollout / wall x (1 - busy)",
        (Signal.GPU_BUSY_FRACTION,),
    ),
    Row(
        LeverName.RUNNING_REQUEST_LIMIT,
        _running_limit,
        "not train-bound; waiting / running > queue_per_running; GPU busy < saturated_gpu_busy",
        "rollout / wall x (1 - busy)",
        (Signal.GPU_BUSY_FRACTION,),
    ),
    Row(
        LeverName.ROLLOUT_CAPACITY,
        _capacity,
        "not train-bound; GPU busy >= saturated_gpu_busy",
        "rollout / wall x busy",
        (Signal.GPU_BUSY_FRACTION,),
    ),
    Row(
        LeverName.RUNTIME_SPEED,
        _runtime,
        "not train-bound; GPU busy >= saturated_gpu_busy; tokens/s < low_roofline_fraction x decode roofline",
        "rollout / wall x busy x (1 - roofline fraction)",
        (Signal.GPU_BUSY_FRACTION, Signal.GENERATION_TOKENS_PER_SECOND),
    ),
    Row(
        LeverName.PROMPT_STRUCTURE,
        _prompts,
        "not train-bound; prompt tokens >= min_prompt_tokens; prefix-cache hit < low_prefix_hit",
        "rollout / wall x uncached prompt / (uncached prompt + generated) tokens",
        (Signal.CACHE_HIT_RATE, Signal.TOKEN_COUNTS),
    ),
    Row(
        LeverName.WEIGHT_HANDOFF,
        _handoff,
        "(drain + release + refit + resume) / wall > handoff_share",
        "(drain + release + refit + resume) / wall",
    ),
    Row(
        LeverName.CONTROL_OVERHEAD,
        _control,
        "control overhead / wall > control_overhead_share",
        "control overhead / wall",
    ),
    Row(LeverName.MEASUREMENT, _measurement, "a signal these rules read was not measured", "0 (last)"),
)


def lever_table_markdown() -> str:
    """RULES as the markdown table docs/profiling.md carries."""
    lines = [
        "| lever | fires when | ranked by the share | reads (never fires when one is unmeasured) |",
        "|---|---|---|---|",
    ]
    for row in RULES:
        reads = ", ".join(signal.value for signal in row.reads) or "-"
        lines.append(f"| {row.lever.value} | {row.fires_when} | {row.share} | {reads} |")
    return "\n".join(lines)


def diagnose(report: IterationReport, thresholds: Thresholds = THRESHOLDS) -> list[Lever]:
    """The levers that fire for `report`, largest share first, at most MAX_DIAGNOSIS; none from a signal
    that was not measured."""
    wall = report.wall_seconds or 0.0
    if wall <= 0:
        return []
    running, waiting = report.mean_running_requests, report.mean_waiting_requests
    queue = None
    if running is not None and waiting is not None:
        queue = waiting / running if running > 0 else (float("inf") if waiting > 0 else 0.0)
    it = _Iteration(
        r=report,
        t=thresholds,
        wall=wall,
        rollout=report.seconds.rollout / wall,
        share=report.rollout_share,
        queue=queue,
        unmeasured=tuple(signals.unmeasured(report)),
    )
    fired = [
        lever
        for row in RULES
        if not it.missing.intersection(row.reads) and (lever := row.rule(it)) is not None
    ]
    order = {row.lever: n for n, row in enumerate(RULES)}
    fired.sort(key=lambda lv: (-(lv.share or 0.0), order[lv.lever]))
    return fired[:MAX_DIAGNOSIS]
