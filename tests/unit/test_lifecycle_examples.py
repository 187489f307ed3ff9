"""Readable walks of one job through the lifecycle: three iterations, and each failure path."""

from __future__ import annotations

from datetime import timedelta

from lifecycle_world import World, make_spec

from rljob.api.agent import Action, DrainCommand, GrantCommand, RefitCommand, ReleaseCommand, ResumeCommand
from rljob.api.status import ConditionStatus, ConditionType, Phase, Verdict
from rljob.lifecycle.clock import parse
from rljob.lifecycle.model import EventReason


def test_three_iterations_reach_succeeded_with_the_third_version() -> None:
    world = World(make_spec(iterations=3))
    world.bring_up()
    assert world.status.phase == Phase.ROLLOUT
    assert world.status.iteration == 1
    assert world.status.weight_version == "0"
    for version in ("1", "2", "3"):
        world.run_iteration(version)
    st = world.status
    assert st.phase == Phase.SUCCEEDED
    assert st.weight_version == "3"
    assert [w.version for w in st.weight_history] == ["0", "1", "2", "3"]
    assert all(a.served_version == "3" for a in world.agents.values())
    assert world.refusals() == []
    assert st.condition(ConditionType.COMPLETE).status == ConditionStatus.TRUE  # type: ignore[union-attr]
    assert st.last_iteration is not None and st.last_iteration.iteration == 3
    assert st.last_iteration.seconds.rollout == 10 and st.last_iteration.seconds.training == 21  # grant + 20
    assert st.last_iteration.control_overhead_seconds == 2.0  # 4 command phases x (1 s wall - 0.5 s agent)
    assert st.last_iteration.freed_bytes == 20 and st.last_iteration.cache_hit_rate == 0.5
    assert st.profile is not None and st.profile.verdict == Verdict.TRAIN_BOUND
    assert st.completion_time is not None


def test_the_training_span_keeps_the_slowest_trainers_time_with_the_gpu() -> None:
    """Training's own part is the trainer's (its agent's grant to the publish), as agentSeconds is the
    agents' part of the other phases: the rest of the span is the control plane's."""
    world = World(make_spec())
    world.bring_up()
    world.to_training()
    world.tick(20)
    world.trainers_publish("1", held={"job-0": 12.5, "job-1": 19.25})
    world.step()  # -> Refitting
    assert world.status.phase == Phase.REFITTING
    training = [s for s in world.status.timeline if s.phase == Phase.TRAINING][-1]
    assert training.seconds == 21 and training.trainer_seconds == 19.25
    world.settle()  # -> Resuming
    world.settle()  # -> Rollout
    world.trainers_request()
    world.tick(10)
    world.step()  # -> Draining of iteration 2: Draining's span records no trainer time
    assert all(s.trainer_seconds is None for s in world.status.timeline if s.phase != Phase.TRAINING)


def test_each_phase_sends_its_command_to_every_pod_with_the_new_epoch() -> None:
    world = World(make_spec())
    world.bring_up()
    world.trainers_request()
    d = world.step()
    assert world.status.phase == Phase.DRAINING
    assert sorted(pc.pod for pc in d.commands) == ["job-0", "job-1"]
    assert all(
        isinstance(pc.command, DrainCommand) and pc.command.epoch == world.status.epoch for pc in d.commands
    )
    expected = [Action.RELEASE, Action.GRANT]
    for action in expected:
        world.finish_all()
        d = world.step()
        assert {pc.command.action for pc in d.commands} == {action}
    world.finish_all()
    world.step()
    world.trainers_publish("1")
    d = world.step()
    refits = [pc.command for pc in d.commands]
    assert all(isinstance(c, RefitCommand) and c.version == "1" and c.path == "/weights/1" for c in refits)
    world.finish_all()
    d = world.step()
    assert all(isinstance(pc.command, ResumeCommand) for pc in d.commands)
    assert not any(isinstance(pc.command, GrantCommand) for pc in d.commands)


