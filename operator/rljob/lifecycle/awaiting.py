"""Whether a report changes a decision that waits only on pods showing evidence (Decision.awaiting): the
conductor asks it report by report (controller/conductor.py, AwaitedPods); the evidence is evidence.py's."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

from rljob.api.agent import AgentState, CommandState, Stage
from rljob.lifecycle.model import Awaited


class AwaitedReport(StrEnum):
    """What an awaited pod's latest report says (Decision.awaiting)."""

    RUNNING = "Running"  # it runs the command, or its agent took it and has not reported it yet
    SUCCEEDED = "Succeeded"
    DECIDE = "Decide"  # anything else: a decision must look at it


def awaited_report(awaited: Awaited, agent: AgentState | None, accepted: bool) -> AwaitedReport:
    """`accepted`: the pod's agent took the awaited command (the operator knows; the report may lag)."""
    if agent is None or agent.boot_id != awaited.boot_id or agent.fatal or agent.stage == Stage.FAILED:
        return AwaitedReport.DECIDE
    evidence = awaited.evidence
    if evidence.of_command:
        progress = _command_progress(awaited, agent, accepted)
        if progress != AwaitedReport.SUCCEEDED:
            return progress
    elif agent.epoch != awaited.epoch:  # shown after the command: only a report of its epoch counts
        return AwaitedReport.DECIDE
    return AwaitedReport.SUCCEEDED if evidence.shown_by(agent, awaited.epoch, None) else AwaitedReport.RUNNING


def _command_progress(awaited: Awaited, agent: AgentState, accepted: bool) -> AwaitedReport:
    cmd = agent.last_command
    if agent.epoch < awaited.epoch or cmd is None or cmd.epoch < awaited.epoch:  # not reported taking it
        return AwaitedReport.RUNNING if accepted else AwaitedReport.DECIDE
    if (agent.epoch, cmd.epoch, cmd.action) != (awaited.epoch, awaited.epoch, awaited.action):
        return AwaitedReport.DECIDE
    if cmd.state == CommandState.RUNNING:
        return AwaitedReport.RUNNING
    return AwaitedReport.SUCCEEDED if cmd.state == CommandState.SUCCEEDED else AwaitedReport.DECIDE


def decides_nothing_new(
    awaiting: Sequence[Awaited],
    changed: Collection[str],
    agents: Mapping[str, AgentState | None],
    accepted: Collection[str],
) -> bool:
    """After a decision that waits only on `awaiting`: True when the reports of the pods in `changed` since
    then would make the same decision (nothing new sent, no status field changed): each is an awaited pod's
    report, none says DECIDE, and one awaited pod still runs its command (its report says so, or it does not
    show the command yet and the pod is in `accepted`). Anything else is decided: a failed command, another
    epoch or boot, a Failed stage or `fatal`, the last awaited pod finishing, a pod not awaited, a command
    not yet accepted (it is sent again)."""
    awaited = {a.pod for a in awaiting}
    if not awaited or not awaited.issuperset(changed):
        return False
    reports = [awaited_report(a, agents.get(a.pod), a.pod in accepted) for a in awaiting]
    return AwaitedReport.DECIDE not in reports and AwaitedReport.RUNNING in reports
