"""Operator metrics (`rljob_` prefix). Names and labels are typed here and nowhere else."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
    "Per iteration: lifecycle wall time not spent inside agents/SGLang.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
)
ITERATION = Gauge("rljob_iteration", "Current iteration.", ["namespace", "job"])
WEIGHT_VERSION = Gauge(
    "rljob_weight_version", "Committed weight version (numeric versions only).", ["namespace", "job"]
)
RESTARTS = Gauge("rljob_restarts", "Gang restarts.", ["namespace", "job"])
STATUS_WRITES = Counter("rljob_status_writes_total", "RLJob status patches.")
API_CALLS = Counter("rljob_api_calls_total", "Kubernetes API calls, by verb.", ["verb"])
AGENT_COMMANDS = Counter(
    "rljob_agent_commands_total", "Commands sent to agents, by action and outcome.", ["action", "outcome"]
)
