"""A trainer that exits 0 has finished (lifecycle/finishing.py), a lease may end without new weights, and a
trainer's last refusal reaches the status when it ends (docs/lifecycle.md, "When trainers finish")."""

from __future__ import annotations

import pytest
from lifecycle_world import World, make_spec

from rljob.api.agent import RefitCommand
from rljob.api.status import ConditionStatus, ConditionType, Phase
from rljob.lifecycle.model import EventReason

TRAINER = ("trainer",)


def versions(world: World) -> list[str]:
    return [w.version for w in world.status.weight_history]


def events(world: World) -> list[tuple[EventReason, str]]:
    return [(e.reason, e.message) for d in world.decisions for e in d.events]


def test_trainers_that_finish_after_their_last_resume_end_the_job_succeeded_before_spec_iterations() -> None:
    world = World(make_spec(iterations=5))
    world.bring_up()
    world.run_iteration("1")
    world.to_training()
    world.tick(5)
    world.trainers_publish("2")
    world.step()  # -> Refitting
    world.settle()  # -> Resuming: the resume is sent to both pods
    assert world.status.phase == Phase.RESUMING
    # Pod 0's framework got its answer and exited 0 while pod 1's resume still runs.
    world.agents["job-0"].finish()
    world.pods["job-0"].completed = TRAINER
    world.tick()
    world.step()
    assert world.status.phase == Phase.RESUMING, world.status.message
    world.tick()
    world.finish_all()
    world.step()  # committed; pod 1's trainer is still there: the next rollout opens
    assert world.status.phase == Phase.ROLLOUT and versions(world) == ["0", "1", "2"]
    world.tick()
    world.step()  # status says for whom it waits
    assert world.status.message.startswith("1 of 2 trainers finished after 2 iterations"), (
        world.status.message
    )
    assert world.status.message.endswith("job-1 to finish")
    world.pods["job-1"].completed = TRAINER
    world.tick()
    world.step()
    st = world.status
    assert st.phase == Phase.SUCCEEDED, st.message
    assert st.reason == EventReason.TRAINERS_FINISHED
    assert st.message == "every trainer finished after 2 of 5 iterations, serving weights 2"
    assert st.iteration == 2 and st.restarts == 0 and versions(world) == ["0", "1", "2"]
    assert st.condition(ConditionType.COMPLETE).status == ConditionStatus.TRUE  # type: ignore[union-attr]
    assert st.completion_time is not None
    world.spec = make_spec(iterations=6)  # raising iterations does not bring finished trainers back
    world.tick()
    world.step()
    assert world.status.phase == Phase.SUCCEEDED and world.decisions[-1].create_pods == ()


def test_the_iteration_in_flight_commits_when_every_trainer_finished_before_the_resumes_end() -> None:
    world = World(make_spec(iterations=None))  # the trainers say when the job is done
    world.bring_up()
    world.to_training()
    world.trainers_publish("1")
    world.step()  # -> Refitting
    for pod in world.pods.values():  # AReaL exits once its pod refitted, before the gang resumed
        pod.completed = TRAINER
    world.settle()  # -> Resuming
    world.settle()  # committed -> Succeeded
    st = world.status
    assert st.phase == Phase.SUCCEEDED and st.reason == EventReason.TRAINERS_FINISHED
    assert st.message == "every trainer finished after 1 iteration, serving weights 1"
    assert versions(world) == ["0", "1"] and st.weight_version == "1"


def test_a_trainer_that_exits_0_holding_the_lease_is_a_lost_member() -> None:
    world = World(make_spec(backoffLimit=0))
    world.bring_up()
    world.to_training()
    world.pods["job-1"].completed = TRAINER
    world.tick()
    world.step()
    st = world.status
    assert st.phase == Phase.FAILED and st.reason == EventReason.BACKOFF_LIMIT_EXCEEDED
    assert "pod job-1: its trainer finished (exit 0) holding the GPU lease" in st.message


def test_sglang_exiting_0_is_a_lost_member() -> None:
    world = World(make_spec(backoffLimit=1))
    world.bring_up()
    world.pods["job-0"].completed = ("sglang",)
    world.tick()
    world.step()
    assert world.status.phase == Phase.RECOVERING
    assert world.status.message == "pod job-0: container sglang terminated (exit 0, Completed)"


def test_a_trainer_asking_while_another_finished_fails_the_job_at_once() -> None:
    world = World(make_spec())
    world.bring_up()
    world.pods["job-0"].completed = TRAINER
    world.agents["job-1"].trainer_request()
    world.tick()
    world.step()
    st = world.status
    assert st.phase == Phase.FAILED and st.reason == EventReason.TRAINER_FINISHED_EARLY
    assert st.message.startswith("the trainers of job-0 finished while those of job-1 asked for the GPU")


