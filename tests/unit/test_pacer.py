"""The pacer (controller/pacer.py) answers when the conductor decides again, from plain loop times and
costs: each rule alone."""

from __future__ import annotations

import pytest

from rljob.api.agent import Action, AgentState, CommandState, CommandStatus, Stage
from rljob.controller.pacer import (
    MAX_PAUSE,
    PACE,
    QUIET_SECONDS,
    RESYNC_SECONDS,
    RESYNC_SECONDS_PER_POD,
    TICK_SECONDS,
    Pacer,
    Skip,
)
from rljob.lifecycle.model import Awaited

EPOCH = 3
INPUTS = (1, 2, "spec", None)
CHANGED = (1, 3, "spec", None)


def carried_out_at(
    now: float, next_due: float | None, retry: bool = False, held_back: float | None = None
) -> Pacer:
    """A pacer whose last decision, which awaits nothing, was carried out at `now`."""
    pacer = Pacer()
    pacer.decided(now, 0.0, ())
    pacer.carried_out(now, next_due, retry, held_back)
    return pacer


def drain_report(state: CommandState) -> AgentState:
    """A report on the awaited drain (boot "b", epoch EPOCH)."""
    command = CommandStatus(action=Action.DRAIN, epoch=EPOCH, state=state)
    return AgentState(revision=2, boot_id="b", stage=Stage.SERVING, epoch=EPOCH, last_command=command)


def test_the_first_round_is_due_and_lists_pods() -> None:
    pacer = Pacer()
    assert pacer.due(0.0)
    assert pacer.list_due(0.0)
    assert pacer.skip(INPUTS, due=False) is None  # nothing decided yet


def test_with_nothing_due_a_decision_is_made_quiet_seconds_after_the_last() -> None:
    pacer = carried_out_at(100.0, next_due=None)
    assert not pacer.due(100.0 + QUIET_SECONDS - 0.01)
    assert pacer.due(100.0 + QUIET_SECONDS)


@pytest.mark.parametrize(
    ("next_due", "due_after"), [(5.0, 5.0), (-3.0, 0.0), (QUIET_SECONDS + 60, QUIET_SECONDS)]
)
def test_a_decision_is_due_at_its_next_due_at_most_quiet_seconds_away(
    next_due: float, due_after: float
) -> None:
    pacer = carried_out_at(100.0, next_due=next_due)
    assert not pacer.due(100.0 + due_after - 0.01)
    assert pacer.due(100.0 + due_after)


def test_what_did_not_settle_is_retried_a_tick_later() -> None:
    pacer = carried_out_at(100.0, next_due=None, retry=True)
    assert not pacer.due(100.0 + TICK_SECONDS - 0.01)
    assert pacer.due(100.0 + TICK_SECONDS)
    assert carried_out_at(100.0, next_due=1.0, retry=True).due(101.0)  # next_due, when sooner


def test_a_command_not_taken_is_sent_again_a_tick_later_and_only_by_its_decision() -> None:
    pacer = Pacer()
    pacer.decided(100.0, 0.0, ())
    pacer.not_taken()
    pacer.carried_out(100.0, None)
    assert pacer.due(100.0 + TICK_SECONDS)
    pacer.decided(102.0, 0.0, ())  # the next decision sends again: not taken is its own news
    pacer.carried_out(102.0, None)
    assert not pacer.due(102.0 + TICK_SECONDS)
    assert pacer.due(102.0 + QUIET_SECONDS)


def test_a_held_back_status_is_offered_again_when_it_would_be_written() -> None:
    pacer = carried_out_at(100.0, next_due=None, held_back=7.5)
    assert not pacer.due(107.49)
    assert pacer.due(107.5)
    assert carried_out_at(100.0, next_due=None, retry=True, held_back=7.5).due(100.0 + TICK_SECONDS)


def test_a_status_not_stored_is_decided_again_at_its_retry_and_not_skipped() -> None:
    pacer = Pacer()
    pacer.skip(INPUTS, due=True)
    pacer.decided(100.0, 0.0, (Awaited("p-0", "b", EPOCH, Action.DRAIN),))
    pacer.not_stored(100.0, 4.0)
    assert not pacer.due(103.9)
    assert pacer.due(104.0)
    pacer.reported("p-0", drain_report(CommandState.RUNNING), lambda _: True)
    assert pacer.skip(INPUTS, due=False) is None  # the reports are not what the stored decision awaits


