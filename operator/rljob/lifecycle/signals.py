"""The per-iteration signals of docs/profiling.md: arithmetic only, over what the agents reported (their
RolloutReports, summed into RolloutTotals) and the timeline's phase seconds. Pure: no I/O, no clock.

A signal not measured is unset, never 0, and listed with its reason in `unmeasured` (`unmeasured()`)."""

from __future__ import annotations

from collections.abc import Sequence

from rljob.api.agent import AgentState
from rljob.api.spec import ProfileHints
from rljob.api.status import (
    IterationReport,
    PhaseSeconds,
    RolloutTotals,
    Signal,
    Unmeasured,
    UnmeasuredReason,
)

# One GPU's memory bandwidth (bytes/s) by its NVML name, first match wins (so "H100 NVL" before "H100",
# "L40S" before "L4"). NVIDIA's datasheets; None: the name covers parts that differ (give
# spec.profile.memoryBandwidthBytesPerSecond).
GPU_MEMORY_BANDWIDTH: tuple[tuple[str, int | None], ...] = (
    ("GH200", None),  # 96 GB HBM3 (4.0 TB/s) and 144 GB HBM3e (4.9 TB/s) parts
    ("H200", 4_800_000_000_000),
    ("H100 NVL", 3_900_000_000_000),
    ("H100 PCIe", 2_000_000_000_000),
    ("H100", 3_350_000_000_000),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("H800", 3_350_000_000_000),
    ("A100-SXM4-80GB", 2_039_000_000_000),
    ("A100 80GB PCIe", 1_935_000_000_000),
    ("A100", 1_555_000_000_000),  # the 40 GB parts
    ("B200", 8_000_000_000_000),
    ("L40S", 864_000_000_000),
    ("A10G", 600_000_000_000),
    ("L4", 300_000_000_000),
)


# How kubectl and the diagnosis name each signal.
SIGNAL_LABELS: dict[Signal, str] = {
    Signal.CACHE_HIT_RATE: "prefix-cache hit rate",
    Signal.GENERATION_TOKENS_PER_SECOND: "generation tokens/s",
    Signal.TOKEN_COUNTS: "token counts",
    Signal.GPU_BUSY_FRACTION: "GPU busy",
    Signal.SAMPLES: "samples",
}

# Why a signal is unset when no agent said why (NotReported), by signal.
NOT_REPORTED_MESSAGES: dict[Signal, str] = {
    Signal.CACHE_HIT_RATE: "no agent reported one",
    Signal.GENERATION_TOKENS_PER_SECOND: "no agent reported one",
    Signal.TOKEN_COUNTS: "no counters (the engine's metrics: --enable-metrics where it needs one)",
    Signal.GPU_BUSY_FRACTION: "no GPU probe reading",
    Signal.SAMPLES: "the trainers report none (handoff.report_rollout)",
}
NO_ROLLOUT_SAMPLE = "no agent sampled the rollout"


def gpu_bandwidth(name: str | None) -> int | None:
    """GPU_MEMORY_BANDWIDTH's entry for an NVML device name, None when unknown."""
    if not name:
        return None
    return next((bw for part, bw in GPU_MEMORY_BANDWIDTH if part in name), None)


