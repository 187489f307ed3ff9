"""The operator's side of verified weights (lifecycle/weights.py): the pods of one layout at one version hold
one checksum, the commit records it, a rejoin must bring it back, a pod labelled with the committed version
but holding other weights is refitted, and status.pods says how each pod's weights were verified."""

from __future__ import annotations

from lifecycle_world import World, make_spec

from rljob.api.agent import RefitCommand, WeightsCheck, WeightsComparison
from rljob.api.status import Phase
from rljob.lifecycle.model import EventReason

X, Y = "1" * 64, "2" * 64
CHECKED = [WeightsComparison.TRAINER, WeightsComparison.PREVIOUS]


def held(version: str, checksum: str | None, **kw: object) -> WeightsCheck:
    return WeightsCheck(version=version, checksum=checksum, layout="tp1 pp1" if checksum else None, **kw)  # type: ignore[arg-type]


def to_refitting(world: World, version: str) -> None:
    world.to_training()
    world.trainers_publish(version)
    world.step()
    assert world.status.phase == Phase.REFITTING


def test_pods_holding_other_weights_at_the_version_restart_the_gang() -> None:
    world = World(make_spec(replicas=3, backoffLimit=2))
    world.bring_up()
    to_refitting(world, "1")
    for name, checksum in (("job-0", X), ("job-1", X), ("job-2", Y)):
        world.agents[name].weights = held("1", checksum, checked=CHECKED)
    world.settle()
    st = world.status
    assert st.phase == Phase.RECOVERING and st.reason == EventReason.WEIGHTS_MISMATCH
    assert "pod job-2 hold" in (st.message or "") and "than job-0, job-1" in (st.message or "")
    assert st.weight_version == "0"  # never committed: rollout does not open on those weights
    events = {e.reason for d in world.decisions[-2:] for e in d.events}
    assert EventReason.WEIGHTS_MISMATCH in events


def test_the_agreed_checksum_is_committed_and_a_rejoin_must_bring_it_back() -> None:
    world = World(make_spec(iterations=3, backoffLimit=2))
    world.bring_up()
    to_refitting(world, "1")
    for agent in world.agents.values():
        agent.weights = held("1", X, checked=CHECKED)
    world.settle()  # -> Resuming
    assert world.status.target_weights is not None and world.status.target_weights.weights_checksum == X
    pods = {p.name: p for p in world.status.pods}
    assert pods["job-0"].weights_checksum == X
    assert pods["job-0"].weights == "verified: trainer digest, previous weights, 1 other pod"
    world.settle()  # -> Rollout of iteration 2
    committed = world.status.weight_history[-1]
    assert (committed.version, committed.weights_checksum, committed.weights_layout) == ("1", X, "tp1 pp1")
    commits = [e for d in world.decisions for e in d.events if e.reason == EventReason.WEIGHTS_COMMITTED]
    assert "checksum 1111111111111111, tp1 pp1" in commits[-1].message
    world.pods["job-1"].broken = "container trainer terminated (exit 1)"
    world.step()  # -> Recovering
    world.step()  # -> Pending
    world.step()  # create
    world.start_pods()
    world.step()  # -> Initializing
    d = world.step()  # serves "0" != "1": the committed weights are loaded, and must hash as committed
    assert world.status.phase == Phase.REFITTING
    refits = [pc.command for pc in d.commands if isinstance(pc.command, RefitCommand)]
    assert refits and all(c.committed_checksum == X and c.committed_layout == "tp1 pp1" for c in refits)


def test_a_pod_labelled_with_the_committed_version_but_other_weights_is_refitted() -> None:
    """A recreated SGLang launched with --weight-version at the committed version but from its launch
    checkpoint: the label says committed, the checksum its agent took at launch says otherwise."""
    world = World(make_spec(iterations=3, backoffLimit=2))
    world.bring_up()
    to_refitting(world, "1")
    for agent in world.agents.values():
        agent.weights = held("1", X, checked=CHECKED)
    world.settle()
    world.settle()
    world.pods["job-1"].broken = "container sglang terminated (exit 1)"
    for _ in range(3):
        world.step()
    world.start_pods()
    for name, checksum in (("job-0", X), ("job-1", Y)):  # launched labelled "1": job-1 from other weights
        world.agents[name].served_version = "1"
        world.agents[name].weights = held("1", checksum)
    world.step()  # -> Initializing
    world.step()
    st = world.status
    assert st.phase == Phase.REFITTING, st.message
    assert "job-1 serves weights labelled 1 that are not its (checksum 2222222222222222" in (st.message or "")
    # the same gang with the right weights opens rollout without a refit
    world = World(make_spec(iterations=3, backoffLimit=2))
    world.bring_up()
    assert world.status.phase == Phase.ROLLOUT


def test_a_pod_whose_sglang_gives_no_checksum_is_said_not_verified() -> None:
    world = World(make_spec())
    world.bring_up()
    to_refitting(world, "1")
    why = "weights not verified: SGLang 0.5.6 has no /weights_checker checksum (it has one from 0.5.15.post1)"
    for agent in world.agents.values():
        agent.weights = WeightsCheck(version="1", unverified=why)
    world.settle()
    assert world.status.phase == Phase.RESUMING
    warnings = [e for e in world.decisions[-1].events if e.reason == EventReason.WEIGHTS_NOT_VERIFIED]
    assert warnings and warnings[0].message == f"pod job-0: {why}"
    assert all(p.weights == why and p.weights_checksum is None for p in world.status.pods)


def test_an_agents_weights_mismatch_restarts_the_gang_with_its_reason() -> None:
    world = World(make_spec(backoffLimit=2))
    world.bring_up()
    to_refitting(world, "1")
    world.agents["job-0"].finish()
    world.agents["job-1"].finish(ok=False, reason="WeightsMismatch", error="WeightsMismatch: w is not ...")
    d = world.step()
    assert world.status.phase == Phase.RECOVERING and world.status.reason == EventReason.WEIGHTS_MISMATCH
    assert any(e.reason == EventReason.WEIGHTS_MISMATCH and "job-1" in e.message for e in d.events)
