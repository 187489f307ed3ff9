"""The agent's Prometheus metrics and JSON logs."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from agent_procs import ALL_TAGS, Agent, AgentDriver, Emulator, write_weights


def _value(text: str, sample: str) -> float:
    m = re.search("^" + re.escape(sample) + r" (\S+)$", text, re.M)
    assert m, f"{sample} not in metrics"
    return float(m.group(1))


def test_metrics_after_an_iteration(
    tmp_path: Path, start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    emu = start_emulator("0.5.23", "--gpus", "2")
    agent = start_agent(emu, "--log-json")
    c = AgentDriver(agent)
    c.full_iteration("1", str(write_weights(tmp_path, "1")))
    c.refused("release", "IllegalTransition", tags=ALL_TAGS)
    text = agent.get("/metrics", token=None).text
    for action, n in (("drain", 1), ("release", 1), ("grant", 1), ("refit", 1), ("resume", 2)):  # + opening
        assert _value(text, f'rljob_agent_commands_total{{action="{action}",result="succeeded"}}') == n
    assert _value(text, 'rljob_agent_refusals_total{reason="IllegalTransition"}') == 1
    for op in (
        "pause_generation",
        "flush_cache",
        "release_memory_occupation",
        "resume_memory_occupation",
        "update_weights_from_disk",
        "abort_request",
        "continue_generation",
        "generate_probe",
        "weight_version",
    ):
        assert _value(text, f'rljob_agent_engine_operation_seconds_count{{operation="{op}"}}') >= 1, op
    freed = emu.call("GET", "/_emulator/memory").body  # resumed by now; the gauge keeps the release's figure
    assert len(freed["gpus"]) == 2
    for gpu in ("0", "1"):
        assert _value(text, f'rljob_agent_freed_bytes{{gpu="{gpu}"}}') == (40 + 16) << 30
    assert _value(text, "rljob_agent_state_revision") == agent.state()["revision"]
    lines = [json.loads(line) for line in agent.log_text().splitlines() if line.startswith("{")]
    assert any(re.match(r"command refit epoch=\d+ succeeded", rec["msg"]) for rec in lines)
    assert all({"ts", "level", "logger", "msg"} <= set(rec) for rec in lines)


@pytest.mark.emulator_may_die  # the test stops SGLang to see the probe fail
def test_engine_liveness_probe_goes_through_the_agent(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """The kubelet can't reach SGLang on 127.0.0.1, so the SGLang container's liveness probe asks the
    agent, which asks SGLang's /ping: 200 while paused (never /health, which blocks then fails)."""
    emu = start_emulator("0.5.23")
    agent = start_agent(emu)
    assert agent.get("/probe/engine", token=None).status == 200  # open: probes carry no token
    c = AgentDriver(agent)
    c.ok("drain")
    assert agent.get("/probe/engine", token=None).status == 200  # paused is alive
    emu.stop()
    assert agent.get("/probe/engine", token=None).status == 503


def test_gang_startup_probe_passes_once_the_operator_reached_the_agent(
    start_emulator: Callable[..., Emulator], start_agent: Callable[..., Agent]
) -> None:
    """The agent's startupProbe (a native sidecar's: it holds back SGLang and the trainer) passes only once
    a request with the operator's token came; an unauthenticated one does not count."""
    agent = start_agent(start_emulator("0.5.23"), serving=False)  # up (/healthz), never asked with the token
    assert agent.get("/probe/gang", token=None).status == 503  # open: the kubelet carries no token
    assert agent.get("/v1/state", token="wrong").status == 401
    assert agent.get("/probe/gang", token=None).status == 503
    agent.state()  # what the operator's watch asks first
    assert agent.get("/probe/gang", token=None).status == 200
