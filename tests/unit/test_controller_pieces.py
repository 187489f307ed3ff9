"""The controller's pure pieces: the status merge patch and a pod's broken reason."""

from __future__ import annotations

from typing import Any

import pytest

from rljob.controller.observe import broken_reason, pod_observation
from rljob.controller.status_writer import merge_patch


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 as the API server applies it: null removes, objects merge, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out


@pytest.mark.parametrize(
    ("old", "new", "patch"),
    [
        ({}, {}, {}),
        ({"phase": "Rollout"}, {"phase": "Rollout"}, {}),
        ({"phase": "Rollout"}, {"phase": "Draining"}, {"phase": "Draining"}),
        ({"phase": "Rollout", "message": "x"}, {"phase": "Rollout"}, {"message": None}),
        ({}, {"profile": {"verdict": "Balanced"}}, {"profile": {"verdict": "Balanced"}}),
        (
            {"profile": {"verdict": "Balanced", "rolloutPercent": 40}},
            {"profile": {"verdict": "Balanced", "rolloutPercent": 55}},
            {"profile": {"rolloutPercent": 55}},
        ),
        ({"profile": {"a": 1, "b": 2}}, {"profile": {"a": 1}}, {"profile": {"b": None}}),
        ({"profile": {"a": 1}}, {"profile": {"a": 1}, "epoch": 3}, {"epoch": 3}),
        # Lists are replaced whole (merge patch has no list merge): a changed timeline is sent entire.
        (
            {"timeline": [{"phase": "Pending"}]},
            {"timeline": [{"phase": "Pending"}, {"phase": "Rollout"}]},
            {"timeline": [{"phase": "Pending"}, {"phase": "Rollout"}]},
        ),
        ({"timeline": [1, 2]}, {"timeline": [1, 2]}, {}),
        # A value turning into an object, and back, is replaced.
        ({"x": 1}, {"x": {"y": 2}}, {"x": {"y": 2}}),
        ({"x": {"y": 2}}, {"x": 1}, {"x": 1}),
    ],
)
def test_merge_patch_carries_only_the_change(old: dict, new: dict, patch: dict) -> None:
    assert merge_patch(old, new) == patch
    assert apply_merge_patch(old, merge_patch(old, new)) == new


def test_merge_patch_does_not_touch_its_inputs() -> None:
    old = {"profile": {"a": 1}, "gone": True}
    new = {"profile": {"a": 2}}
    merge_patch(old, new)
    assert old == {"profile": {"a": 1}, "gone": True} and new == {"profile": {"a": 2}}


def pod(*statuses: dict[str, Any], phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": "j-0", "labels": {"rljob.io/index": "0", "rljob.io/gang": "2"}},
        "status": {"phase": phase, "containerStatuses": list(statuses)},
    }


RUNNING = {"name": "sglang", "state": {"running": {}}, "restartCount": 0}


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ((), None),
        ((RUNNING,), None),
        ((RUNNING, {"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}}), None),
        (
            (RUNNING, {"name": "trainer", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}),
            "container trainer terminated (exit 1, Error)",
        ),
        (
            ({"name": "sglang", "state": {"terminated": {"exitCode": 137}}},),
            "container sglang terminated (exit 137, )",
        ),
        (
            ({"name": "sglang", "state": {"running": {}}, "restartCount": 2},),
            "container sglang restarted 2 time(s)",
        ),
        # The first broken container in the pod's order is the one named.
        (
            (
                {"name": "sglang", "state": {"running": {}}, "restartCount": 1},
                {"name": "trainer", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}},
            ),
            "container sglang restarted 1 time(s)",
        ),
    ],
)
def test_broken_reason_names_the_container_that_lost_its_state(
    statuses: tuple[dict[str, Any], ...], expected: str | None
) -> None:
    assert broken_reason(pod(*statuses)) == expected


