"""`make demo` says "verified on every GPU of every pod" only when the operator entered Training after the
release (it does so only once every agent verified) and no pod's least-freeing GPU is below the job's
`release.verify.minFreedBytes`; otherwise it names the pods that were not."""

from __future__ import annotations

from rljob.testing.demo import _new_rows, _release_note

GIB = 2**30


def _job(then: str | None, pods: list[dict], min_freed: int = 10 * GIB) -> dict:
    spans = [
        {"phase": "Releasing", "iteration": 1, "startTime": "t1", "seconds": 0.03, "freedBytes": 116 * GIB},
    ]
    if then is not None:
        spans.append({"phase": then, "iteration": 1, "startTime": "t2"})
    return {
        "spec": {"release": {"verify": {"minFreedBytes": min_freed}}},
        "status": {"phase": then or "Failed", "timeline": spans, "pods": pods},
    }


def _note(job: dict) -> str:
    return _release_note(job, job["status"]["timeline"], 0)


def test_verified_only_when_training_followed_and_every_pod_met_the_threshold() -> None:
    pods = [{"name": "demo-0", "freedBytes": 58 * GIB}, {"name": "demo-1", "freedBytes": 58 * GIB}]
    assert _note(_job("Training", pods)) == "freed 116 GiB, verified on every GPU of every pod"


def test_a_pod_below_min_freed_bytes_is_named() -> None:
    pods = [{"name": "demo-0", "freedBytes": 58 * GIB}, {"name": "demo-1", "freedBytes": 2 * GIB}]
    note = _note(_job("Training", pods))
    assert "verified on every GPU" not in note
    assert note == (
        "freed 116 GiB, not verified on: demo-1 (its GPU that freed least: 2.0 GiB, minFreedBytes 10.0 GiB)"
    )


def test_a_release_that_failed_names_the_pod_and_its_error() -> None:
    pods = [
        {"name": "demo-0", "freedBytes": 58 * GIB},
        {"name": "demo-1", "freedBytes": 58 * GIB, "lastError": "release not verified within 60s"},
    ]
    note = _note(_job("Recovering", pods))
    assert note.startswith("freed 116 GiB, not verified on: demo-1 (")
    assert "release not verified within 60s" in note and "demo-0" not in note


def test_without_evidence_it_does_not_claim_verification() -> None:
    pods = [{"name": "demo-0", "freedBytes": 58 * GIB}]
    assert _note(_job("Recovering", pods)) == (
        "freed 116 GiB, not shown verified on every GPU: Releasing was followed by Recovering"
    )
    assert _note(_job(None, pods)).endswith("Releasing was followed by Failed")


def test_the_row_waits_for_the_next_phase() -> None:
    job = _job(None, [{"name": "demo-0", "freedBytes": 58 * GIB}])
    job["status"]["phase"] = "Releasing"
    printed: set[tuple[str, str]] = set()
    assert _new_rows(job, printed) == []
    job["status"]["timeline"].append({"phase": "Training", "iteration": 1, "startTime": "t2"})
    job["status"]["phase"] = "Training"
    (row,) = _new_rows(job, printed)
    assert row.endswith("verified on every GPU of every pod")
