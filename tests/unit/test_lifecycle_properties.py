"""Property-based exploration of the lifecycle machine (hypothesis stateful testing).

Random interleavings of: decisions, repeated and stale agent reports, decisions whose commands are
lost (operator killed after writing status), agents finishing or failing commands, trainers asking
and publishing, pods lost at any phase, time jumps, suspend toggles. After every decision the seven
invariants of docs/lifecycle.md are checked against the world's truth."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from lifecycle_world import FakeAgent, World, decides_nothing_new, make_spec

from rljob.api.agent import CommandState, GrantCommand, RefitCommand, ReleaseCommand, ResumeCommand, Stage
from rljob.api.status import Phase, RLJobStatus
from rljob.lifecycle.lock_steps import LOCK_STEPS
from rljob.lifecycle.model import Decision, Observation

PODS = st.integers(min_value=0, max_value=2)
RARELY = st.sampled_from([True] + [False] * 4)
NOT_PAUSED = (Stage.STARTING, Stage.READY, Stage.SERVING)
SEQUENCED = (ReleaseCommand, RefitCommand, ResumeCommand)  # a follower gets these after its leader


class LifecycleMachine(RuleBasedStateMachine):
    world: World

    @initialize(
        replicas=st.integers(min_value=1, max_value=3),
        iterations=st.one_of(st.none(), st.integers(min_value=1, max_value=4)),
        backoff=st.integers(min_value=0, max_value=3),
        cache=st.sampled_from(["off"] * 9 + ["daemon"]),
        per=st.sampled_from([1, 1, 2]),  # pods per SGLang instance: 2 = leaders and followers
    )
    def setup(self, replicas: int, iterations: int | None, backoff: int, cache: str, per: int) -> None:
        replicas = per * -(-replicas // per)  # a multiple of podsPerInstance
        spec = make_spec(
            replicas=replicas, iterations=iterations, backoffLimit=backoff, rollout={"podsPerInstance": per}
        )
        self.world = World(spec, weight_cache_mode=cache)
        self.history: dict[str, list] = {}  # pod -> earlier reports, for stale replays
        self.terminal: Phase | None = None

    # --- helpers -----------------------------------------------------------------------------

    def gang_agents(self) -> list[FakeAgent]:
        w = self.world
        return [
            w.agents[n]
            for n, p in w.pods.items()
            if n in w.agents and p.gang == w.status.restarts and p.phase == "Running"
        ]

    def agent_at(self, i: int) -> FakeAgent | None:
        agents = list(self.world.agents.values())
        return agents[i % len(agents)] if agents else None

    def snapshot(self) -> None:
        for name, agent in self.world.agents.items():
            self.history.setdefault(name, []).append(agent.report())

    def check(self, before_version: str | None, decision: Decision) -> None:
        w = self.world
        st_ = decision.status
        gang = self.gang_agents()
        commands = [pc.command for pc in decision.commands]
        # 1. release only when every gang member is paused and idle (drained)
        if any(isinstance(c, ReleaseCommand) for c in commands):
            assert all(a.stage not in NOT_PAUSED for a in gang), [a.stage for a in gang]
        # 3. the lease only after every pod verified its freed memory
        if any(isinstance(c, GrantCommand) for c in commands):
            assert all(a.verified or a.stage in (Stage.GRANTED, Stage.TRAINED) for a in gang)
        # 5. never touch weights under a weight cache
        if w.weight_cache_mode != "off":
            assert not any(isinstance(c, ReleaseCommand | RefitCommand) for c in commands)
        # 4. rollout reopens only on one verified version, KV flushed after the refit
        if st_.phase == Phase.ROLLOUT:
            assert len(gang) == w.spec.replicas
            for a in gang:
                assert a.served_version == st_.weight_version
                assert a.kv_flushed_after_refit
                assert a.stage == Stage.SERVING
        # 6. weightVersion never goes backwards, and moves only once every pod serves it
        if st_.weight_version != before_version:
            assert st_.weight_version is not None
            if before_version is not None:
                assert int(st_.weight_version) > int(before_version)
            assert all(a.served_version == st_.weight_version for a in gang)
        # 2/7. the machine never asked an agent for something it refuses (double release, stale epoch,
        # resume of an unreleased tag, grant before verification, ...)
        assert w.refusals() == [], w.refusals()
        # a lock-step phase sends its row's command, stamped with the status epoch
        row = LOCK_STEPS.get(st_.phase)
        if row is not None:
            assert all(c.action == row.action and c.epoch == st_.epoch for c in commands), commands
        # a follower's release, refit and resume follow its leader's: the leader's SGLang call is what acts
        # on the follower's ranks (C-NODE), so the leader finished that very epoch first
        per = w.spec.rollout.pods_per_instance
        for pc in decision.commands:
            pod = w.pods.get(pc.pod)
            if pod is None or pod.index % per == 0 or not isinstance(pc.command, SEQUENCED):
                continue
            leader = next(
                (
                    w.agents.get(n)
                    for n, p in w.pods.items()
                    if p.gang == pod.gang and p.index == pod.index - pod.index % per
                ),
                None,
            )
            assert leader is not None and leader.last is not None, pc
            assert (leader.last.epoch, leader.last.state) == (pc.command.epoch, CommandState.SUCCEEDED), pc
        # terminal phases are sticky
        if self.terminal is not None:
            assert st_.phase == self.terminal
        if st_.phase.terminal:
            self.terminal = st_.phase

    def decide(self, obs: Observation | None = None, drop_commands: bool = False) -> Decision:
        self.snapshot()
        before = self.world.status.weight_version
        from rljob.lifecycle.machine import decide

        given = self.world.status
        before_dump = given.model_dump()
        obs = obs or self.world.observe()
        decision = decide(self.world.spec, given, obs)
        assert given.model_dump() == before_dump, "decide changed its input status"
        self.check_skippable(given, obs, decision)
        self.check_next_due(given, obs, decision)
        if drop_commands:  # operator killed after the status write, before acting
            decision = Decision(status=decision.status)
        self.world.apply(decision)
        self.check(before, decision)
        event(f"reached {decision.status.phase.value}")
        return decision

    def check_skippable(self, given: RLJobStatus, obs: Observation, decision: Decision) -> None:
        """A decision the conductor skips (lifecycle_world.decides_nothing_new after the last one's
        awaiting) is one that would have waited on: nothing created, deleted or said, the same status, and
        commands only to pods that accepted them already."""
        last = getattr(self, "last", None)
        # The conductor compares a round's inputs with those of the last decision, the status it was
        # given among them: a decision that changed the status is always followed by another. The world
        # keeps generation 1 through spec edits: the spec stands for it (every edit moves the generation).
        self.last = (obs, decision, self.world.spec, given)
        if last is None:
            return
        last_obs, last_decision, last_spec, last_given = last
        same_world = (obs.now, obs.pods, obs.generation, obs.spec_error, obs.admission, obs.refusals) == (
            last_obs.now, last_obs.pods, last_obs.generation, last_obs.spec_error, last_obs.admission,
            last_obs.refusals,
        ) and self.world.spec == last_spec  # fmt: skip
        if not same_world or given != last_given:
            return
        changed = {
            n
            for n in obs.agents.keys() | last_obs.agents.keys()
            if obs.agents.get(n) != last_obs.agents.get(n)
        }
        # what the agents took: a command delivered but not reported yet (a stale report) is accepted
        accepted = {
            n for n, a in self.world.agents.items() if a.last is not None and a.last.epoch >= given.epoch
        }
        if not decides_nothing_new(last_decision.awaiting, changed, obs.agents, accepted):
            return
        event(f"a skippable decision in {given.phase.value}")
        # Commands only to pods that took them already (the conductor never sends those again).
        awaited = {(a.pod, a.epoch, a.action) for a in last_decision.awaiting}
        sent = {(pc.pod, pc.command.epoch, pc.command.action) for pc in decision.commands}
        assert sent <= awaited and {pod for pod, _, _ in sent} <= accepted, decision
        assert (decision.create_pods, decision.delete_pods) == ((), ()), decision
        assert decision.events == (), decision.events
        assert decision.status == given, "a skipped decision would have changed the status"
        self.last = last  # the conductor keeps the last decision it made

    def check_next_due(self, given: RLJobStatus, obs: Observation, decision: Decision) -> None:
        """Decision.next_due: a decision that wrote nothing is the same at any time before it (then the
        conductor, observing nothing new, need not decide again), and no longer the same at it."""
        if decision.status != given:
            return  # the conductor writes it and decides again at once
        from rljob.lifecycle.machine import decide

        tick = timedelta(microseconds=1)
        before = decision.next_due - tick if decision.next_due else obs.now + timedelta(days=400)
        if before > obs.now:
            assert decide(self.world.spec, given, replace(obs, now=before)) == decision
        if decision.next_due is not None:
            event("a decision that is due later")
            after = decide(self.world.spec, given, replace(obs, now=decision.next_due + tick))
            assert after != decision, "next_due came and time changed nothing"

    # --- rules -------------------------------------------------------------------------------

    @rule()
    def operator_decides(self) -> None:
        self.decide()

    @rule()
    def operator_killed_after_status_write(self) -> None:
        self.decide(drop_commands=True)

    @rule()
    def repeated_observation(self) -> None:
        obs = self.world.observe()
        first = self.decide(obs)
        epoch = first.status.epoch
        second = self.decide(obs)
        assert second.status.epoch == epoch or first.status.phase != second.status.phase
        if first.status.phase == second.status.phase:
            sent = {(pc.pod, pc.command.epoch, pc.command.action) for pc in first.commands}
            again = {(pc.pod, pc.command.epoch, pc.command.action) for pc in second.commands}
            assert again <= sent

    @precondition(lambda self: any(self.history.values()))
    @rule(i=PODS, age=st.integers(min_value=1, max_value=6))
    def stale_report(self, i: int, age: int) -> None:
        names = [n for n in self.world.agents if self.history.get(n)]
        if not names:
            return
        name = names[i % len(names)]
        older = self.history[name]
        self.world.stale[name] = older[-min(age, len(older))]
        self.decide()

    @rule()
    def kubelet_starts_pods(self) -> None:
        self.world.start_pods()

    @rule(i=PODS, ok=st.sampled_from([True] * 12 + [False]))
    def agent_finishes(self, i: int, ok: bool) -> None:
        agent = self.agent_at(i)
        if agent is not None:
            agent.finish(ok)

    @rule()
    def all_agents_finish(self) -> None:
        self.world.finish_all()

    @rule(i=PODS)
    def trainer_requests(self, i: int) -> None:
        agent = self.agent_at(i)
        if agent is not None:
            agent.trainer_request()

    @rule()
    def all_trainers_request(self) -> None:
        self.world.trainers_request()

    @rule(bump=st.sampled_from([1] * 10 + [0, 2]))
    def all_trainers_publish(self, bump: int) -> None:
        current = self.world.status.weight_version or "0"
        self.world.trainers_publish(str(int(current) + bump))

    @rule(steps=st.integers(min_value=1, max_value=8))
    def world_makes_progress(self, steps: int) -> None:
        """A well-behaved stretch: without it random rules rarely get past the first drain."""
        for _ in range(steps):
            self.world.start_pods()
            self.world.finish_all()
            self.world.trainers_request()
            current = self.world.status.weight_version or "0"
            self.world.trainers_publish(str(int(current) + 1))
            self.world.tick(1)
            self.decide()

    @rule(i=PODS, how=st.sampled_from(["delete", "crash"]), really=RARELY)
    def pod_lost(self, i: int, how: str, really: bool) -> None:
        names = list(self.world.pods)
        if not names or not really:
            return
        name = names[i % len(names)]
        if how == "delete":
            del self.world.pods[name]
            self.world.agents.pop(name, None)
        else:
            self.world.pods[name].broken = "container sglang terminated (exit 1)"

    @rule(seconds=st.sampled_from([0.5, 1, 5, 30, 400, 2000]))
    def time_passes(self, seconds: float) -> None:
        self.world.tick(seconds)

    @rule(really=RARELY)
    def toggle_suspend(self, really: bool) -> None:
        w = self.world
        if not really and not w.spec.suspend:
            return
        w.spec = w.spec.model_copy(update={"suspend": not w.spec.suspend})

    @invariant()
    def status_is_valid(self) -> None:
        st_ = self.world.status
        type(st_).model_validate(st_.model_dump())  # bounded lists, ranges
        assert st_.restarts <= self.world.spec.backoff_limit


TestLifecycleProperties = LifecycleMachine.TestCase
TestLifecycleProperties.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_happy_interleavings_make_progress() -> None:
    """Guard against a machine that satisfies every invariant by never doing anything."""
    world = World(make_spec(iterations=2, replicas=3))
    world.bring_up()
    world.run_iteration("1")
    world.run_iteration("2")
    assert world.status.phase == Phase.SUCCEEDED
