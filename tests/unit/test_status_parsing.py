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
