"""The inputs decide takes beyond pods and agents: a spec that cannot run (InvalidSpec), a command
failure the agent marks permanent, and spec.iterations raised after the job Succeeded."""

from __future__ import annotations

from dataclasses import replace

from lifecycle_world import World, make_spec

from rljob.api.agent import ReleaseCommand
from rljob.api.status import ConditionStatus, ConditionType, Phase, RLJobStatus
from rljob.lifecycle.machine import decide
from rljob.lifecycle.model import Decision, EventReason, EventType, Observation

REFUSED = "spec.template.metadata.labels.team: a valid label must be 63 characters or less"


def conditions(status: RLJobStatus) -> dict[ConditionType, ConditionStatus]:
    return {c.type: c.status for c in status.conditions}


def assert_failed_invalid(decision: Decision, message: str) -> None:
    st = decision.status
    assert st.phase == Phase.FAILED
    assert st.reason == EventReason.INVALID_SPEC
    assert st.message == message
    assert st.completion_time is not None
    got = conditions(st)
    assert got[ConditionType.FAILED] == ConditionStatus.TRUE
    for type_ in (ConditionType.READY, ConditionType.PROGRESSING, ConditionType.COMPLETE):
        assert got[type_] == ConditionStatus.FALSE
    failed = st.condition(ConditionType.FAILED)
    assert failed is not None and failed.reason == "InvalidSpec" and failed.message == message
    assert [(e.reason, e.type) for e in decision.events] == [(EventReason.INVALID_SPEC, EventType.WARNING)]
    assert decision.events[0].message == message
    assert decision.commands == () and decision.create_pods == ()


# --- InvalidSpec ------------------------------------------------------------------------------------------


def test_a_spec_the_models_refuse_fails_a_new_job_once() -> None:
    world = World(make_spec())
    obs = Observation(now=world.now, generation=1, spec_error=REFUSED)
    first = decide(None, RLJobStatus(), obs)
    assert_failed_invalid(first, REFUSED)
    assert first.status.observed_generation == 1
    again = decide(None, first.status, replace(obs, now=world.now.replace(second=5)))
    assert again.status.phase == Phase.FAILED and again.status.reason == EventReason.INVALID_SPEC
    assert again.events == ()
    assert again.status.conditions == first.status.conditions


def test_agents_that_drive_another_engine_than_the_jobs_fail_it_before_any_memory_is_touched() -> None:
    """The agents report their engine (here the default); a job on another engine fails at start."""
    world = World(
        make_spec(engine="vllm", template={"spec": {"containers": [{"name": "vllm"}, {"name": "trainer"}]}})
    )
    world.step()
    world.start_pods()
    world.step()
    world.step()
    assert world.status.phase == Phase.FAILED and world.status.reason == EventReason.INVALID_SPEC
    assert "job-0's agent drives SGLang, but the job's spec.engine is vllm" in str(world.status.message)
    assert all(not a.release_calls for a in world.agents.values())


def test_a_refused_spec_mid_run_fails_the_job_and_deletes_its_pods() -> None:
    world = World(make_spec())
    world.bring_up()
    world.run_iteration("1")
    before = world.status
    obs = replace(world.observe(), spec_error=REFUSED)
    decision = decide(None, before, obs)
    assert_failed_invalid(decision, REFUSED)
    assert set(decision.delete_pods) == {"job-0", "job-1"}
    assert decision.status.weight_version == "1"  # what was committed stays on record
    assert before.phase == Phase.ROLLOUT  # the input is not changed
    world.apply(decision)
    assert world.pods == {}
    repeat = decide(None, decision.status, obs)  # the same round again: no second event
    assert repeat.events == () and repeat.status.phase == Phase.FAILED


def test_a_child_the_api_server_refused_fails_the_job_with_the_field_named() -> None:
    world = World(make_spec())
    world.step()  # asks for the pods; the API server refuses them
    error = "pods job-0: metadata.labels: Invalid value: 'x' * 64: must be no more than 63 characters"
    obs = replace(world.observe(), spec_error=error)
    decision = decide(world.spec, world.status, obs)
    assert_failed_invalid(decision, error)
    world.apply(decision)
    repeat = world.step(replace(world.observe(), spec_error=error))
    assert repeat.events == () and repeat.create_pods == ()


