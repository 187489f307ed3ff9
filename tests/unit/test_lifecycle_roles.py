"""Leaders and followers (spec.rollout.podsPerInstance > 1): the commands each role gets, in which order,
and what a follower's report must show before the job moves on (agent/follower.py is the follower's side)."""

from __future__ import annotations

from lifecycle_world import World, make_spec

from rljob.api.agent import (
    Action,
    CommandState,
    DrainCommand,
    GrantCommand,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
)
from rljob.api.status import Phase
from rljob.lifecycle.lock_steps import LOCK_STEPS
from rljob.lifecycle.model import Decision, EventReason
from rljob.lifecycle.roles import Role, role_of

LEADERS, FOLLOWERS = {"job-0", "job-2"}, {"job-1", "job-3"}


def two_instances_of_two(**overrides: object) -> World:
    world = World(make_spec(replicas=4, rollout={"podsPerInstance": 2}, **overrides))
    world.bring_up()
    assert world.status.phase == Phase.ROLLOUT, world.status.message
    return world


def sent(decision: Decision, kind: type) -> set[str]:
    return {pc.pod for pc in decision.commands if isinstance(pc.command, kind)}


def finish(world: World, pods: set[str], ok: bool = True, error: str | None = None) -> None:
    for name in pods:
        world.agents[name].finish(ok, error=error)


def test_roles_by_index() -> None:
    assert [role_of(i, 2) for i in range(4)] == [Role.LEADER, Role.FOLLOWER, Role.LEADER, Role.FOLLOWER]
    assert {role_of(i, 1) for i in range(3)} == {Role.LEADER}
    assert [row.after_leader for row in LOCK_STEPS.values()] == [False, True, False, True, True, False]


def test_drain_and_grant_go_to_every_pod_at_once() -> None:
    world = two_instances_of_two()
    world.trainers_request()
    world.tick()
    decision = world.step()
    assert world.status.phase == Phase.DRAINING
    assert sent(decision, DrainCommand) == LEADERS | FOLLOWERS
    world.settle()  # -> Releasing
    world.settle()  # -> Training
    assert world.status.phase == Phase.TRAINING
    grants = [d for d in world.decisions if sent(d, GrantCommand)]
    assert sent(grants[0], GrantCommand) == LEADERS | FOLLOWERS


def test_a_follower_is_released_only_after_its_leader_and_the_lease_waits_for_it() -> None:
    world = two_instances_of_two()
    world.trainers_request()
    world.tick()
    world.step()
    world.settle()  # drained -> Releasing
    first = world.decisions[-1]
    assert world.status.phase == Phase.RELEASING
    assert sent(first, ReleaseCommand) == LEADERS  # the leaders' SGLang calls act on the followers' ranks
    finish(world, {"job-0"})
    world.tick()
    decision = world.step()
    assert sent(decision, ReleaseCommand) == {"job-1"}  # instance 1's leader is still releasing
    finish(world, {"job-2"})
    decision = world.step()
    assert sent(decision, ReleaseCommand) == {"job-3"}
    assert world.status.phase == Phase.RELEASING  # the followers have not verified their GPUs yet
    finish(world, {"job-1"})
    world.step()
    assert world.status.phase == Phase.RELEASING and not sent(world.decisions[-1], GrantCommand)
    finish(world, {"job-3"})
    decision = world.step()
    assert world.status.phase == Phase.TRAINING  # every GPU of every pod freed: the lease, on every pod
    assert sent(decision, GrantCommand) == LEADERS | FOLLOWERS
    assert world.refusals() == []


def test_a_follower_that_cannot_verify_its_release_restarts_the_gang_without_a_lease() -> None:
    world = two_instances_of_two()
    world.trainers_request()
    world.tick()
    world.step()
    world.settle()
    finish(world, LEADERS)
    world.step()  # the followers' releases go out
    finish(world, {"job-1"})
    why = "release not verified within 60s: GPU 1 freed 0 of 30064771072 bytes"
    finish(world, {"job-3"}, ok=False, error=why)
    decision = world.step()
    assert world.status.phase == Phase.RECOVERING
    assert not any(isinstance(pc.command, GrantCommand) for d in world.decisions for pc in d.commands)
    failed = [e for e in decision.events if e.reason == EventReason.COMMAND_FAILED]
    assert failed and "job-3" in failed[0].message and "GPU 1 freed 0" in failed[0].message


