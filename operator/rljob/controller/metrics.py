"""Operator metrics (`rljob_` prefix). Names and labels are typed here and nowhere else."""

from __future__ import annotations

import contextlib
import logging

from prometheus_client import Counter, Gauge, Histogram

from rljob.api.status import LeverName, Phase, RLJobStatus

log = logging.getLogger(__name__)

PHASE_SECONDS = Histogram(
    "rljob_phase_duration_seconds",
    "Wall time of each lifecycle phase.",
    ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400),
)
TRANSITIONS = Counter("rljob_phase_transitions_total", "Phase transitions, by phase entered.", ["phase"])
FAILURES = Counter(
    "rljob_failures_total", "Gang restarts and failures, by phase and reason.", ["phase", "reason"]
)
CONTROL_OVERHEAD = Histogram(
    "rljob_control_overhead_seconds",
    "Per iteration: lifecycle wall time not spent inside agents and their engines.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
ITERATION = Gauge("rljob_iteration", "Current iteration.", ["namespace", "job"])
WEIGHT_VERSION = Gauge(
    "rljob_weight_version", "Committed weight version (numeric versions only).", ["namespace", "job"]
)
RESTARTS = Gauge("rljob_restarts", "Gang restarts.", ["namespace", "job"])
STATUS_WRITES = Counter("rljob_status_writes_total", "RLJob status patches.")
STATUS_FIELDS = Counter(
    "rljob_status_fields_written_total",
    "RLJob status patches, by top-level status field they change (what makes a job write its status).",
    ["field"],
)
API_CALLS = Counter("rljob_api_calls_total", "Kubernetes API calls, by verb.", ["verb"])
API_BYTES = Counter(
    "rljob_api_request_bytes_total", "Request body bytes of the Kubernetes API calls, by verb.", ["verb"]
)
AGENT_COMMANDS = Counter(
    "rljob_agent_commands_total", "Commands sent to agents, by action and outcome.", ["action", "outcome"]
)
POD_EVENTS = Counter(
    "rljob_pod_events_total",
    "Pod watch events of RLJobs' pods, by what they change for the conductor: lifecycle (it decides on "
    "it), readiness (only the ready counts), none (an older or an unchanged pod).",
    ["change"],
)
AGENT_REPORTS = Counter("rljob_agent_reports_total", "Agent state reports taken (newer revisions only).")
DECISIONS = Counter(
    "rljob_decisions_total",
    "Conductor rounds that changed an input, by outcome: decided, or skipped as awaited (a report the "
    "last decision waits on that changes nothing: lifecycle Decision.awaiting).",
    ["outcome"],
)

# The rollout profile of the last completed iteration, per job (docs/profiling.md defines each signal).
ITERATION_SECONDS = Histogram(
    "rljob_iteration_duration_seconds",
    "Wall time of each completed iteration (all its phases).",
    buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400),
)
ROLLOUT_SHARE = Gauge(
    "rljob_rollout_share_ratio",
    "Last iteration: rollout / (rollout + training) wall time.",
    ["namespace", "job"],
)
GPU_BUSY = Gauge(
    "rljob_rollout_gpu_busy_ratio",
    "Last iteration: fraction of the rollout the GPUs ran kernels (NVML), GPU-weighted.",
    ["namespace", "job"],
)
PREFIX_CACHE_HIT = Gauge(
    "rljob_prefix_cache_hit_ratio",
    "Last iteration: cached / prompt tokens over the whole rollout (the engines' counters).",
    ["namespace", "job"],
)
ROLLOUT_REQUESTS = Gauge(
    "rljob_rollout_requests",
    "Last iteration: mean requests in the engines during rollout, by state (running, waiting), gang total.",
    ["namespace", "job", "state"],
)
GENERATION_TPS = Gauge(
    "rljob_generation_tokens_per_second",
    "Last iteration: generation tokens/s during rollout, gang total.",
    ["namespace", "job"],
)
ROOFLINE = Gauge(
    "rljob_decode_roofline_ratio",
    "Last iteration: generation tokens/s / the decode roofline (memory bandwidth at the measured batch).",
    ["namespace", "job"],
)
GPU_SECONDS_PER_SAMPLE = Gauge(
    "rljob_gpu_seconds_per_sample",
    "Last iteration: GPU-seconds of the iteration / completed samples the trainers reported.",
    ["namespace", "job"],
)
LEVER_SHARE = Gauge(
    "rljob_diagnosis_lever_share_ratio",
    "Levers of the last diagnosis: the share of the iteration each bears on (absent: not a lever now).",
    ["namespace", "job", "lever"],
)