def _sum(values: Sequence[float | int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def rollout_totals(agents: Sequence[AgentState]) -> RolloutTotals | None:
    """The gang's rollout: counts and rates summed over pods, the busy fraction weighted by GPUs, the
    longest window. None when no agent sampled the rollout."""
    reports = [a.rollout for a in agents if a.rollout.samples > 0]
    if not reports:
        return None
    busy = [(r.gpu_busy_fraction, max(1, r.gpus)) for r in reports if r.gpu_busy_fraction is not None]
    rates = [
        r.generation_tokens / r.window_seconds
        for r in reports
        if r.generation_tokens is not None and r.window_seconds
    ]
    prompt, cached, generated = (
        _sum([getattr(r, key) for r in reports])
        for key in ("prompt_tokens", "cached_tokens", "generation_tokens")
    )
    running, waiting = (
        _sum([r.mean_running_requests for r in reports]),
        _sum([r.mean_waiting_requests for r in reports]),
    )
    samples = sum(r.completed_samples for r in reports)
    first: dict[Signal, Unmeasured] = {}
    for r in reports:
        for entry in r.unmeasured:
            first.setdefault(entry.signal, entry)
    # Unmeasured for the gang only where no pod measured it: the pods that did are summed.
    unmeasured = [
        first[signal]
        for signal in Signal
        if signal in first and all(any(e.signal == signal for e in r.unmeasured) for r in reports)
    ]
    return RolloutTotals(
        pods=len(reports),
        gpus=sum(r.gpus for r in reports),
        gpu_name=next((r.gpu_name for r in reports if r.gpu_name), None),
        tp_size=next((r.tp_size for r in reports if r.tp_size), None),
        window_seconds=max((r.window_seconds for r in reports if r.window_seconds is not None), default=None),
        gpu_busy_fraction=round(sum(b * g for b, g in busy) / sum(g for _, g in busy), 6) if busy else None,
        prompt_tokens=None if prompt is None else int(prompt),
        cached_tokens=None if cached is None else int(cached),
        generation_tokens=None if generated is None else int(generated),
        generation_tokens_per_second=round(sum(rates), 3) if rates else None,
        mean_running_requests=None if running is None else round(running, 4),
        mean_waiting_requests=None if waiting is None else round(waiting, 4),
        samples=samples or None,  # 0: the trainers report none (handoff.report_rollout)
        unmeasured=unmeasured,
    )


def prefix_hit_rate(totals: RolloutTotals | None) -> float | None:
    """Token-weighted over the rollout: cached / prompt tokens (an engine counts cached tokens as part of
    the prompt: they are prompt tokens whose KV came from its prefix cache)."""
    if totals is None or not totals.prompt_tokens or totals.cached_tokens is None:
        return None
    return round(min(1.0, totals.cached_tokens / totals.prompt_tokens), 6)


def wall_seconds(seconds: PhaseSeconds) -> float:
    return (
        seconds.rollout
        + seconds.draining
        + seconds.releasing
        + seconds.training
        + seconds.refitting
        + seconds.resuming
    )


def rollout_share(seconds: PhaseSeconds) -> float | None:
    busy = seconds.rollout + seconds.training
    return seconds.rollout / busy if busy > 0 else None


def decode_roofline(
    running_requests: float | None, bandwidth: int | None, model_bytes: int | None, tp_size: int | None
) -> float | None:
    """Generation tokens/s the GPUs' memory bandwidth allows at the measured batch. A decode step reads
    every weight once on each GPU (modelBytes / tp_size bytes, in parallel) and advances every running
    request of its model replica by one token, so a replica makes at most running x bandwidth /
    (modelBytes / tp_size) tokens/s, and the gang the sum over replicas: the same formula with the
    gang's running requests. KV-cache reads and compute are left out: a bound, not a forecast."""
    if not running_requests or not bandwidth or not model_bytes:
        return None
    return running_requests * bandwidth / (model_bytes / (tp_size or 1))


def _ratio(num: float | None, den: float | None, digits: int = 6) -> float | None:
    if num is None or not den:
        return None
    return round(num / den, digits)


def _measured(report: IterationReport) -> dict[Signal, object]:
    """Each Signal's value in `report` (tokenCounts: the prompt tokens, read with the other two)."""
    return {
        Signal.CACHE_HIT_RATE: report.cache_hit_rate,
        Signal.GENERATION_TOKENS_PER_SECOND: report.generation_tokens_per_second,
        Signal.TOKEN_COUNTS: report.prompt_tokens,
        Signal.GPU_BUSY_FRACTION: report.gpu_busy_fraction,
        Signal.SAMPLES: report.samples,
    }


def unmeasured(
    report: IterationReport, totals: RolloutTotals | None = None, *, sampled: bool = True
) -> list[Unmeasured]:
    """Every signal the agents said they did not measure (totals', else the report's own list), and every
    other one `report` leaves unset, as NotReported by its source (`sampled` False: no agent sampled the
    rollout); in Signal order."""
    said = {e.signal: e for e in [*report.unmeasured, *(totals.unmeasured if totals is not None else [])]}
    out = []
    for signal, value in _measured(report).items():
        if signal in said:
            out.append(said[signal])
        elif value is None:
            message = NOT_REPORTED_MESSAGES[signal] if sampled else NO_ROLLOUT_SAMPLE
            out.append(Unmeasured(signal=signal, reason=UnmeasuredReason.NOT_REPORTED, message=message))
    return out


def _clear(report: IterationReport, signal: Signal) -> None:
    """An unmeasured signal is unset, never a stale or default figure."""
    if signal == Signal.CACHE_HIT_RATE:
        report.cache_hit_rate = None
    elif signal == Signal.GENERATION_TOKENS_PER_SECOND:
        report.generation_tokens_per_second = None
    elif signal == Signal.TOKEN_COUNTS:
        report.prompt_tokens = report.cached_tokens = report.generation_tokens = None
    elif signal == Signal.GPU_BUSY_FRACTION:
        report.gpu_busy_fraction = None
    else:
        report.samples = None


def fill_signals(report: IterationReport, totals: RolloutTotals | None, hints: ProfileHints) -> None:
    """Write the signals derived from `report`'s phase seconds and the rollout's totals into `report`, and
    the list of those not measured (a signal derived from one of them stays unset too)."""
    wall = wall_seconds(report.seconds)
    report.wall_seconds = round(wall, 6)
    share = rollout_share(report.seconds)
    report.rollout_share = None if share is None else round(share, 4)
    hit = prefix_hit_rate(totals)
    if hit is not None:
        report.cache_hit_rate = hit  # the whole rollout's, over the last batch's
    if totals is not None:
        if totals.generation_tokens_per_second is not None:
            report.generation_tokens_per_second = totals.generation_tokens_per_second
        report.gpu_busy_fraction = totals.gpu_busy_fraction
        report.mean_running_requests = totals.mean_running_requests
        report.mean_waiting_requests = totals.mean_waiting_requests
        report.prompt_tokens = totals.prompt_tokens
        report.cached_tokens = totals.cached_tokens
        report.generation_tokens = totals.generation_tokens
        report.samples = totals.samples
    report.unmeasured = unmeasured(report, totals, sampled=totals is not None)
    for entry in report.unmeasured:
        _clear(report, entry.signal)
    if totals is None:
        return
    gpus = totals.gpus or None
    report.gpus = gpus
    tps = report.generation_tokens_per_second
    report.tokens_per_second_per_gpu = _ratio(tps, gpus, 3)
    bandwidth = hints.memory_bandwidth_bytes_per_second or gpu_bandwidth(totals.gpu_name)
    roofline = decode_roofline(totals.mean_running_requests, bandwidth, hints.model_bytes, totals.tp_size)
    report.decode_roofline_tokens_per_second = None if roofline is None else round(roofline, 3)
    report.roofline_fraction = _ratio(tps, roofline, 4)
    gpu_seconds = wall * gpus if gpus else None
    report.gpu_seconds = None if gpu_seconds is None else round(gpu_seconds, 6)
    report.gpu_seconds_per_sample = _ratio(gpu_seconds, report.samples)
    report.tokens_per_gpu_second = _ratio(report.generation_tokens, gpu_seconds, 3)