def test_each_pod_refits_from_where_its_own_trainer_published() -> None:
    # A decision builds one command per role and LockStep.varies: the refit's varies by the pod's path.
    world = World(make_spec(replicas=3))
    world.bring_up()
    world.trainers_request()
    world.step()
    for _ in range(3):  # drain, release, grant
        world.finish_all()
        world.step()
    world.trainers_publish("1")
    world.agents["job-1"].published_path = "/local/job-1/1"
    d = world.step()
    assert world.status.phase == Phase.REFITTING
    paths = {pc.pod: pc.command.path for pc in d.commands if isinstance(pc.command, RefitCommand)}
    assert paths == {"job-0": "/weights/1", "job-1": "/local/job-1/1", "job-2": "/weights/1"}


def test_a_pod_that_has_not_finished_holds_the_whole_gang() -> None:
    world = World(make_spec())
    world.bring_up()
    world.trainers_request()
    world.step()
    world.agents["job-0"].finish()  # job-1 still draining
    d = world.step()
    assert world.status.phase == Phase.DRAINING
    assert d.commands == ()  # job-0 done, job-1 accepted: nothing to resend


def test_repeated_observation_resends_the_same_epoch_and_never_advances() -> None:
    world = World(make_spec())
    world.bring_up()
    world.trainers_request()
    obs = world.observe()
    first = world.step(obs)
    second = world.step(obs)  # same report again: agents have not accepted yet
    assert second.status.epoch == first.status.epoch
    assert {(pc.pod, pc.command.epoch) for pc in second.commands} <= {
        (pc.pod, pc.command.epoch) for pc in first.commands
    }
    assert world.refusals() == []


def test_losing_a_pod_in_training_recovers_and_rejoins_at_committed_weights() -> None:
    world = World(make_spec(iterations=2, backoffLimit=1))
    world.bring_up()
    world.run_iteration("1")
    world.trainers_request()
    for _ in range(4):
        world.finish_all()
        world.step()
    assert world.status.phase == Phase.TRAINING
    del world.pods["job-1"]  # kubectl delete pod
    world.agents.pop("job-1")
    d = world.step()
    assert world.status.phase == Phase.RECOVERING
    assert world.status.restarts == 1
    assert any(e.reason == EventReason.GANG_MEMBER_LOST for e in d.events)
    assert "job-0" in d.delete_pods
    world.step()  # all gone -> Pending
    assert world.status.phase == Phase.PENDING
    world.step()  # create
    world.start_pods()  # fresh SGLang serves the initial weights "0"
    world.step()  # -> Initializing
    d = world.step()  # served 0 != committed 1 -> Refitting (rejoin)
    assert world.status.phase == Phase.REFITTING
    assert all(isinstance(pc.command, RefitCommand) and pc.command.version == "1" for pc in d.commands)
    assert all(pc.command.path == "/weights/1" for pc in d.commands)  # type: ignore[union-attr]
    world.finish_all()
    world.step()
    world.finish_all()
    world.step()
    assert world.status.phase == Phase.ROLLOUT
    assert world.status.iteration == 2  # the interrupted iteration is redone
    world.run_iteration("2")
    assert world.status.phase == Phase.SUCCEEDED
    assert world.refusals() == []


def test_backoff_limit_zero_fails_and_stays_failed() -> None:
    world = World(make_spec(backoffLimit=0))
    world.bring_up()
    world.trainers_request()
    world.step()
    world.finish_all()
    world.step()  # releasing
    world.pods["job-0"].broken = "container sglang terminated (exit 1)"
    d = world.step()
    assert world.status.phase == Phase.FAILED
    assert world.status.reason == EventReason.BACKOFF_LIMIT_EXCEEDED
    assert "sglang terminated" in (world.status.message or "")
    assert set(d.delete_pods) == {"job-0", "job-1"}
    for _ in range(3):
        world.start_pods()
        world.tick(1000)
        world.step()
        assert world.status.phase == Phase.FAILED
    assert world.status.condition(ConditionType.FAILED).status == ConditionStatus.TRUE  # type: ignore[union-attr]


