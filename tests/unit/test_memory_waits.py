"""A resume that waits for GPU memory, as the RLJob shows it (lifecycle/memory_waits.py): the status message
and one ResumeWaitingForMemory Warning while a pod's resume waits, the message kept current, decided on
each report that changes it; at the phase's deadline the gang restarts saying what it waited for; a trainer
that kept memory after its lease is named in a TrainerHoldsGpuMemory Warning when rollout reopens."""

from __future__ import annotations

from lifecycle_world import World, make_spec

from rljob.api.agent import Action, AgentState, ResumeHeadroom, Stage
from rljob.api.spec import ReleaseTag
from rljob.api.status import Phase
from rljob.lifecycle.awaiting import AwaitedReport, awaited_report
from rljob.lifecycle.model import Awaited, EventReason, EventType

NEEDS = "the resume of kv_cache needs 36.0 GiB (+0.5 GiB margin)"
WAIT = f"GPU 0: pid 4121 (trainer) holds 17.2 GiB; {NEEDS}, 21.4 GiB free"
LATER = f"GPU 0: pid 4121 (trainer) holds 9.0 GiB; {NEEDS}, 29.6 GiB free"


def to_resuming() -> World:
    """One iteration up to Resuming, the resume command taken and running on both pods."""
    world = World(make_spec())
    world.bring_up()
    world.to_training()
    world.trainers_publish("1")
    world.step()  # -> Refitting
    world.settle()  # -> Resuming, resume sent
    assert world.status.phase == Phase.RESUMING
    return world


def waits(world: World, pod: str, message: str | None, waiting: bool = True) -> None:
    agent = world.agents[pod]
    agent.headroom = ResumeHeadroom(
        epoch=world.status.epoch, tags=[ReleaseTag.KV_CACHE], waiting=waiting, message=message
    )
    agent.revision += 1


def reasons(world: World, *reason: EventReason) -> list[tuple[str, str, EventType]]:
    return [
        (e.reason.value, e.message, e.type) for d in world.decisions for e in d.events if e.reason in reason
    ]


def test_the_status_says_what_the_resume_waits_for_with_one_event() -> None:
    world = to_resuming()
    waits(world, "job-1", WAIT)
    d = world.step()
    st = world.status
    assert (st.phase, st.reason, st.message) == (Phase.RESUMING, "ResumeWaitingForMemory", f"job-1: {WAIT}")
    assert reasons(world, EventReason.RESUME_WAITING_FOR_MEMORY) == [
        ("ResumeWaitingForMemory", f"job-1: {WAIT}", EventType.WARNING)
    ]
    assert [(a.pod, a.memory_wait) for a in d.awaiting] == [("job-0", None), ("job-1", WAIT)]
    waits(world, "job-1", LATER)  # the trainer frees some: the message follows, no second event
    world.step()
    assert world.status.message == f"job-1: {LATER}"
    assert len(reasons(world, EventReason.RESUME_WAITING_FOR_MEMORY)) == 1
    waits(world, "job-1", None, waiting=False)  # free: the resume was sent
    world.step()
    assert (world.status.reason, world.status.message) == (
        "PhaseChanged",
        "Resuming: the GPU memory the resume waited for is free",
    )
    world.settle()
    assert world.status.phase == Phase.ROLLOUT and world.status.weight_version == "1"


def test_each_pod_that_waits_is_counted() -> None:
    world = to_resuming()
    waits(world, "job-0", WAIT)
    waits(world, "job-1", LATER)
    world.step()
    assert world.status.message == f"job-0: {WAIT} (and 1 more pods)"


def test_a_report_that_changes_the_wait_is_decided() -> None:
    """The conductor skips a running pod's report only when it decides nothing new: a new wait message
    changes the status, so it is decided; the same one again is not."""
    world = to_resuming()
    epoch = world.status.epoch
    waits(world, "job-1", WAIT)
    report: AgentState = world.agents["job-1"].report()
    before = Awaited("job-1", "boot", epoch, Action.RESUME)
    assert awaited_report(before, report, accepted=True) == AwaitedReport.DECIDE
    seen = Awaited("job-1", "boot", epoch, Action.RESUME, memory_wait=WAIT)
    assert awaited_report(seen, report, accepted=True) == AwaitedReport.RUNNING
    older = report.model_copy(update={"headroom": report.headroom.model_copy(update={"epoch": epoch - 1})})  # type: ignore[union-attr]
    assert awaited_report(before, older, accepted=True) == AwaitedReport.RUNNING  # another command's wait


def test_past_the_deadline_the_gang_restarts_saying_what_it_waited_for() -> None:
    world = to_resuming()
    waits(world, "job-1", WAIT)
    world.step()
    world.tick(301)  # phaseTimeoutSeconds.resuming: 300
    world.step()
    st = world.status
    assert st.phase == Phase.RECOVERING and st.restarts == 1
    assert st.message == f"phase Resuming exceeded 300s; job-1: {WAIT}"


def test_a_resume_failed_at_its_deadline_follows_the_failure_policy() -> None:
    """The agent failed the command with who holds the memory: the gang restarts (backoffLimit), as for
    any failed command, the reason in the CommandFailed event and the message."""
    world = to_resuming()
    waits(world, "job-1", WAIT)
    world.step()
    agent = world.agents["job-1"]
    waits(world, "job-1", WAIT, waiting=False)
    agent.finish(ok=False, error=f"{WAIT}; not resumed: not free within the command's deadline")
    world.step()
    assert world.status.phase == Phase.RECOVERING
    failed = reasons(world, EventReason.COMMAND_FAILED)
    assert failed and WAIT in failed[0][1]
    assert WAIT in world.status.message


def test_a_trainer_that_kept_memory_is_named_when_rollout_reopens() -> None:
    world = to_resuming()
    for name, agent in world.agents.items():
        held = (
            "pid 4121 (trainer) holds 2.0 GiB on GPU 0 after returning its lease" if name == "job-0" else None
        )
        agent.headroom = ResumeHeadroom(epoch=world.status.epoch, trainer_held=held)
    world.settle()
    assert world.status.phase == Phase.ROLLOUT
    assert reasons(world, EventReason.TRAINER_HOLDS_GPU_MEMORY) == [
        (
            "TrainerHoldsGpuMemory",
            "job-0: pid 4121 (trainer) holds 2.0 GiB on GPU 0 after returning its lease",
            EventType.WARNING,
        )
    ]
    # The next iteration: a note of an earlier iteration's resume is not repeated.
    world.run_iteration("2")
    assert len(reasons(world, EventReason.TRAINER_HOLDS_GPU_MEMORY)) == 1
    assert all(a.stage == Stage.SERVING for a in world.agents.values())
