"""Events are for people: one per thing that happened, never one per round the machine looks at it."""

from __future__ import annotations

import dataclasses
from collections import Counter

from lifecycle_world import World, make_spec

from rljob.api.status import Phase
from rljob.lifecycle.model import AgentRefusal, Decision, EventReason, EventType


def reasons(decisions: list[Decision]) -> Counter[EventReason]:
    return Counter(e.reason for d in decisions for e in d.events)


def test_pods_deleted_is_posted_once_while_the_pods_terminate() -> None:
    world = World(make_spec(iterations=3))
    world.graceful_delete = True
    world.bring_up()
    world.spec = world.spec.model_copy(update={"suspend": True})
    world.step()  # -> Draining (stopping), drain sent
    world.finish_all()
    world.step()  # drained -> Releasing, release sent
    assert world.status.phase == Phase.RELEASING and world.status.stopping
    world.finish_all()
    first = world.step()  # released: Suspending asks the gang to go
    assert set(first.delete_pods) == {"job-0", "job-1"}
    assert [e.reason for e in first.events] == [EventReason.PHASE_CHANGED, EventReason.PODS_DELETED]
    later = [world.step() for _ in range(3)]  # the pods are still terminating
    assert all(d.events == () for d in later)
    assert all(d.delete_pods == () for d in later)  # nothing asked twice either
    assert world.status.phase == Phase.SUSPENDING
    world.pods_terminate()
    done = world.step()
    assert world.status.phase == Phase.SUSPENDED
    assert [e.reason for e in done.events] == [EventReason.SUSPENDED]
    assert reasons(world.decisions)[EventReason.PODS_DELETED] == 1


def test_one_lost_pod_posts_one_gang_member_lost() -> None:
    world = World(make_spec(backoffLimit=2))
    world.graceful_delete = True
    world.bring_up()
    world.trainers_request()
    world.step()  # -> Draining
    del world.pods["job-1"]
    world.agents.pop("job-1")
    decision = world.step()
    assert world.status.phase == Phase.RECOVERING
    lost = [e for e in decision.events if e.reason == EventReason.GANG_MEMBER_LOST]
    assert len(lost) == 1 and lost[0].type == EventType.WARNING
    assert "job-1" in lost[0].message or "#1" in lost[0].message
    for _ in range(3):  # job-0 still terminating: rounds in Recovering post nothing
        assert world.step().events == ()
    world.pods_terminate()
    world.step()
    assert world.status.phase == Phase.PENDING
    assert reasons(world.decisions)[EventReason.GANG_MEMBER_LOST] == 1


def test_a_timed_out_phase_posts_the_timeout_and_the_restart_once_each() -> None:
    world = World(make_spec(backoffLimit=2))
    world.bring_up()
    world.trainers_request()
    world.step()  # -> Draining, never finishes
    world.tick(301)
    decision = world.step()
    assert world.status.phase == Phase.RECOVERING
    assert [e.reason for e in decision.events] == [EventReason.PHASE_TIMEOUT, EventReason.GANG_MEMBER_LOST]


def test_losing_the_last_restart_posts_the_loss_and_the_failure() -> None:
    world = World(make_spec(backoffLimit=0))
    world.bring_up()
    world.pods["job-0"].broken = "container sglang terminated (exit 1)"
    decision = world.step()
    assert world.status.phase == Phase.FAILED
    assert [e.reason for e in decision.events] == [
        EventReason.GANG_MEMBER_LOST,
        EventReason.BACKOFF_LIMIT_EXCEEDED,
    ]


def test_a_whole_run_posts_each_phase_change_once() -> None:
    world = World(make_spec(iterations=2))
    world.bring_up()
    world.run_iteration("1")
    for _ in range(3):  # rounds with nothing new post nothing
        world.tick()
        assert world.step().events == ()
    world.run_iteration("2")
    counts = reasons(world.decisions)
    assert counts[EventReason.WEIGHTS_COMMITTED] == 3  # 0 at start, then 1 and 2
    assert counts[EventReason.COMPLETED] == 1
    assert counts[EventReason.PODS_CREATED] == 1
    assert all(e.type == EventType.NORMAL for d in world.decisions for e in d.events)


def test_agent_refusals_become_one_warning_event_each_through_the_decision() -> None:
    """The conductor hands each refusal to exactly one decision (controller/agent_link.py); decide turns it
    into a CommandRefused Warning, and a round without new refusals posts none."""
    world = World(make_spec(iterations=3))
    world.bring_up()
    obs = dataclasses.replace(
        world.observe(), refusals=(AgentRefusal("job-1", "Busy: a refit window is open"),)
    )
    refused = world.step(obs)
    warnings = [e for e in refused.events if e.reason == EventReason.COMMAND_REFUSED]
    assert [(e.type, e.message) for e in warnings] == [
        (EventType.WARNING, "job-1: Busy: a refit window is open")
    ]
    assert all(e.reason != EventReason.COMMAND_REFUSED for e in world.step().events)


def test_a_permanent_refusal_fails_the_job_in_one_decision_without_a_restart() -> None:
    """docs/lifecycle.md, "Permanent refusals": SGLang's version or launch flags forbid the drain the spec
    asks for, so no retry and no new gang can change it. The next decision fails the job with the agent's
    reason and what to change: one Warning event, no restart, no release sent, the pods deleted."""
    world = World(make_spec(iterations=3))
    world.bring_up()
    world.trainers_request()
    world.step()
    assert world.status.phase == Phase.DRAINING
    why = "HTTP 409: SGLang 0.5.15.post1 counts retracted requests ... Set spec.rollout.drain.mode: abort"
    refusals = tuple(AgentRefusal(p, why, "RetractUnsupported", permanent=True) for p in ("job-0", "job-1"))
    failed = world.step(dataclasses.replace(world.observe(), refusals=refusals))
    st = world.status
    assert (st.phase, st.reason, st.restarts) == (Phase.FAILED, "RetractUnsupported", 0)
    assert "spec.rollout.drain.mode: abort" in st.message and st.message.startswith("job-0: ")
    assert [(e.reason, e.type) for e in failed.events if e.type == EventType.WARNING] == [
        (EventReason.RETRACT_UNSUPPORTED, EventType.WARNING)
    ]
    assert failed.commands == ()
    assert set(failed.delete_pods) == {"job-0", "job-1"}


def test_a_transient_refusal_keeps_the_phase() -> None:
    """A refusal the moment explains (Busy, NotReady, ...) is an event, and the command is sent again."""
    world = World(make_spec(iterations=3))
    world.bring_up()
    world.trainers_request()
    world.step()
    refusals = (AgentRefusal("job-0", "HTTP 409: busy", "Busy"),)
    world.step(dataclasses.replace(world.observe(), refusals=refusals))
    assert world.status.phase == Phase.DRAINING and world.status.restarts == 0