def test_command_failure_restarts_the_gang() -> None:
    world = World(make_spec(backoffLimit=2))
    world.bring_up()
    world.trainers_request()
    world.step()
    world.finish_all()
    world.step()  # release sent
    world.agents["job-1"].finish(ok=False)
    d = world.step()
    assert world.status.phase == Phase.RECOVERING
    assert any(e.reason == EventReason.COMMAND_FAILED for e in d.events)


def test_phase_timeout_marks_degraded_and_restarts() -> None:
    world = World(make_spec())
    world.bring_up()
    world.trainers_request()
    world.step()  # draining, never finishes
    world.tick(301)
    world.step()
    st = world.status
    assert st.phase == Phase.RECOVERING
    assert st.condition(ConditionType.DEGRADED).status == ConditionStatus.TRUE  # type: ignore[union-attr]
    assert st.condition(ConditionType.DEGRADED).reason == "GangMemberLost"  # type: ignore[union-attr]


def test_weight_cache_is_refused_before_any_memory_is_touched() -> None:
    world = World(make_spec(), weight_cache_mode="daemon")
    world.step()
    world.start_pods()
    world.step()
    d = world.step()
    assert world.status.phase == Phase.FAILED
    assert world.status.reason == EventReason.WEIGHT_CACHE_ACTIVE
    assert "weight-cache-mode daemon" in (world.status.message or "")
    assert not any(d.commands for d in world.decisions)
    assert set(d.delete_pods) == {"job-0", "job-1"}


def test_trainers_disagreeing_on_the_version_fail_the_job() -> None:
    world = World(make_spec())
    world.bring_up()
    world.trainers_request()
    world.step()
    for _ in range(3):
        world.finish_all()
        world.step()
    world.agents["job-0"].trainer_publish("1")
    world.agents["job-1"].trainer_publish("7")
    world.step()
    assert world.status.phase == Phase.FAILED
    assert world.status.reason == EventReason.TRAINER_VERSION_MISMATCH


def test_a_version_that_goes_backwards_is_refused() -> None:
    world = World(make_spec())
    world.bring_up()
    world.run_iteration("5")
    world.trainers_request()
    world.step()
    for _ in range(3):
        world.finish_all()
        world.step()
    world.trainers_publish("4")
    world.step()
    assert world.status.phase == Phase.FAILED
    assert world.status.reason == EventReason.VERSION_NOT_NEWER
    assert world.status.weight_version == "5"


def test_suspend_in_rollout_drains_deletes_and_resumes_at_the_committed_version() -> None:
    world = World(make_spec(iterations=2))
    world.bring_up()
    world.run_iteration("1")
    world.spec = world.spec.model_copy(update={"suspend": True})
    d = world.step()
    # A serving gang drains and releases its memory before its pods go (docs/lifecycle.md, Failures).
    assert world.status.phase == Phase.DRAINING and world.status.stopping
    assert all(isinstance(pc.command, DrainCommand) for pc in d.commands)
    world.finish_all()
    d = world.step()
    assert world.status.phase == Phase.RELEASING
    assert all(isinstance(pc.command, ReleaseCommand) for pc in d.commands) and d.delete_pods == ()
    world.finish_all()
    d = world.step()
    assert world.status.phase == Phase.SUSPENDING and d.commands == ()
    assert set(d.delete_pods) == {"job-0", "job-1"}
    world.step()
    assert world.status.phase == Phase.SUSPENDED and not world.status.stopping
    assert world.status.condition(ConditionType.SUSPENDED).status == ConditionStatus.TRUE  # type: ignore[union-attr]
    world.step()
    assert world.status.phase == Phase.SUSPENDED  # stays while spec.suspend
    world.spec = world.spec.model_copy(update={"suspend": False})
    world.step()
    assert world.status.phase == Phase.PENDING
    world.step()
    world.start_pods()
    world.step()
    world.step()  # rejoin refit to "1"
    world.finish_all()
    world.step()
    world.finish_all()
    world.step()
    assert world.status.phase == Phase.ROLLOUT and world.status.weight_version == "1"
    world.run_iteration("2")
    assert world.status.phase == Phase.SUCCEEDED and world.status.weight_version == "2"
    assert world.status.restarts == 0