def test_a_lease_given_back_without_weights_brings_the_committed_version_back_and_records_none() -> None:
    world = World(make_spec(iterations=1))
    world.bring_up()
    world.to_training()
    for agent in world.agents.values():
        agent.trainer_return_unchanged()
    world.tick()
    decision = world.step()
    st = world.status
    assert st.phase == Phase.REFITTING and st.reason == EventReason.NO_NEW_WEIGHTS
    refits = [pc.command for pc in decision.commands if isinstance(pc.command, RefitCommand)]
    assert len(refits) == 2 and all(r.reload and r.version == "0" for r in refits)
    assert all(r.path == "/models/base" for r in refits)  # the committed version's path (initialPath)
    world.settle()  # -> Resuming
    world.settle()  # -> Rollout of the same iteration
    assert world.status.phase == Phase.ROLLOUT and world.status.iteration == 1
    assert versions(world) == ["0"] and world.status.weight_version == "0"
    assert all(a.served_version == "0" for a in world.agents.values())
    world.run_iteration("1")  # the first lease with weights is iteration 1
    assert world.status.phase == Phase.SUCCEEDED and versions(world) == ["0", "1"]
    assert world.refusals() == []


def test_some_trainers_publishing_and_others_giving_the_lease_back_empty_fails() -> None:
    world = World(make_spec())
    world.bring_up()
    world.to_training()
    world.agents["job-0"].trainer_publish("1")
    world.agents["job-1"].trainer_return_unchanged()
    world.tick()
    world.step()
    st = world.status
    assert st.phase == Phase.FAILED and st.reason == EventReason.TRAINER_VERSION_MISMATCH
    assert "1 of 2 trainers published weights and 1 gave the lease back without any" in st.message


def test_the_agents_last_refusal_to_a_trainer_that_ended_is_in_the_status_and_an_event() -> None:
    world = World(make_spec(backoffLimit=0))
    world.bring_up()
    world.to_training()
    refusal = "POST /update_weights_from_disk: rljob: this RLJob refits from tensor (spec.refit.source)"
    world.agents["job-1"].last_refusal = refusal
    world.pods["job-1"].broken = "container trainer terminated (exit 2, Error)"
    world.tick()
    world.step()
    st = world.status
    lost = "pod job-1: container trainer terminated (exit 2, Error)"
    expected = f"{lost}; the agent last refused its trainer: {refusal}"
    assert st.phase == Phase.FAILED and st.message.startswith(expected), st.message
    assert (EventReason.GANG_MEMBER_LOST, expected) in events(world)
    # A member lost for another container's reason is not blamed on the trainer's refusal.
    other = World(make_spec(backoffLimit=0))
    other.bring_up()
    other.agents["job-0"].last_refusal = refusal
    other.pods["job-0"].broken = "container sglang terminated (exit 137, OOMKilled)"
    other.tick()
    other.step()
    assert "last refused" not in other.status.message


def test_trainers_that_exit_0_before_any_iteration_committed_fail_the_job() -> None:
    """Nothing trained is not a success: a pipeline that waits for Complete would ship the initial
    weights."""
    world = World(make_spec(iterations=3))
    world.bring_up()
    for pod in world.pods.values():
        pod.completed = TRAINER
    world.tick()
    world.step()
    st = world.status
    assert st.phase == Phase.FAILED and st.reason == EventReason.NO_ITERATION_COMMITTED, st.message
    assert st.message.startswith(
        "every trainer exited 0 without publishing weights: 0 of 3 iterations committed, the pods serve the "
        "initial weights 0; check the trainer's command"
    ), st.message
    assert st.condition(ConditionType.COMPLETE).status == ConditionStatus.FALSE  # type: ignore[union-attr]
    assert st.condition(ConditionType.FAILED).status == ConditionStatus.TRUE  # type: ignore[union-attr]
    assert st.iteration == 0 and versions(world) == ["0"]  # the launch weights, committed at start
    assert (EventReason.NO_ITERATION_COMMITTED, st.message) in events(world)


def test_trainers_that_only_gave_leases_back_empty_and_exited_say_so() -> None:
    world = World(make_spec(iterations=None))
    world.bring_up()
    world.to_training()
    for agent in world.agents.values():
        agent.trainer_return_unchanged()
    world.tick()
    world.step()  # -> Refitting at the committed version
    world.settle()  # -> Resuming
    world.settle()  # -> Rollout of iteration 1 again
    assert world.status.phase == Phase.ROLLOUT and world.status.leases_without_weights == 1
    for pod in world.pods.values():
        pod.completed = TRAINER
    world.tick()
    world.step()
    st = world.status
    assert st.phase == Phase.FAILED and st.reason == EventReason.NO_ITERATION_COMMITTED
    assert st.message.startswith(
        "every trainer exited 0 after 1 lease given back without new weights: 0 iterations committed"
    ), st.message


def _refitting_tensor_window(world: World) -> None:
    world.bring_up()
    world.to_training()
    world.trainers_publish("1")
    world.step()  # -> Refitting: the refit opens each pod's window for the trainer's pushes
    assert world.status.phase == Phase.REFITTING
    for agent in world.agents.values():
        agent.refit_window = "1"


