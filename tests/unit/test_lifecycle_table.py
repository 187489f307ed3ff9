"""The shape of the lifecycle machine: one row per lock-step phase, one handler per other phase, and
decide never changes its inputs."""

from __future__ import annotations

from lifecycle_world import World, make_spec

from rljob.api.agent import Action
from rljob.api.spec import PhaseTimeouts
from rljob.api.status import Phase
from rljob.lifecycle.lock_steps import LOCK_STEPS
from rljob.lifecycle.machine import HANDLERS, decide


def test_every_phase_has_exactly_one_place() -> None:
    terminal = {p for p in Phase if p.terminal}
    assert set(LOCK_STEPS).isdisjoint(HANDLERS)
    assert set(LOCK_STEPS) | set(HANDLERS) | terminal == set(Phase)
    assert not (set(LOCK_STEPS) | set(HANDLERS)) & terminal


def test_the_lock_step_rows() -> None:
    actions = {phase: row.action for phase, row in LOCK_STEPS.items()}
    assert actions == {
        Phase.DRAINING: Action.DRAIN,
        Phase.RELEASING: Action.RELEASE,
        Phase.TRAINING: Action.GRANT,
        Phase.REFITTING: Action.REFIT,
        Phase.RESUMING: Action.RESUME,
        Phase.SUSPENDING: Action.DRAIN,
    }
    timeouts = PhaseTimeouts(draining=1, releasing=2, training=3, refitting=4, resuming=5)
    deadlines = {phase: row.deadline(timeouts) for phase, row in LOCK_STEPS.items()}
    assert deadlines == {
        Phase.DRAINING: 1,
        Phase.RELEASING: 2,
        Phase.TRAINING: 3,
        Phase.REFITTING: 4,
        Phase.RESUMING: 5,
        Phase.SUSPENDING: 1,
    }
    assert [p for p, row in LOCK_STEPS.items() if row.best_effort] == [Phase.SUSPENDING]


def test_each_lock_step_sends_its_rows_action_at_its_epoch() -> None:
    world = World(make_spec(replicas=2, iterations=2))
    world.bring_up()
    seen: set[Phase] = set()
    for _ in range(12):
        world.trainers_request()
        world.trainers_publish(str(int(world.status.weight_version or "0") + 1))
        world.tick()
        decision = world.step()
        world.finish_all()
        phase = decision.status.phase
        if phase in LOCK_STEPS and decision.commands:
            seen.add(phase)
            assert {pc.command.action for pc in decision.commands} == {LOCK_STEPS[phase].action}
            assert {pc.command.epoch for pc in decision.commands} == {decision.status.epoch}
    assert seen == set(LOCK_STEPS) - {Phase.SUSPENDING}
    assert world.refusals() == []


def test_decide_never_changes_the_status_it_was_given() -> None:
    world = World(make_spec(replicas=3, iterations=2))
    world.bring_up()
    world.run_iteration("1")  # the timeline has closed spans, history and a profile
    world.trainers_request()
    for _ in range(8):  # every phase of an iteration, spans opened and closed on the way
        world.tick()
        world.trainers_publish("2")
        status, obs = world.status, world.observe()
        before = status.model_dump()
        agents_before = {n: a.model_dump() for n, a in obs.agents.items() if a is not None}
        decision = decide(world.spec, status, obs)
        assert status.model_dump() == before
        assert {n: a.model_dump() for n, a in obs.agents.items() if a is not None} == agents_before
        assert decision.status is not status
        world.apply(decision)
        world.finish_all()
    assert world.status.phase == Phase.SUCCEEDED


def test_closing_a_span_does_not_write_into_the_previous_status() -> None:
    world = World(make_spec())
    world.bring_up()
    world.trainers_request()
    world.tick(10)
    rollout_status = world.status
    open_span = rollout_status.timeline[-1]
    assert open_span.phase == Phase.ROLLOUT and open_span.seconds is None
    world.step()  # -> Draining: closes the Rollout span
    assert world.status.timeline[-2].seconds == 10
    assert open_span.seconds is None and open_span.cache_hit_rate is None
    assert rollout_status.timeline[-1] is open_span
