"""The agent sends facts, the lifecycle concludes. While a command runs, the channel sends a state only when a
field of api/agent.py's SENT_WHILE_RUNNING changed or the stage became Failed (agent/reports.py); no
evidence predicate (lifecycle/evidence.py) and no answer of awaited_report reads any other field of such a
report, so the lifecycle never needs a state the agent does not send. And each predicate on its own."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.reports import carried, operator_view
from rljob.api.agent import (
    NOT_SENT_ALONE,
    SENT_WHILE_RUNNING,
    Action,
    AgentState,
    CommandState,
    CommandStatus,
    EngineInfo,
    GpuScope,
    GpuScopeReport,
    MemoryReport,
    RecoveryReport,
    RecoveryState,
    ResumeHeadroom,
    RolloutReport,
    Stage,
    TrainerReport,
)
from rljob.api.spec import ReleaseTag
from rljob.api.status import Phase
from rljob.lifecycle.awaiting import awaited_report
from rljob.lifecycle.evidence import KINDS, Evidence, Progress, command_progress
from rljob.lifecycle.lock_steps import LOCK_STEPS
from rljob.lifecycle.model import Awaited

VERSIONS = st.sampled_from([None, "1", "2"])
EPOCHS = st.integers(min_value=4, max_value=6)
RUNNING_COMMAND = frozenset({"epoch", "last_command"})  # which command runs: the operator sent it
# Every field the channel does not send while a command runs, with what it may say.
NOT_SENT_WHILE_RUNNING: dict[str, st.SearchStrategy[Any]] = {
    "revision": st.integers(min_value=0, max_value=100),
    "stage": st.sampled_from([s for s in Stage if s != Stage.FAILED]),  # Failed is sent
    "node_rank": st.integers(min_value=0, max_value=2),
    "released_tags": st.lists(st.sampled_from(list(ReleaseTag)), unique=True, max_size=3),
    "memory": st.builds(
        MemoryReport, freed_bytes=st.integers(min_value=0, max_value=2**40), verified=st.booleans()
    ),
    "gpus": st.none() | st.builds(GpuScopeReport, scope=st.sampled_from(list(GpuScope))),
    "engine": st.builds(
        EngineInfo,
        reachable=st.booleans(),
        served_version=VERSIONS,
        paused=st.booleans(),
        launch_refusal=st.sampled_from([None, SGLangFacts("0.5.23", "lru", True, False, 1).launch_refusal]),
    ),
    "rollout": st.builds(RolloutReport, samples=st.integers(min_value=0, max_value=9)),
}
NOT_SENT = st.fixed_dictionaries(NOT_SENT_WHILE_RUNNING)


@st.composite
def running_reports(draw: st.DrawFn) -> dict[str, Any]:
    """The fields of a report whose command runs that the channel sends, and the command itself."""
    epoch = draw(EPOCHS)
    command = CommandStatus(
        epoch=epoch, action=draw(st.sampled_from(list(Action))), state=CommandState.RUNNING
    )
    trainer = TrainerReport(
        requested=draw(st.booleans()),
        published_version=draw(VERSIONS),
        published_epoch=draw(st.none() | EPOCHS),
    )
    return {
        "boot_id": draw(st.sampled_from(["b", "c"])),
        "fatal": draw(st.none() | st.just("SGLang died")),
        "trainer": trainer,
        "recovery": RecoveryReport(state=draw(st.sampled_from(list(RecoveryState)))),
        "headroom": draw(
            st.none()
            | st.builds(
                ResumeHeadroom,
                epoch=EPOCHS,
                waiting=st.booleans(),
                message=st.none() | st.just("GPU 0: pid 7 (trainer) holds 17.2 GiB"),
            )
        ),
        "epoch": epoch,
        "last_command": command,
    }


def test_the_fields_are_every_field_of_a_report() -> None:
    fields = set(AgentState.model_fields)
    assert set(NOT_SENT_WHILE_RUNNING) == fields - SENT_WHILE_RUNNING - RUNNING_COMMAND
    assert set(NOT_SENT_WHILE_RUNNING) >= NOT_SENT_ALONE


@given(sent=running_reports(), one=NOT_SENT, other=NOT_SENT)
def test_the_channel_does_not_send_what_the_lifecycle_does_not_read(
    sent: dict[str, Any], one: dict[str, Any], other: dict[str, Any]
) -> None:
    before, after = AgentState(**sent, **one), AgentState(**sent, **other)
    assert not carried(operator_view(before), operator_view(after))  # the agent does not send `after`
    for evidence in Evidence:
        for epoch in (4, 5, 6):
            for target in (None, "1", "2"):
                assert evidence.shown_by(before, epoch, target) == evidence.shown_by(after, epoch, target)
    for evidence in (e for e in Evidence if e.per_report):
        for action in Action:
            for epoch in (4, 5, 6):
                for boot in ("b", "c"):
                    awaited = Awaited("p", boot, epoch, action, evidence)
                    for accepted in (False, True):
                        seen = awaited_report(awaited, before, accepted)
                        assert seen == awaited_report(awaited, after, accepted), (awaited, accepted)


@given(sent=running_reports(), rest=NOT_SENT, field=st.sampled_from(sorted(SENT_WHILE_RUNNING)))
def test_a_change_the_lifecycle_reads_is_sent(sent: dict[str, Any], rest: dict[str, Any], field: str) -> None:
    before = AgentState(**sent, **rest)
    changes: dict[str, Any] = {
        "boot_id": "another-boot",
        "fatal": None if before.fatal else "SGLang died",
        "trainer": before.trainer.model_copy(update={"requested": not before.trainer.requested}),
        "recovery": RecoveryReport(restarts=before.recovery.restarts + 1),
        "headroom": ResumeHeadroom(epoch=before.epoch, waiting=True, message="another holder"),
    }
    after = before.model_copy(update={field: changes[field]})
    assert carried(operator_view(before), operator_view(after))
    failed = before.model_copy(update={"stage": Stage.FAILED})
    assert carried(operator_view(before), operator_view(failed))


def succeeded(action: Action, epoch: int = 5, **fields: Any) -> AgentState:
    cmd = CommandStatus(epoch=epoch, action=action, state=CommandState.SUCCEEDED)
    report: dict[str, Any] = {"stage": Stage.SERVING, **fields}
    return AgentState(revision=1, boot_id="b", epoch=epoch, last_command=cmd, **report)


def test_each_predicate() -> None:
    drained = succeeded(Action.DRAIN)
    assert Evidence.COMMAND_SUCCEEDED.shown_by(drained, 5, None)
    assert not Evidence.COMMAND_SUCCEEDED.shown_by(drained, 6, None)  # another epoch's command
    released = succeeded(Action.RELEASE, stage=Stage.RELEASED)
    assert not Evidence.MEMORY_VERIFIED.shown_by(released, 5, None)
    verified = released.model_copy(update={"memory": MemoryReport(verified=True)})
    assert Evidence.MEMORY_VERIFIED.shown_by(verified, 5, None)
    granted = succeeded(Action.GRANT, stage=Stage.TRAINED)
    assert not Evidence.PUBLISHED.shown_by(granted, 5, None)
    early = TrainerReport(published_version="2", published_epoch=4)  # under an earlier grant
    assert not Evidence.PUBLISHED.shown_by(granted.model_copy(update={"trainer": early}), 5, None)
    now = TrainerReport(published_version="2", published_epoch=5)
    assert Evidence.PUBLISHED.shown_by(granted.model_copy(update={"trainer": now}), 5, None)
    # The lease ends with weights published, or given back without any, under this epoch's grant.
    assert not Evidence.LEASE_RETURNED.shown_by(granted, 5, None)
    assert Evidence.LEASE_RETURNED.shown_by(granted.model_copy(update={"trainer": now}), 5, None)
    back = TrainerReport(returned_epoch=5)
    assert Evidence.LEASE_RETURNED.shown_by(granted.model_copy(update={"trainer": back}), 5, None)
    assert not Evidence.PUBLISHED.shown_by(granted.model_copy(update={"trainer": back}), 5, None)
    earlier = TrainerReport(returned_epoch=4)  # given back under an earlier grant
    assert not Evidence.LEASE_RETURNED.shown_by(granted.model_copy(update={"trainer": earlier}), 5, None)
    refitted = succeeded(Action.REFIT, stage=Stage.REFITTED, engine=EngineInfo(served_version="2"))
    assert Evidence.SERVES_TARGET.shown_by(refitted, 5, "2")
    assert not Evidence.SERVES_TARGET.shown_by(refitted, 5, "1")
    assert not Evidence.SERVING_TARGET.shown_by(refitted, 5, "2")  # still paused: not Serving
    serving = refitted.model_copy(update={"stage": Stage.SERVING})
    assert Evidence.SERVING_TARGET.shown_by(serving, 5, "2")
    asked = succeeded(Action.RESUME, trainer=TrainerReport(requested=True))
    assert Evidence.TRAINER_REQUESTED.shown_by(asked, 5, None)
    assert not Evidence.TRAINER_REQUESTED.shown_by(asked, 6, None)  # a request from before this rollout
    assert not Evidence.TRAINER_REQUESTED.shown_by(succeeded(Action.RESUME), 5, None)


def test_each_kind_is_declared_once_and_the_rows_name_theirs() -> None:
    assert set(KINDS) == set(Evidence)
    assert {e for e in Evidence if e.per_report} == {
        Evidence.COMMAND_SUCCEEDED,
        Evidence.PUBLISHED,
        Evidence.LEASE_RETURNED,
        Evidence.TRAINER_REQUESTED,
    }
    assert all(e.awaited_as.per_report for e in Evidence)
    assert {phase: row.evidence for phase, row in LOCK_STEPS.items()} == {
        Phase.DRAINING: Evidence.COMMAND_SUCCEEDED,
        Phase.RELEASING: Evidence.MEMORY_VERIFIED,
        Phase.TRAINING: Evidence.LEASE_RETURNED,
        Phase.REFITTING: Evidence.SERVES_TARGET,
        Phase.RESUMING: Evidence.SERVING_TARGET,
        Phase.SUSPENDING: Evidence.COMMAND_SUCCEEDED,
    }


def test_command_progress_judges_the_epochs_command_once() -> None:
    """evidence.command_progress, for collect.py and awaiting.py: an older epoch or no command is not shown
    yet, a later epoch or another action at this one is another command, else the command's state."""

    def progress(agent_epoch: int, command: tuple[int, Action, CommandState] | None) -> Progress:
        last = None
        if command is not None:
            last = CommandStatus(epoch=command[0], action=command[1], state=command[2])
        agent = AgentState(revision=1, boot_id="b", stage=Stage.SERVING, epoch=agent_epoch, last_command=last)
        return command_progress(agent, 5, Action.DRAIN)

    drain, release = Action.DRAIN, Action.RELEASE
    assert progress(4, (4, release, CommandState.SUCCEEDED)) == Progress.NOT_SHOWN
    assert progress(5, None) == Progress.NOT_SHOWN
    assert progress(5, (4, release, CommandState.SUCCEEDED)) == Progress.NOT_SHOWN
    assert progress(6, (6, release, CommandState.RUNNING)) == Progress.OTHER
    assert progress(5, (5, release, CommandState.SUCCEEDED)) == Progress.OTHER
    assert progress(5, (5, drain, CommandState.RUNNING)) == Progress.RUNNING
    assert progress(5, (5, drain, CommandState.FAILED)) == Progress.FAILED
    assert progress(5, (5, drain, CommandState.SUCCEEDED)) == Progress.SUCCEEDED