def test_a_member_the_scheduler_cannot_place_is_said_and_the_job_waits_for_it() -> None:
    world = World(make_spec(replicas=3, iterations=1))
    world.step()  # creates the gang
    no_gpu = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
    for name in ("job-0", "job-1"):
        world.pods[name].phase = "Running"  # placed (their containers wait, unstarted: the conductor's gate)
    world.pods["job-2"].unschedulable = no_gpu
    d = world.step()
    st = world.status
    cond = st.condition(ConditionType.SCHEDULED)
    assert st.phase == Phase.PENDING and cond is not None and cond.status == ConditionStatus.FALSE
    assert cond.reason == "Unschedulable" and no_gpu in cond.message and "1 of 3 pods" in cond.message
    assert st.reason == EventReason.UNSCHEDULABLE and no_gpu in (st.message or "")
    assert [(e.reason, e.type.value) for e in d.events] == [(EventReason.UNSCHEDULABLE, "Warning")]
    assert d.create_pods == () and d.delete_pods == () and d.commands == ()
    d = world.step()
    assert d.events == () and world.status == st  # said once; nothing else moves while it waits
    world.pods["job-2"].unschedulable = None  # a node was added
    d = world.step()
    cond = world.status.condition(ConditionType.SCHEDULED)
    assert cond is not None and cond.status == ConditionStatus.TRUE and cond.reason == "GangPlaced"
    assert [e.reason for e in d.events] == [EventReason.GANG_PLACED]
    world.start_pods()
    world.step()
    assert world.status.phase == Phase.INITIALIZING


def test_a_gang_never_placed_restarts_after_the_initializing_deadline() -> None:
    world = World(make_spec(replicas=2, iterations=1, backoffLimit=1))
    world.step()
    world.pods["job-1"].unschedulable = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    world.step()
    world.tick(world.spec.phase_timeout_seconds.initializing + 1)
    d = world.step()
    assert world.status.phase == Phase.RECOVERING and world.status.restarts == 1
    assert set(d.delete_pods) == {"job-0", "job-1"}  # the placed member's GPU is given back


def test_a_stopping_drain_past_its_deadline_skips_the_release() -> None:
    """Found by test_lifecycle_properties: a drain that never finished must not be followed by a release
    (invariant 1; the agent refuses a release of a serving server), even though the pods go anyway."""
    world = World(make_spec(iterations=3))
    world.bring_up()
    world.spec = world.spec.model_copy(update={"suspend": True})
    world.step()
    assert world.status.phase == Phase.DRAINING and world.status.stopping
    world.tick(world.spec.phase_timeout_seconds.draining + 1)  # nobody finishes the drain
    d = world.step()
    assert not any(isinstance(pc.command, ReleaseCommand) for pc in d.commands)
    assert world.status.phase == Phase.SUSPENDING and set(d.delete_pods) == {"job-0", "job-1"}
    assert "stopping without finishing" in (world.status.message or "")
    world.step()
    assert world.status.phase == Phase.SUSPENDED
    assert world.refusals() == []


def test_a_stopping_drain_that_fails_skips_the_release() -> None:
    world = World(make_spec(iterations=3))
    world.bring_up()
    world.spec = world.spec.model_copy(update={"suspend": True})
    world.step()
    world.finish_all(ok=False)
    d = world.step()
    assert not any(isinstance(pc.command, ReleaseCommand) for pc in d.commands)
    assert world.status.phase == Phase.SUSPENDING


def test_suspend_mid_iteration_waits_for_the_iteration_to_commit() -> None:
    world = World(make_spec(iterations=5))
    world.bring_up()
    world.trainers_request()
    world.step()
    world.spec = world.spec.model_copy(update={"suspend": True})
    world.finish_all()
    world.step()
    assert world.status.phase == Phase.RELEASING  # not interrupted


def test_initial_version_mismatch_without_a_path_fails_with_a_clear_reason() -> None:
    world = World(make_spec(weights={"initialVersion": "0"}))
    world.step()
    world.start_pods()
    for agent in world.agents.values():
        agent.served_version = "default"
    world.step()
    world.step()
    assert world.status.phase == Phase.FAILED
    assert world.status.reason == EventReason.INITIAL_VERSION_MISMATCH
    assert "spec.weights.initialPath" in (world.status.message or "")