def test_a_round_whose_inputs_did_not_change_is_skipped_unless_due() -> None:
    pacer = Pacer()
    assert pacer.skip(INPUTS, due=False) is None
    pacer.decided(100.0, 0.0, ())
    assert pacer.skip(tuple(INPUTS), due=False) is Skip.UNCHANGED
    assert pacer.skip(INPUTS, due=True) is None
    assert pacer.skip(CHANGED, due=False) is None


def test_reports_that_decide_nothing_new_skip_the_round_and_a_failure_decides() -> None:
    pacer = Pacer()
    pacer.skip(INPUTS, due=True)
    awaiting = tuple(Awaited(p, "b", EPOCH, Action.DRAIN) for p in ("p-0", "p-1"))
    pacer.decided(100.0, 0.0, awaiting)
    assert not pacer.reported("p-0", drain_report(CommandState.SUCCEEDED), lambda _: True)  # no wake
    assert pacer.skip(INPUTS, due=False) is Skip.AWAITED
    assert pacer.skip(INPUTS, due=False) is Skip.UNCHANGED  # the skipped round's reports count as seen
    assert pacer.reported("p-1", drain_report(CommandState.FAILED), lambda _: True)  # wakes
    assert pacer.skip(INPUTS, due=False) is None


def test_the_last_awaited_report_and_a_command_not_taken_decide() -> None:
    pacer = Pacer()
    pacer.skip(INPUTS, due=True)
    awaiting = tuple(Awaited(p, "b", EPOCH, Action.DRAIN) for p in ("p-0", "p-1"))
    pacer.decided(100.0, 0.0, awaiting)
    pacer.reported("p-0", drain_report(CommandState.SUCCEEDED), lambda _: True)
    assert pacer.reported("p-1", drain_report(CommandState.SUCCEEDED), lambda _: True)
    assert pacer.skip(INPUTS, due=False) is None
    pacer.decided(101.0, 0.0, awaiting)
    pacer.reported("p-0", drain_report(CommandState.RUNNING), lambda _: True)
    pacer.not_taken()
    assert pacer.skip(INPUTS, due=False) is None


def test_a_decision_pauses_pace_times_the_last_ones_cost_capped_and_never_when_due() -> None:
    pacer = Pacer()
    pacer.decided(100.0, 0.004, ())
    assert pacer.pause(100.0, due=False) == pytest.approx(PACE * 0.004)
    assert pacer.pause(100.005, due=False) == pytest.approx(PACE * 0.004 - 0.005)
    assert pacer.pause(100.0 + PACE * 0.004, due=False) == 0.0
    assert pacer.pause(100.0, due=True) == 0.0
    pacer.decided(200.0, 1.0, ())
    assert pacer.pause(200.0, due=False) == MAX_PAUSE


@pytest.mark.parametrize("pods", [0, 8, 120, 121, 512])
def test_the_full_pod_list_is_due_at_least_every_resync_seconds_and_scales_with_the_pods(pods: int) -> None:
    pacer = Pacer()
    pacer.listed(10.0, pods)
    interval = max(RESYNC_SECONDS, RESYNC_SECONDS_PER_POD * pods)
    assert interval == (RESYNC_SECONDS if pods <= 120 else pods * RESYNC_SECONDS_PER_POD)
    assert not pacer.list_due(10.0 + interval - 0.01)
    assert pacer.list_due(10.0 + interval)
    pacer.list_again()
    assert pacer.list_due(10.0)


def test_a_round_that_changed_nothing_waits_until_the_next_due_list_or_tick() -> None:
    pacer = carried_out_at(100.0, next_due=0.5)
    pacer.listed(100.0, 1)
    assert pacer.wait(100.0) == pytest.approx(0.5)  # the decision due first
    assert pacer.wait(101.0) == 0.0  # already due
    quiet = carried_out_at(100.0, next_due=None)
    quiet.listed(100.0, 1)
    assert quiet.wait(100.0) == TICK_SECONDS  # a tick at most
    quiet.list_again()
    assert quiet.wait(100.0) == 0.0  # the list is due


def test_the_options_set_the_tick_and_the_quiet_interval() -> None:
    pacer = Pacer(tick_seconds=0.1, quiet_seconds=1.0)
    pacer.decided(0.0, 0.0, ())
    pacer.carried_out(0.0, None, retry=True)
    assert pacer.due(0.1)
    pacer.carried_out(0.0, None)
    assert not pacer.due(0.99)
    assert pacer.due(1.0)
    pacer.listed(0.0, 1)
    assert Pacer(tick_seconds=0.1).wait(0.0) == 0.0 and pacer.wait(0.5) == pytest.approx(0.1)