def test_refit_and_resume_reach_followers_after_their_leader_with_the_leaders_version() -> None:
    world = two_instances_of_two(iterations=2)
    world.trainers_request()
    world.tick()
    world.step()
    world.settle()
    world.settle()
    world.tick()
    world.finish_all()  # grant
    world.step()
    world.trainers_publish("1")
    decision = world.step()
    assert world.status.phase == Phase.REFITTING
    assert sent(decision, RefitCommand) == LEADERS
    world.settle()
    assert world.status.phase == Phase.RESUMING
    refits = [pc for d in world.decisions for pc in d.commands if isinstance(pc.command, RefitCommand)]
    assert {pc.pod for pc in refits} == LEADERS | FOLLOWERS
    resume = next(d for d in reversed(world.decisions) if sent(d, ResumeCommand))
    assert sent(resume, ResumeCommand) == LEADERS
    assert {pc.command.version for pc in resume.commands} == {None}  # a leader reads SGLang's own version
    world.settle()
    assert world.status.phase == Phase.ROLLOUT and world.status.weight_version == "1"
    followers = [
        pc.command
        for d in world.decisions
        for pc in d.commands
        if isinstance(pc.command, ResumeCommand) and pc.pod in FOLLOWERS
    ]
    assert {c.version for c in followers[-2:]} == {"1"}  # what their leaders verified
    assert {world.agents[n].served_version for n in FOLLOWERS} == {"1"}


def test_initializing_reads_the_served_version_from_the_leaders_only() -> None:
    """Followers cannot tell what they serve (no SGLang API): a gang whose leaders serve the committed
    version resumes without a refit."""
    world = World(make_spec(replicas=4, rollout={"podsPerInstance": 2}))
    world.step()
    world.start_pods()
    assert world.agents["job-1"].served_version is None
    world.step()
    decision = world.step()
    assert world.status.phase == Phase.RESUMING
    assert sent(decision, ResumeCommand) == LEADERS


def test_an_agent_that_runs_as_the_wrong_node_rank_fails_the_job() -> None:
    world = World(make_spec(replicas=4, rollout={"podsPerInstance": 2}))
    world.step()
    world.start_pods()
    world.agents["job-1"].node_rank = 0  # e.g. RLJOB_NODE_RANK overridden in the template
    world.step()
    world.step()
    assert world.status.phase == Phase.FAILED
    assert world.status.reason == EventReason.INVALID_SPEC
    assert "job-1's agent runs as SGLang node rank 0" in world.status.message


def test_a_lost_follower_breaks_its_instance_like_a_lost_leader() -> None:
    world = two_instances_of_two()
    world.pods["job-3"].broken = "container sglang terminated (exit 1)"
    world.step()
    assert world.status.phase == Phase.RECOVERING
    assert "job-3" in world.status.message


def test_a_follower_command_that_fails_before_its_leader_finished_is_never_sent() -> None:
    """The leader's release fails: its follower never gets a release (its ranks were never asked)."""
    world = two_instances_of_two()
    world.trainers_request()
    world.tick()
    world.step()
    world.settle()
    finish(world, {"job-0"}, ok=False, error="release_memory_occupation refused")
    world.step()
    releases = {pc.pod for d in world.decisions for pc in d.commands if pc.command.action == Action.RELEASE}
    assert "job-1" not in releases
    assert world.status.phase == Phase.RECOVERING
    assert world.agents.get("job-1") is None or world.agents["job-1"].last.state != CommandState.RUNNING


def test_the_follower_agent_guards_the_stage_order_and_its_own_bookkeeping() -> None:
    """agent/actions.py's check_follower: no SGLang guards (the leader's agent makes the calls), but the
    stage order, a second release of a released tag and a grant before its GPUs were verified are refused."""
    from rljob.agent.actions import check_follower
    from rljob.agent.errors import Refused
    from rljob.api.agent import AgentState, MemoryReport, Stage
    from rljob.api.spec import ReleaseTag

    def refusal(cmd: object, **state: object) -> str | None:
        report = AgentState(revision=1, boot_id="b", node_rank=1, **state)  # type: ignore[arg-type]
        try:
            check_follower(cmd, report)  # type: ignore[arg-type]
        except Refused as r:
            return r.error
        return None

    release = ReleaseCommand(epoch=2, tags=[ReleaseTag.KV_CACHE])
    assert refusal(release, stage=Stage.DRAINED) is None  # no facts needed: no SGLang call is made
    assert refusal(release, stage=Stage.SERVING) == "IllegalTransition"
    assert refusal(release, stage=Stage.STARTING) == "NotReady"
    assert refusal(release, stage=Stage.DRAINED, released_tags=[ReleaseTag.KV_CACHE]) == "AlreadyReleased"
    grant = GrantCommand(epoch=3)
    assert refusal(grant, stage=Stage.RELEASED) == "NotVerified"
    assert refusal(grant, stage=Stage.RELEASED, memory=MemoryReport(verified=True)) is None
    assert refusal(DrainCommand(epoch=1), stage=Stage.FAILED, fatal="gone") == "AgentFailed"