def test_active_deadline_fails_the_job() -> None:
    world = World(make_spec(activeDeadlineSeconds=60))
    world.bring_up()
    world.tick(61)
    world.step()
    assert world.status.phase == Phase.FAILED
    assert world.status.reason == EventReason.DEADLINE_EXCEEDED


def test_ttl_after_finished_deletes_the_job() -> None:
    world = World(make_spec(iterations=1, ttlSecondsAfterFinished=30))
    world.bring_up()
    world.run_iteration("1")
    assert world.status.phase == Phase.SUCCEEDED
    world.tick(10)
    assert not world.step().delete_job
    world.tick(25)
    assert world.step().delete_job


def test_next_due_is_the_earliest_deadline_a_decision_checked() -> None:
    """Decision.next_due: the moment time alone would change the decision, from the checks it made."""
    world = World(make_spec(activeDeadlineSeconds=3600, phaseTimeoutSeconds={"draining": 300}))
    world.bring_up()
    started, opened = parse(world.status.start_time), parse(world.status.phase_start_time)
    assert started is not None and opened is not None
    assert world.step().next_due == opened + timedelta(seconds=30)  # then Rollout decides on each report
    world.tick(31)
    assert world.step().next_due == started + timedelta(seconds=3600)  # Rollout has no timeout here
    world.trainers_request()
    world.step()  # Draining: its deadline comes before the job's
    assert world.status.phase == Phase.DRAINING
    drained_from = parse(world.status.phase_start_time)
    assert drained_from is not None
    world.tick(1)
    assert world.step().next_due == drained_from + timedelta(seconds=300)


def test_a_finished_job_is_due_at_its_ttl_and_no_sooner() -> None:
    world = World(make_spec(iterations=1, ttlSecondsAfterFinished=30))
    world.bring_up()
    world.run_iteration("1")
    done = parse(world.status.completion_time)
    assert done is not None
    d = world.step()
    assert d.next_due == done + timedelta(seconds=30) and not d.delete_job
    world.now = done + timedelta(seconds=30)  # the TTL is reached at that moment, not after it
    assert world.step().delete_job


def test_no_deadline_no_next_due() -> None:
    world = World(make_spec(iterations=1))
    world.bring_up()
    world.run_iteration("1")
    assert world.status.phase == Phase.SUCCEEDED
    assert world.step().next_due is None


def test_pods_of_an_earlier_gang_are_deleted() -> None:
    world = World(make_spec())
    world.bring_up()
    world.pods["job-9"] = type(world.pods["job-0"])(index=9, name="job-9", gang=0, phase="Running")
    d = world.step()
    assert "job-9" in d.delete_pods


def test_status_pods_refresh_only_on_phase_changes() -> None:
    world = World(make_spec(replicas=4))
    world.bring_up()
    world.trainers_request()
    world.step()
    before = world.status.pods
    world.agents["job-0"].finish()
    world.step()
    assert world.status.pods == before


def test_a_gang_waiting_on_some_trainers_names_them_once_rollout_is_30_s_old() -> None:
    """Before then a trainer's ask is a report the conductor may skip (Decision.awaiting) and status keeps
    its words; from then on each report is decided, so the names stay true."""
    world = World(make_spec())
    world.bring_up()
    assert world.status.phase == Phase.ROLLOUT
    opened = parse(world.status.phase_start_time)
    assert opened is not None
    world.agents["job-0"].trainer_request()
    d = world.step()
    assert world.status.phase == Phase.ROLLOUT and "waiting for" not in (world.status.message or "")
    assert [a.pod for a in d.awaiting] == ["job-1"] and d.next_due == opened + timedelta(seconds=30)
    world.tick(31)
    d = world.step()
    assert world.status.message == "1 of 2 trainers asked for the GPU; waiting for the trainers of job-1"
    assert d.awaiting == ()  # every report is decided while the message names who is left
    world.agents["job-1"].trainer_request()
    world.step()
    assert world.status.phase == Phase.DRAINING
