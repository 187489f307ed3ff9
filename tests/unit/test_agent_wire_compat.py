"""The operator reads the agents of the previous release for one release (an operator upgraded while pods of
the previous agent image run, and a restarted agent reading a record the previous image wrote): the engine
under its former key, its weight cache mode as a launch refusal, the former name of the engine's seconds."""

from __future__ import annotations

from rljob.api.agent import AgentState, LaunchRefusalReason

PREVIOUS = {
    "revision": 3,
    "bootId": "b",
    "stage": "Ready",
    "sglang": {"reachable": True, "version": "0.5.23", "weightCacheMode": "daemon", "servedVersion": "4"},
    "lastCommand": {"epoch": 2, "action": "drain", "state": "Succeeded", "seconds": 1, "sglangSeconds": 0.5},
}


def test_a_previous_agents_state_reads_as_the_engine() -> None:
    st = AgentState.model_validate(PREVIOUS)
    assert (st.engine.reachable, st.engine.version, st.engine.served_version) == (True, "0.5.23", "4")
    assert st.last_command is not None and st.last_command.engine_seconds == 0.5
    refusal = st.engine.launch_refusal
    assert refusal is not None and refusal.reason == LaunchRefusalReason.WEIGHT_CACHE_ACTIVE
    assert "--weight-cache-mode daemon" in refusal.message
    wire = st.wire()  # written back under the new keys only
    assert "sglang" not in wire and wire["engine"]["servedVersion"] == "4"
    assert wire["lastCommand"]["engineSeconds"] == 0.5 and "sglangSeconds" not in wire["lastCommand"]


def test_a_previous_agent_without_a_weight_cache_reports_no_refusal() -> None:
    old = {**PREVIOUS, "sglang": {**PREVIOUS["sglang"], "weightCacheMode": "off"}}  # type: ignore[dict-item]
    assert AgentState.model_validate(old).engine.launch_refusal is None