_PROFILE_GAUGES: tuple[tuple[Gauge, str], ...] = (
    (ROLLOUT_SHARE, "rollout_share"),
    (GPU_BUSY, "gpu_busy_fraction"),
    (PREFIX_CACHE_HIT, "cache_hit_rate"),
    (GENERATION_TPS, "generation_tokens_per_second"),
    (ROOFLINE, "roofline_fraction"),
    (GPU_SECONDS_PER_SAMPLE, "gpu_seconds_per_sample"),
)


def count_api_call(verb: str, sent: int) -> None:
    """The operator's `ApiServer.on_call` hook (controller/kube.py `api_server`)."""
    API_CALLS.labels(verb=verb).inc()
    API_BYTES.labels(verb=verb).inc(sent)


def observe_status(namespace: str, job: str, old: RLJobStatus, new: RLJobStatus) -> None:
    """A decision's status `new` after `old`: the job's gauges, and a phase change (logged) and a new
    last iteration observed once."""
    labels = {"namespace": namespace, "job": job}
    ITERATION.labels(**labels).set(new.iteration)
    RESTARTS.labels(**labels).set(new.restarts)
    if new.weight_version and new.weight_version.isdigit():
        WEIGHT_VERSION.labels(**labels).set(int(new.weight_version))
    if new.phase != old.phase:
        _observe_transition(namespace, job, old, new)
    if new.last_iteration is not None and new.last_iteration != old.last_iteration:
        CONTROL_OVERHEAD.observe(new.last_iteration.control_overhead_seconds)
        observe_iteration(namespace, job, new)


def _observe_transition(namespace: str, job: str, old: RLJobStatus, new: RLJobStatus) -> None:
    TRANSITIONS.labels(phase=new.phase.value).inc()
    closed = [s for s in new.timeline if s.phase == old.phase and s.seconds is not None]
    if closed:
        PHASE_SECONDS.labels(phase=old.phase.value).observe(closed[-1].seconds or 0.0)
    if new.phase in (Phase.RECOVERING, Phase.FAILED):
        FAILURES.labels(phase=old.phase.value, reason=new.reason or "").inc()
    log.info(
        "%s/%s: %s -> %s (iteration %d, epoch %d): %s",
        namespace,
        job,
        old.phase.value,
        new.phase.value,
        new.iteration,
        new.epoch,
        new.message,
    )


def observe_iteration(namespace: str, job: str, status: RLJobStatus) -> None:
    """A new last iteration: its profile into the per-job gauges (a signal not measured leaves its gauge
    absent for the job, not 0), the diagnosis into the lever gauges."""
    report = status.last_iteration
    if report is None:
        return
    if report.wall_seconds is not None:
        ITERATION_SECONDS.observe(report.wall_seconds)
    for gauge, field in _PROFILE_GAUGES:
        value = getattr(report, field)
        if value is None:
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, job)
        else:
            gauge.labels(namespace=namespace, job=job).set(value)
    for state, value in (
        ("running", report.mean_running_requests),
        ("waiting", report.mean_waiting_requests),
    ):
        if value is not None:
            ROLLOUT_REQUESTS.labels(namespace=namespace, job=job, state=state).set(value)
    levers = {lv.lever.value: lv.share or 0.0 for lv in status.diagnosis}
    for name in LeverName:
        if name.value in levers:
            LEVER_SHARE.labels(namespace=namespace, job=job, lever=name.value).set(levers[name.value])
        else:
            with contextlib.suppress(KeyError):
                LEVER_SHARE.remove(namespace, job, name.value)
