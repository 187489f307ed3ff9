"""Whether a report changes a decision that waits only on pods showing evidence (Decision.awaiting): the
conductor's pacer asks it report by report (controller/pacer.py, AwaitedPods); the evidence and the
judgement of a report's command are evidence.py's."""

from __future__ import annotations

from enum import StrEnum

from rljob.api.agent import AgentState, Stage
from rljob.lifecycle.evidence import Progress, command_progress
from rljob.lifecycle.memory_waits import memory_wait
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
    if memory_wait(agent, awaited.epoch) != awaited.memory_wait:  # the status message says what it waits for
        return AwaitedReport.DECIDE
    evidence = awaited.evidence
    if evidence.of_command:
        progress = _command_report(awaited, agent, accepted)
        if progress != AwaitedReport.SUCCEEDED:
            return progress
    elif agent.epoch != awaited.epoch:  # shown after the command: only a report of its epoch counts
        return AwaitedReport.DECIDE
    return AwaitedReport.SUCCEEDED if evidence.shown_by(agent, awaited.epoch, None) else AwaitedReport.RUNNING


def _command_report(awaited: Awaited, agent: AgentState, accepted: bool) -> AwaitedReport:
    progress = command_progress(agent, awaited.epoch, awaited.action)
    if progress == Progress.NOT_SHOWN:  # not reported taking it
        return AwaitedReport.RUNNING if accepted else AwaitedReport.DECIDE
    if agent.epoch != awaited.epoch:  # a report of a later epoch is decided on
        return AwaitedReport.DECIDE
    if progress == Progress.RUNNING:
        return AwaitedReport.RUNNING
    return AwaitedReport.SUCCEEDED if progress == Progress.SUCCEEDED else AwaitedReport.DECIDE