def test_a_container_that_exited_0_completed_and_is_not_broken() -> None:
    """The lifecycle decides what an exit 0 means (lifecycle/finishing.py): the trainer's finished."""
    done = {"name": "trainer", "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    assert broken_reason(pod(RUNNING, done)) is None
    assert pod_observation(pod(RUNNING, done)).completed == ("trainer",)
    assert pod_observation(pod(RUNNING)).completed == ()
    restarted = {**done, "restartCount": 1}  # an exit 0 after a restart: the restart broke the member
    assert broken_reason(pod(RUNNING, restarted)) == "container trainer restarted 1 time(s)"
    assert pod_observation(pod(RUNNING, restarted)).completed == ()


def test_a_pod_without_status_is_not_broken() -> None:
    assert broken_reason({"metadata": {"name": "j-0"}}) is None
    assert broken_reason({"metadata": {"name": "j-0"}, "status": {"containerStatuses": None}}) is None


def test_pod_observation_reads_labels_and_conditions() -> None:
    p = pod(RUNNING)
    p["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    obs = pod_observation(p)
    assert (obs.index, obs.gang, obs.ready, obs.deleting, obs.broken) == (0, 2, True, False, None)
    p["metadata"]["labels"]["rljob.io/index"] = "x"
    p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obs = pod_observation(p)
    assert obs.index == -1 and obs.deleting and not obs.running


def test_pod_observation_carries_the_schedulers_words_for_an_unplaceable_pod() -> None:
    p = pod()
    p["status"]["phase"] = "Pending"
    p["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
        }
    ]
    assert pod_observation(p).unschedulable == "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    p["status"]["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}]
    assert pod_observation(p).unschedulable is None  # held back on purpose, not refused
    p["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
    assert pod_observation(p).unschedulable is None


class _Recorder:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.patches.append(patch)


def test_ready_counts_alone_are_written_at_most_every_few_seconds() -> None:
    import asyncio

    from rljob.api.status import Phase, RLJobStatus
    from rljob.controller.status_writer import PROGRESS_ONLY_SECONDS, StatusWriter

    now = [100.0]
    kube = _Recorder()
    writer = StatusWriter(kube, "ns", "job", None, clock=lambda: now[0])  # type: ignore[arg-type]

    def status(ready: int, phase: Phase = Phase.ROLLOUT) -> RLJobStatus:
        return RLJobStatus(phase=phase, replicas=4, ready_replicas=ready, ready=f"{ready}/4")

    async def scenario() -> list[bool]:
        wrote = [await writer.write(status(4))]  # the first write
        assert writer.held_back_for() is None
        now[0] += 1
        wrote.append(await writer.write(status(3)))  # a probe flipped: held back
        assert writer.held_back_for() == PROGRESS_ONLY_SECONDS - 1  # when the conductor offers it again
        now[0] += 1
        wrote.append(await writer.write(status(3, Phase.DRAINING)))  # a phase change: at once, counts too
        assert writer.held_back_for() is None
        now[0] += 1
        wrote.append(await writer.write(status(4, Phase.DRAINING)))  # held back again
        now[0] += PROGRESS_ONLY_SECONDS
        assert writer.held_back_for() == 0.0
        wrote.append(await writer.write(status(4, Phase.DRAINING)))  # offered again later: written
        wrote.append(await writer.write(status(4, Phase.DRAINING)))  # nothing changed
        assert writer.held_back_for() is None
        return wrote

    assert asyncio.run(scenario()) == [True, False, True, False, True, False]
    assert kube.patches[1] == {"phase": "Draining", "readyReplicas": 3, "ready": "3/4"}
    assert kube.patches[2] == {"readyReplicas": 4, "ready": "4/4"}


def test_a_message_alone_is_written_at_most_every_few_seconds() -> None:
    """A long Rollout names the trainers it waits for report by report: writes bounded by time, not pods."""
    import asyncio

    from rljob.api.status import Phase, RLJobStatus
    from rljob.controller.status_writer import PROGRESS_ONLY_SECONDS, StatusWriter

    now = [100.0]
    kube = _Recorder()
    writer = StatusWriter(kube, "ns", "job", None, clock=lambda: now[0])  # type: ignore[arg-type]

    def status(message: str, phase: Phase = Phase.ROLLOUT) -> RLJobStatus:
        return RLJobStatus(phase=phase, message=message)

    async def scenario() -> list[bool]:
        wrote = [await writer.write(status("rollout"))]
        for asked in range(1, 512):  # one report after another, each changing the words
            now[0] += 0.01
            wrote.append(await writer.write(status(f"{asked} of 512 trainers asked")))
        now[0] += PROGRESS_ONLY_SECONDS
        wrote.append(await writer.write(status("511 of 512 trainers asked")))  # offered again later
        wrote.append(await writer.write(status("511 of 512 trainers asked", Phase.DRAINING)))  # at once
        return wrote

    wrote = asyncio.run(scenario())
    assert wrote.count(True) == 3, wrote.count(True)
    assert kube.patches[1] == {"message": "511 of 512 trainers asked"}
    assert kube.patches[2] == {"phase": "Draining"}
