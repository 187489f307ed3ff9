"""The pacer's AwaitedPods (controller/pacer.py) keeps, report by report as each comes, the answer
of the pure lifecycle_world.decides_nothing_new over all the reports since the decision (and decides at
once after a command an agent did not take)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from lifecycle_world import decides_nothing_new
from test_conductor_refusals import FakeKube, body

from rljob.api.agent import Action, AgentState, CommandState, CommandStatus, Stage, TrainerReport
from rljob.controller.conductor import Conductor, ConductorOptions
from rljob.controller.pacer import AwaitedPods
from rljob.lifecycle.evidence import Evidence
from rljob.lifecycle.model import Awaited

EPOCH = 7
# What a pod's next report may say: it runs the command, it succeeded, it succeeded and shows the awaited
# evidence (its trainer published, or asked for the GPU), it failed, it moved on to another epoch, its
# agent restarted, it failed hard.
REPORTS = st.sampled_from(
    ["running", "running", "succeeded", "succeeded", "shown", "shown", "failed", "epoch", "boot", "fatal"]
)
AFTER = {  # the reports of one command that may follow each
    "running": {"running", "succeeded", "failed", "shown"},
    "succeeded": {"succeeded", "shown"},
    "shown": {"shown"},
    "failed": {"failed"},
}
ACTIONS = {
    Evidence.COMMAND_SUCCEEDED: Action.DRAIN,
    Evidence.PUBLISHED: Action.GRANT,
    Evidence.LEASE_RETURNED: Action.GRANT,
    Evidence.TRAINER_REQUESTED: Action.RESUME,
}


def report(kind: str, revision: int, evidence: Evidence = Evidence.COMMAND_SUCCEEDED) -> AgentState:
    state = {"running": CommandState.RUNNING, "failed": CommandState.FAILED}.get(kind, CommandState.SUCCEEDED)
    epoch = EPOCH + 1 if kind == "epoch" else EPOCH
    cmd = CommandStatus(epoch=epoch, action=ACTIONS[evidence], state=state)
    shown = kind == "shown"
    published = shown and evidence in (Evidence.PUBLISHED, Evidence.LEASE_RETURNED)
    trainer = TrainerReport(
        requested=shown and evidence == Evidence.TRAINER_REQUESTED,
        published_epoch=epoch if published else None,
        published_version="2" if published else None,
    )
    return AgentState(
        revision=revision,
        boot_id="other" if kind == "boot" else "b",
        stage=Stage.FAILED if kind == "fatal" else Stage.SERVING,
        epoch=epoch,
        last_command=cmd,
        fatal="died" if kind == "fatal" else None,
        trainer=trainer,
    )


def before(evidence: Evidence) -> AgentState:
    """The report at the decision: the previous epoch's command; in rollout, the epoch's resume."""
    epoch = EPOCH if evidence == Evidence.TRAINER_REQUESTED else EPOCH - 1
    done = CommandStatus(epoch=epoch, action=Action.RESUME, state=CommandState.SUCCEEDED)
    return AgentState(revision=1, boot_id="b", stage=Stage.SERVING, epoch=epoch, last_command=done)


@given(
    pods=st.integers(min_value=1, max_value=5),
    not_awaited=st.booleans(),
    untaken=st.sets(st.integers(min_value=0, max_value=4), max_size=2),
    evidence=st.sampled_from(list(ACTIONS)),  # the kinds an awaited pod waits on (Evidence.per_report)
    batches=st.lists(
        st.lists(st.tuples(st.integers(min_value=0, max_value=5), REPORTS), max_size=3), max_size=6
    ),
)
def test_report_by_report_is_the_same_as_all_at_once(
    pods: int,
    not_awaited: bool,
    untaken: set[int],
    evidence: Evidence,
    batches: list[list[tuple[int, str]]],
) -> None:
    names = [f"p-{i}" for i in range(pods)]
    awaiting = tuple(Awaited(n, "b", EPOCH, ACTIONS[evidence], evidence) for n in names)
    agents: dict[str, AgentState | None] = {n: before(evidence) for n in names}
    agents["outsider"] = before(evidence)  # a pod of the job that the decision does not wait on
    accepted = {n for i, n in enumerate(names) if i not in untaken}
    tracker = AwaitedPods()
    tracker.decided(awaiting)
    if untaken & set(range(pods)):
        tracker.not_taken()  # what the conductor's _send says when an agent did not take its command
    changed: set[str] = set()
    # An agent's reports of one command never go back (AFTER): running, then succeeded or failed, then the
    # evidence shown.
    last: dict[str, str] = {}
    revision = 2
    for batch in batches:
        for index, kind in batch:
            name = "outsider" if (not_awaited and index >= pods) else names[index % pods]
            if kind in AFTER:
                if name in last and kind not in AFTER[last[name]]:
                    continue
                last[name] = kind
            revision += 1
            agents[name] = report(kind, revision, evidence)
            changed.add(name)
            tracker.reported(name, agents[name], lambda a: a.pod in accepted)
            expected = decides_nothing_new(awaiting, changed, agents, accepted)
            got = tracker.nothing_new()
            # It never skips a decision that must be made; after a command not taken it decides at once
            # (the pure function may still wait while that pod's report shows the command)
            assert expected or not got, (batch, changed)
            if not untaken & set(range(pods)):
                assert got == expected, (batch, changed)
            if not got:
                return  # the conductor is woken and decides now: a new decision starts over


class ReportingLink:
    """The part of an AgentLink that Conductor._reported reads: each pod's latest report, and which
    awaited commands its agent took."""

    def __init__(self, latest: dict[str, AgentState], accepted: set[str]) -> None:
        self.reports, self.accepted = latest, accepted

    def latest(self, pod: str) -> AgentState | None:
        return self.reports.get(pod)

    def took(self, awaited: Awaited) -> bool:
        return awaited.pod in self.accepted


def test_a_report_that_decides_nothing_new_does_not_wake_the_conductor() -> None:
    """The wiring in Conductor._reported: only a report after which a decision must look wakes it."""
    names = ["p-0", "p-1"]
    link = ReportingLink({n: before(Evidence.COMMAND_SUCCEEDED) for n in names}, set(names))
    conductor = Conductor(FakeKube(), body(), ConductorOptions(), agents=link)  # type: ignore[arg-type]
    conductor.pacer.awaited.decided(tuple(Awaited(n, "b", EPOCH, Action.DRAIN) for n in names))

    def reports(name: str, kind: str) -> bool:
        conductor.wake.clear()
        link.reports[name] = report(kind, 10)
        conductor._reported(name)
        return conductor.wake.is_set()

    assert not reports("p-0", "running")  # it still runs the command
    assert not reports("p-0", "succeeded")  # p-1 still runs it
    assert reports("p-1", "succeeded")  # the last one: the next phase
    conductor.pacer.awaited.decided(tuple(Awaited(n, "b", EPOCH, Action.DRAIN) for n in names))
    assert not reports("p-0", "succeeded")
    assert reports("p-1", "failed")  # anything else is decided