def test_a_long_spec_error_is_cut_to_the_status_bound() -> None:
    error = "spec.template: " + "x" * 3000
    decision = decide(None, RLJobStatus(), Observation(now=World(make_spec()).now, spec_error=error))
    assert decision.status.phase == Phase.FAILED
    assert decision.status.message == error[:1024]
    type(decision.status).model_validate(decision.status.model_dump())  # bounded strings
    assert decision.events[0].message == error[:1024]


def test_a_finished_job_stays_as_it_was_when_its_spec_turns_invalid() -> None:
    world = World(make_spec(backoffLimit=0))
    world.bring_up()
    world.pods["job-0"].broken = "container sglang terminated (exit 1)"
    world.step()
    assert world.status.reason == EventReason.BACKOFF_LIMIT_EXCEEDED
    decision = decide(None, world.status, replace(world.observe(), spec_error=REFUSED))
    assert decision.status.phase == Phase.FAILED
    assert decision.status.reason == EventReason.BACKOFF_LIMIT_EXCEEDED  # sticky
    assert decision.events == ()


# --- permanent command failures ------------------------------------------------------------------------


def walk_to_releasing(world: World) -> None:
    world.bring_up()
    world.trainers_request()
    world.step()  # -> Draining
    world.finish_all()
    decision = world.step()  # -> Releasing, release sent
    assert world.status.phase == Phase.RELEASING
    assert all(isinstance(pc.command, ReleaseCommand) for pc in decision.commands)


def test_a_permanent_release_shortfall_fails_the_job_without_a_restart() -> None:
    world = World(make_spec(backoffLimit=3, release={"tags": ["cuda_graph"]}))
    walk_to_releasing(world)
    why = "cuda_graph freed 0.2% of GPU 0's memory, verify asks 50%: no retry can free more"
    world.agents["job-1"].finish(ok=False, permanent=True, reason="ReleaseShortfall", error=why)
    world.agents["job-0"].finish()
    decision = world.step()
    st = decision.status
    assert st.phase == Phase.FAILED
    assert st.reason == EventReason.RELEASE_SHORTFALL == "ReleaseShortfall"
    assert st.message == why
    assert st.restarts == 0
    assert conditions(st)[ConditionType.FAILED] == ConditionStatus.TRUE
    assert [e.reason for e in decision.events] == [EventReason.RELEASE_SHORTFALL]
    assert set(decision.delete_pods) == {"job-0", "job-1"}
    world.tick(1000)
    assert world.step().status.phase == Phase.FAILED


def test_a_permanent_failure_with_an_unknown_reason_reads_command_failed() -> None:
    world = World(make_spec(backoffLimit=3))
    walk_to_releasing(world)
    world.agents["job-0"].finish(ok=False, permanent=True, reason="SomethingNewer", error="cannot ever")
    decision = world.step()
    assert decision.status.phase == Phase.FAILED
    assert decision.status.reason == EventReason.COMMAND_FAILED
    assert decision.status.message == "cannot ever"
    assert decision.status.restarts == 0


def test_a_failure_that_is_not_permanent_still_restarts_the_gang() -> None:
    world = World(make_spec(backoffLimit=3))
    walk_to_releasing(world)
    world.agents["job-0"].finish(ok=False, reason="ReleaseShortfall", error="GPU 0 still busy")
    decision = world.step()
    assert decision.status.phase == Phase.RECOVERING
    assert decision.status.restarts == 1


def test_a_permanent_failure_while_suspending_does_not_fail_the_job() -> None:
    world = World(make_spec())
    world.bring_up()
    world.spec = world.spec.model_copy(update={"suspend": True})
    world.step()  # -> Draining (stopping), drain sent
    world.finish_all()
    world.step()  # -> Releasing, release sent
    for agent in world.agents.values():
        agent.finish(ok=False, permanent=True, reason="ReleaseShortfall", error="x")
    world.step()  # the pods go anyway: Suspending deletes them
    world.step()
    assert world.status.phase == Phase.SUSPENDED


# --- spec.iterations raised after Succeeded --------------------------------------------------------------


def succeed(world: World, versions: list[str]) -> None:
    world.bring_up()
    for version in versions:
        world.run_iteration(version)
    assert world.status.phase == Phase.SUCCEEDED


