"""Status parsing tolerates fields it does not know (a newer operator wrote them); the spec does not."""

from __future__ import annotations

import pytest

from rljob.api import InvalidObject, parse_spec, parse_status
from rljob.api.status import Phase

NEWER_STATUS = {
    "phase": "Rollout",
    "iteration": 4,
    "weightVersion": "3",
    "instances": [{"leader": "job-0"}],  # a field of a newer operator
    "pods": [{"name": "job-0", "stage": "Serving", "uid": "1234", "rank": 0}],
    "timeline": [{"phase": "Rollout", "iteration": 4, "startTime": "2026-01-01T00:00:00Z", "gpuSeconds": 1}],
    "conditions": [{"type": "Ready", "status": "True", "observedGeneration": 3}],
    "weightHistory": [{"version": "3", "iteration": 3, "checksum": "abc"}],
    "lastIteration": {"iteration": 3, "seconds": {"rollout": 1.0, "sampling": 2.0}, "gpuUtilization": 0.9},
    "profile": {"rolloutShare": 0.5, "rolloutPercent": 50, "verdict": "Balanced", "hint": "x"},
}


def test_a_status_written_by_a_newer_operator_parses() -> None:
    status = parse_status(NEWER_STATUS)
    assert status.phase == Phase.ROLLOUT and status.iteration == 4 and status.weight_version == "3"
    assert status.pods[0].name == "job-0" and status.pods[0].stage == "Serving"
    assert status.timeline[0].phase == Phase.ROLLOUT
    assert status.last_iteration is not None and status.last_iteration.seconds.rollout == 1.0
    # Unknown fields are dropped: what this operator writes back is what it knows.
    wire = status.wire()
    assert "instances" not in wire
    assert "uid" not in wire["pods"][0] and "rank" not in wire["pods"][0]
    assert "checksum" not in wire["weightHistory"][0]


def test_a_status_with_a_bad_known_field_is_still_refused() -> None:
    with pytest.raises(InvalidObject, match=r"status\.iteration"):
        parse_status({"iteration": -1})


def test_the_spec_still_refuses_unknown_fields() -> None:
    template = {"spec": {"containers": [{"name": "sglang"}, {"name": "trainer"}]}}
    with pytest.raises(InvalidObject, match=r"spec\.replicaz: Extra inputs are not permitted"):
        parse_spec({"template": template, "replicaz": 2})
    with pytest.raises(InvalidObject, match=r"spec\.release\.verify\.minFreed: Extra inputs"):
        parse_spec({"template": template, "release": {"verify": {"minFreed": 1}}})


def test_status_pods_say_what_each_agent_last_reported_and_why_a_member_is_lost() -> None:
    from rljob.api.agent import (
        Action,
        AgentState,
        CommandState,
        CommandStatus,
        EngineInfo,
        MemoryReport,
        Stage,
    )
    from rljob.api.spec import ReleaseTag
    from rljob.lifecycle.model import PodObservation
    from rljob.lifecycle.timeline import pod_entries

    def agent(**kw: object) -> AgentState:
        return AgentState(revision=1, boot_id="b", **kw)  # type: ignore[arg-type]

    failed = CommandStatus(epoch=3, action=Action.RELEASE, state=CommandState.FAILED, error="short of memory")
    released = agent(
        stage=Stage.RELEASED,
        released_tags=[ReleaseTag.KV_CACHE],
        memory=MemoryReport(freed_bytes=2**30),
        engine=EngineInfo(served_version="7"),
    )
    gang = [
        (
            PodObservation(3, "job-3", 0, broken="container sglang restarted"),
            agent(stage=Stage.SERVING, fatal="x"),
        ),
        (PodObservation(0, "job-0", 0), released),
        (PodObservation(1, "job-1", 0), agent(stage=Stage.DRAINED, last_command=failed)),
        (
            PodObservation(2, "job-2", 0),
            agent(stage=Stage.FAILED, fatal="SGLang stopped answering", last_command=failed),
        ),
        (PodObservation(4, "job-4", 0, broken="OOMKilled"), None),
        (PodObservation(5, "job-5", 0), None),
    ]
    entries = pod_entries(gang)
    assert [e.name for e in entries] == [f"job-{i}" for i in range(6)]  # by index
    assert [e.stage for e in entries] == [
        "Released",
        "Drained",
        "Failed",
        "Serving",
        "Unreachable",
        "Unreachable",
    ]
    assert entries[0].weight_version == "7" and entries[0].released_tags == [ReleaseTag.KV_CACHE]
    assert entries[0].freed_bytes == 2**30 and entries[0].last_error is None
    # The pod's own breakage first, then the agent's fatal, then a failed command's error.
    assert [e.last_error for e in entries[1:]] == [
        "short of memory",
        "SGLang stopped answering",
        "container sglang restarted",
        "OOMKilled",
        None,
    ]
