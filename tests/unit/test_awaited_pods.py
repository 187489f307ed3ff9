"""The conductor's AwaitedPods (controller/conductor.py) keeps, report by report, the answer of the pure
lifecycle.machine.decides_nothing_new over all the reports since the decision (and decides at once after a
command an agent did not take)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rljob.api.agent import Action, AgentState, CommandState, CommandStatus, Stage
from rljob.controller.conductor import AwaitedPods
from rljob.lifecycle.machine import decides_nothing_new
from rljob.lifecycle.model import Awaited

EPOCH = 7
# What a pod's next report may say: it runs the command, it succeeded, it failed, it moved on to another
# epoch, its agent restarted, it failed hard.
REPORTS = st.sampled_from(
    ["running", "running", "succeeded", "succeeded", "succeeded", "failed", "epoch", "boot", "fatal"]
)


def report(kind: str, revision: int) -> AgentState:
    state = {"running": CommandState.RUNNING, "failed": CommandState.FAILED}.get(kind, CommandState.SUCCEEDED)
    epoch = EPOCH + 1 if kind == "epoch" else EPOCH
    cmd = CommandStatus(epoch=epoch, action=Action.DRAIN, state=state)
    return AgentState(
        revision=revision,
        boot_id="other" if kind == "boot" else "b",
        stage=Stage.FAILED if kind == "fatal" else Stage.SERVING,
        epoch=epoch,
        last_command=cmd,
        fatal="died" if kind == "fatal" else None,
    )


def before(pod: int) -> AgentState:  # the report at the decision: the previous epoch's command
    done = CommandStatus(epoch=EPOCH - 1, action=Action.RESUME, state=CommandState.SUCCEEDED)
    return AgentState(revision=1, boot_id="b", stage=Stage.SERVING, epoch=EPOCH - 1, last_command=done)


@given(
    pods=st.integers(min_value=1, max_value=5),
    not_awaited=st.booleans(),
    untaken=st.sets(st.integers(min_value=0, max_value=4), max_size=2),
    batches=st.lists(
        st.lists(st.tuples(st.integers(min_value=0, max_value=5), REPORTS), max_size=3), max_size=6
    ),
)
def test_report_by_report_is_the_same_as_all_at_once(
    pods: int, not_awaited: bool, untaken: set[int], batches: list[list[tuple[int, str]]]
) -> None:
    names = [f"p-{i}" for i in range(pods)]
    awaiting = tuple(Awaited(n, "b", EPOCH, Action.DRAIN) for n in names)
    agents: dict[str, AgentState | None] = {n: before(i) for i, n in enumerate(names)}
    agents["outsider"] = before(9)  # a pod of the job that the decision does not wait on
    accepted = {n for i, n in enumerate(names) if i not in untaken}
    tracker = AwaitedPods()
    tracker.decided(awaiting)
    if untaken & set(range(pods)):
        tracker.not_taken()  # what the conductor's _send says when an agent did not take its command
    changed: set[str] = set()
    revision = 2
    for batch in batches:
        for index, kind in batch:
            name = "outsider" if (not_awaited and index >= pods) else names[index % pods]
            revision += 1
            agents[name] = report(kind, revision)
            changed.add(name)
            tracker.reported(name)
        expected = decides_nothing_new(awaiting, changed, agents, accepted)
        got = tracker.nothing_new(agents.get, lambda a: a.pod in accepted)
        # It never skips a decision that must be made; after a command not taken it decides at once
        # (the pure function may still wait while that pod's report shows the command)
        assert expected or not got, (batch, changed)
        if not untaken & set(range(pods)):
            assert got == expected, (batch, changed)
        if not got:
            return  # the conductor decides now: a new decision starts over
