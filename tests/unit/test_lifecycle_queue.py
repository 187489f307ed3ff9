"""The lifecycle under a queue (Kueue): no pod before the whole gang is admitted; an eviction drains the
gang before its pods go and keeps the committed weights; readmission resumes from them."""

from __future__ import annotations

from dataclasses import replace

from lifecycle_world import World, make_spec

from rljob.api.agent import DrainCommand, ReleaseCommand
from rljob.api.status import ConditionStatus, ConditionType, Phase
from rljob.lifecycle.model import Admission, EventReason, Observation

WAITING = "Workload rljob-job-abcde in LocalQueue lq: insufficient unused quota for nvidia.com/gpu"
PREEMPTED = (
    "Workload rljob-job-abcde in LocalQueue lq evicted (Preempted): Preempted to accommodate a workload"
)
ADMITTED = "Workload rljob-job-abcde in LocalQueue lq admitted by ClusterQueue cq"


class QueuedWorld(World):
    """The world with a queue: every observation carries the queue's current word."""

    admission = Admission.PENDING
    message = WAITING

    def observe(self) -> Observation:
        return replace(super().observe(), admission=self.admission, admission_message=self.message)

    def admit(self) -> None:
        self.admission, self.message = Admission.ADMITTED, ADMITTED

    def evict(self) -> None:
        self.admission, self.message = Admission.EVICTED, PREEMPTED

    def release(self) -> None:
        """What the operator tells Kueue once no pod is left; Kueue then queues the workload again."""
        self.admission, self.message = Admission.PENDING, WAITING


def queued(world: World) -> tuple[ConditionStatus, str, str]:
    cond = world.status.condition(ConditionType.QUEUED)
    assert cond is not None
    return cond.status, cond.reason, cond.message


def reasons(world: World) -> list[EventReason]:
    return [e.reason for d in world.decisions for e in d.events]


def test_no_pod_until_the_whole_gang_is_admitted() -> None:
    world = QueuedWorld(make_spec(iterations=1))
    for _ in range(5):
        d = world.step()
        world.tick()
        assert d.create_pods == ()
    st = world.status
    assert st.phase == Phase.SUSPENDED and st.reason == EventReason.WAITING_FOR_QUOTA
    assert st.message == WAITING
    assert queued(world) == (ConditionStatus.TRUE, "WaitingForQuota", WAITING)
    assert st.condition(ConditionType.SUSPENDED).status == ConditionStatus.TRUE  # type: ignore[union-attr]
    assert [s.phase for s in st.timeline] == []  # nothing ran, nothing drained
    assert reasons(world).count(EventReason.WAITING_FOR_QUOTA) == 1  # one event, not one per round

    world.admit()
    world.step()
    assert world.status.phase == Phase.PENDING and world.status.reason == EventReason.ADMITTED
    d = world.step()
    assert sorted(d.create_pods) == [0, 1]  # the whole gang at once
    world.start_pods()
    world.step()
    world.step()
    world.finish_all()
    world.step()
    assert world.status.phase == Phase.ROLLOUT
    assert queued(world) == (ConditionStatus.FALSE, "Admitted", ADMITTED)
    world.run_iteration("1")
    assert world.status.phase == Phase.SUCCEEDED


def test_eviction_in_rollout_drains_before_the_pods_go_and_resumes_at_the_committed_weights() -> None:
    world = QueuedWorld(make_spec(iterations=3))
    world.admit()
    world.bring_up()
    world.run_iteration("1")
    assert world.status.phase == Phase.ROLLOUT and world.status.weight_version == "1"

    world.evict()
    d = world.step()
    assert world.status.phase == Phase.DRAINING and world.status.reason == EventReason.EVICTED
    assert world.status.stopping
    assert {type(pc.command) for pc in d.commands} == {DrainCommand} and d.delete_pods == ()
    assert queued(world)[:2] == (ConditionStatus.TRUE, "Evicted")
    world.finish_all()  # every agent drained
    d = world.step()
    assert world.status.phase == Phase.RELEASING
    assert {type(pc.command) for pc in d.commands} == {ReleaseCommand} and d.delete_pods == ()
    world.finish_all()  # every agent released and verified its memory
    d = world.step()
    assert world.status.phase == Phase.SUSPENDING
    assert set(d.delete_pods) == {"job-0", "job-1"}  # only after the drain and the release
    world.step()
    assert world.status.phase == Phase.SUSPENDED and world.status.weight_version == "1"
    assert world.status.reason == EventReason.EVICTED
    world.release()
    world.step()
    assert world.status.reason == EventReason.WAITING_FOR_QUOTA and world.status.message == WAITING
    for _ in range(3):
        assert world.step().create_pods == ()

    world.admit()
    world.step()
    assert world.status.phase == Phase.PENDING
    world.step()
    world.start_pods()
    world.step()  # Initializing
    world.step()  # Refitting: the fresh gang loads the committed weights "1"
    assert "loading committed weights 1" in (world.status.message or "")
    world.finish_all()
    world.step()
    world.finish_all()
    world.step()
    assert world.status.phase == Phase.ROLLOUT and world.status.weight_version == "1"
    world.run_iteration("2")
    world.run_iteration("3")
    st = world.status
    assert st.phase == Phase.SUCCEEDED
    assert [w.version for w in st.weight_history] == ["0", "1", "2", "3"]
    assert st.restarts == 0  # an eviction is not a failure
    assert "Suspending" in [s.phase for s in st.timeline]
    assert world.refusals() == []


def test_eviction_mid_iteration_lets_the_iteration_commit_first() -> None:
    world = QueuedWorld(make_spec(iterations=5))
    world.admit()
    world.bring_up()
    world.trainers_request()
    world.step()  # Draining
    world.evict()
    for _ in range(3):  # drain, release, grant: the iteration in flight is not interrupted
        world.finish_all()
        world.step()
    assert world.status.phase == Phase.TRAINING
    world.trainers_publish("1")
    world.step()
    world.finish_all()
    world.step()
    world.finish_all()
    world.step()  # Resuming done: weights 1 committed, the next rollout opens...
    assert world.status.weight_version == "1" and world.status.phase == Phase.ROLLOUT
    d = world.step()  # ...and stops for the queue: the gang drains (then releases)
    assert world.status.phase == Phase.DRAINING and world.status.stopping
    assert {type(pc.command) for pc in d.commands} == {DrainCommand}


def test_a_job_without_a_queue_has_no_queued_condition() -> None:
    world = World(make_spec(iterations=1))
    world.bring_up()
    assert world.status.condition(ConditionType.QUEUED) is None


def test_a_finished_job_keeps_its_last_queued_condition() -> None:
    world = QueuedWorld(make_spec(iterations=1))
    world.admit()
    world.bring_up()
    world.run_iteration("1")
    assert world.status.phase == Phase.SUCCEEDED
    world.release()  # its Workload is finished: the queue admits nothing more
    world.step()
    assert world.status.phase == Phase.SUCCEEDED
    assert queued(world)[:2] == (ConditionStatus.FALSE, "Admitted")


def test_user_suspend_wins_over_the_queue() -> None:
    world = QueuedWorld(make_spec(iterations=2, suspend=True))
    world.admit()
    for _ in range(3):
        assert world.step().create_pods == ()
    assert world.status.phase == Phase.SUSPENDED and world.status.reason == EventReason.SUSPENDED