@pytest.mark.parametrize("exit_code", [0, 2])
def test_a_trainer_that_exits_with_its_refit_window_open_is_lost_at_once_with_its_last_refusal(
    exit_code: int,
) -> None:
    """Its pushes stopped half sent (or after a refused one): nobody closes the window, so the refit could
    only end at spec.refit.timeoutSeconds with the gang's GPUs idle. The member is lost at once, whatever
    the exit code, and the refusal that made the trainer stop is in the status."""
    world = World(make_spec(backoffLimit=0, refit={"source": "tensor"}))
    _refitting_tensor_window(world)
    refusal = "POST /update_weights_from_tensor: rljob: InvalidPush: serializedNamedTensors[0] is not base64"
    world.agents["job-1"].last_refusal = refusal
    if exit_code == 0:
        world.pods["job-1"].completed = TRAINER
        lost = "pod job-1: its trainer finished (exit 0) with its refit window of weights 1 open"
    else:
        world.pods["job-1"].broken = "container trainer terminated (exit 2, Error)"
        lost = "pod job-1: container trainer terminated (exit 2, Error)"
    world.step()  # no time passes: the next decision sees it
    st = world.status
    assert st.phase == Phase.FAILED and st.reason == EventReason.BACKOFF_LIMIT_EXCEEDED, st.message
    assert st.message.startswith(f"{lost}; the agent last refused its trainer: {refusal}"), st.message


def test_a_trainer_that_exits_0_once_its_refit_window_closed_has_finished() -> None:
    world = World(make_spec(backoffLimit=0, refit={"source": "tensor"}))
    _refitting_tensor_window(world)
    world.agents["job-1"].refit_window = None  # its last push sent and the window closed
    world.pods["job-1"].completed = TRAINER
    world.step()
    assert world.status.phase == Phase.REFITTING, world.status.message
    world.agents["job-0"].refit_window = None
    world.settle()  # -> Resuming: the iteration in flight goes on
    assert world.status.phase == Phase.RESUMING, world.status.message


def _empty_lease(world: World) -> None:
    world.to_training()
    for agent in world.agents.values():
        agent.trainer_return_unchanged()
    world.tick()
    world.step()  # -> Refitting at the committed version, or Failed past the bound


def test_leases_given_back_empty_in_a_row_warn_then_fail_past_the_specs_bound() -> None:
    world = World(make_spec(iterations=2, maxLeasesWithoutWeights=3))
    world.bring_up()
    warnings: list[str] = []
    for count in (1, 2, 3):
        _empty_lease(world)
        st = world.status
        assert st.phase == Phase.REFITTING and st.leases_without_weights == count, st.message
        assert st.message == (
            f"every trainer gave the lease back without new weights ({count} in a row): back to committed 0"
        )
        degraded = st.condition(ConditionType.DEGRADED)
        warned = [
            e.message for e in world.decisions[-1].events if e.reason == EventReason.LEASES_WITHOUT_WEIGHTS
        ]
        if count == 1:  # one is AReaL's start-up offload and onload: nothing to say
            assert degraded is None or degraded.status == ConditionStatus.FALSE
            assert warned == []
        else:
            assert degraded is not None and degraded.status == ConditionStatus.TRUE
            assert degraded.reason == EventReason.LEASES_WITHOUT_WEIGHTS
            assert degraded.message == (
                f"{count} leases in a row given back without new weights (at most 3: "
                "spec.maxLeasesWithoutWeights); back to committed 0"
            )
            assert warned == [degraded.message]
            warnings += warned
        world.settle()  # -> Resuming
        world.settle()  # -> Rollout of iteration 1 again
        assert world.status.phase == Phase.ROLLOUT and world.status.iteration == 1
    assert all(e.type.value == "Warning" for d in world.decisions for e in d.events if e.message in warnings)
    _empty_lease(world)  # the fourth in a row
    st = world.status
    assert st.phase == Phase.FAILED and st.reason == EventReason.LEASES_WITHOUT_WEIGHTS_EXCEEDED
    assert st.message.startswith(
        "4 leases in a row given back without new weights, more than spec.maxLeasesWithoutWeights (3): the "
        "trainers release and resume SGLang without pushing or loading weights"
    ), st.message
    assert versions(world) == ["0"] and world.decisions[-1].delete_pods


def test_a_lease_with_weights_ends_the_count_of_those_without() -> None:
    world = World(make_spec(iterations=3, maxLeasesWithoutWeights=2))
    world.bring_up()
    for _ in range(2):
        _empty_lease(world)
        world.settle()
        world.settle()
    assert world.status.condition(ConditionType.DEGRADED).status == ConditionStatus.TRUE  # type: ignore[union-attr]
    world.run_iteration("1")
    st = world.status
    assert st.leases_without_weights == 0 and versions(world) == ["0", "1"]
    assert st.condition(ConditionType.DEGRADED).status == ConditionStatus.FALSE  # type: ignore[union-attr]
    for _ in range(2):  # two more in a row are within the bound again
        _empty_lease(world)
        world.settle()
        world.settle()
    assert world.status.phase == Phase.ROLLOUT and world.status.leases_without_weights == 2
