"""The agent's Prometheus metrics, on its own registry (served at /metrics, no token)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.engine_seconds = Histogram(
            "rljob_agent_engine_operation_seconds",
            "Latency of the engine calls made by the agent, by operation.",
            ["operation"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.freed_bytes = Gauge(
            "rljob_agent_freed_bytes",
            "GPU memory freed by the last verified release, per GPU.",
            ["gpu"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "rljob_agent_refusals",
            "Requests the agent refused instead of forwarding to the engine, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.commands = Counter(
            "rljob_agent_commands",
            "Operator commands by action and result (accepted, replayed, succeeded, failed).",
            ["action", "result"],
            registry=self.registry,
        )
        self.command_seconds = Histogram(
            "rljob_agent_command_seconds",
            "Execution time of operator commands, engine calls included, by action.",
            ["action"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.revision = Gauge(
            "rljob_agent_state_revision", "Current AgentState revision.", registry=self.registry
        )

    def observe_engine(self, operation: str, seconds: float) -> None:
        self.engine_seconds.labels(operation).observe(seconds)