def test_raised_iterations_continue_on_the_kept_pods() -> None:
    world = World(make_spec(iterations=1, podsAfterFinished="Keep"))
    succeed(world, ["1"])
    world.tick()
    assert world.step().delete_pods == ()  # kept
    world.spec = world.spec.model_copy(update={"iterations": 3})
    decision = world.step()
    st = decision.status
    assert st.phase == Phase.ROLLOUT
    assert st.iteration == 2
    assert st.reason == EventReason.ITERATIONS_RAISED
    assert "iterations raised to 3" in (st.message or "")
    assert st.completion_time is None
    complete = st.condition(ConditionType.COMPLETE)
    assert complete is not None and complete.status == ConditionStatus.FALSE
    assert complete.reason == "IterationsRaised"
    assert [(e.reason, e.type) for e in decision.events] == [
        (EventReason.ITERATIONS_RAISED, EventType.NORMAL)
    ]
    assert decision.create_pods == () and decision.delete_pods == () and decision.commands == ()
    world.run_iteration("2")
    world.run_iteration("3")
    st = world.status
    assert st.phase == Phase.SUCCEEDED and st.iteration == 3 and st.weight_version == "3"
    assert [w.version for w in st.weight_history] == ["0", "1", "2", "3"]
    assert st.restarts == 0
    assert world.refusals() == []


def test_raised_iterations_recreate_a_deleted_gang_at_the_committed_weights() -> None:
    world = World(make_spec(iterations=1))
    succeed(world, ["1"])
    world.step()  # podsAfterFinished: Delete
    assert world.pods == {}
    world.spec = world.spec.model_copy(update={"iterations": 2})
    decision = world.step()
    assert decision.status.phase == Phase.PENDING
    assert decision.status.reason == EventReason.ITERATIONS_RAISED
    assert decision.status.condition(ConditionType.COMPLETE).status == ConditionStatus.FALSE  # type: ignore[union-attr]
    world.step()  # creates the gang
    world.start_pods()  # fresh SGLang serves the initial weights "0"
    world.step()  # -> Initializing
    refit = world.step()  # serves 0, committed is 1 -> Refitting
    assert world.status.phase == Phase.REFITTING
    assert {pc.command.version for pc in refit.commands} == {"1"}  # type: ignore[union-attr]
    world.finish_all()
    world.step()
    world.finish_all()
    world.step()
    assert world.status.phase == Phase.ROLLOUT and world.status.iteration == 2
    world.run_iteration("2")
    st = world.status
    assert st.phase == Phase.SUCCEEDED and st.iteration == 2 and st.weight_version == "2"
    assert st.restarts == 0  # nothing failed: backoffLimit is not spent
    assert world.refusals() == []


def test_raised_iterations_replace_a_kept_gang_that_stopped_serving() -> None:
    world = World(make_spec(iterations=1, podsAfterFinished="Keep", backoffLimit=0))
    succeed(world, ["1"])
    world.pods["job-1"].broken = "container trainer terminated (exit 0)"  # its loop ended
    world.spec = world.spec.model_copy(update={"iterations": 2})
    decision = world.step()
    assert decision.status.phase == Phase.RECOVERING
    assert decision.status.restarts == 0
    assert set(decision.delete_pods) == {"job-0", "job-1"}
    assert [(e.reason, e.type) for e in decision.events] == [
        (EventReason.ITERATIONS_RAISED, EventType.NORMAL)
    ]
    world.step()
    assert world.status.phase == Phase.PENDING
    world.step()
    world.start_pods()
    for _ in range(4):
        world.step()
        world.finish_all()
    assert world.status.phase == Phase.ROLLOUT and world.status.iteration == 2
    world.run_iteration("2")
    assert world.status.phase == Phase.SUCCEEDED and world.status.restarts == 0


def test_iterations_not_raised_leave_a_succeeded_job_alone() -> None:
    world = World(make_spec(iterations=2))
    succeed(world, ["1", "2"])
    decision = world.step()
    assert decision.status.phase == Phase.SUCCEEDED and decision.events == ()


def test_a_failed_job_stays_failed_when_iterations_are_raised() -> None:
    world = World(make_spec(iterations=1, backoffLimit=0))
    world.bring_up()
    world.pods["job-0"].broken = "container sglang terminated (exit 1)"
    world.step()
    assert world.status.phase == Phase.FAILED
    world.spec = world.spec.model_copy(update={"iterations": 5})
    decision = world.step()
    assert decision.status.phase == Phase.FAILED and decision.events == ()
