"""What ends a phase: each kind of evidence is one pure predicate over (an agent's report, the epoch, the
target weight version). The lock-step rows name theirs (lock_steps.LOCK_STEPS); Rollout's is
`trainer_requested`; the conductor checks the ones that need no target report by report (awaiting.py).
How far a report shows the epoch's command got is judged once, `command_progress`, for both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from rljob.api.agent import Action, AgentState, CommandState, Stage

Predicate = Callable[[AgentState, int, str | None], bool]
"""(the agent's report, the epoch, the target version) -> whether the report shows the evidence."""


class Evidence(StrEnum):
    """What a pod's report must show before its phase is done on that pod."""

    COMMAND_SUCCEEDED = "CommandSucceeded"
    MEMORY_VERIFIED = "MemoryVerified"
    PUBLISHED = "Published"
    LEASE_RETURNED = "LeaseReturned"
    SERVES_TARGET = "ServesTarget"
    SERVING_TARGET = "ServingTarget"
    TRAINER_REQUESTED = "TrainerRequested"

    def shown_by(self, agent: AgentState, epoch: int, target: str | None) -> bool:
        return KINDS[self].predicate(agent, epoch, target)

    @property
    def per_report(self) -> bool:
        return KINDS[self].per_report

    @property
    def of_command(self) -> bool:
        return KINDS[self].of_command

    @property
    def awaited_as(self) -> Evidence:
        """What an awaited pod is checked for report by report (Awaited.evidence): this evidence, or, when
        it is not checkable per report, its command succeeding (a decision then looks at the report)."""
        return self if self.per_report else Evidence.COMMAND_SUCCEEDED


class Progress(StrEnum):
    """What a report says of the epoch's command (`command_progress`)."""

    NOT_SHOWN = "NotShown"  # an older epoch or command: not taken, or taken and not reported yet
    OTHER = "Other"  # a command of a later epoch, or another action at this one: ahead of the status
    RUNNING = "Running"
    FAILED = "Failed"
    SUCCEEDED = "Succeeded"  # the command did; whether the row's evidence shows is the predicate's


def command_progress(agent: AgentState, epoch: int, action: Action) -> Progress:
    """How far `agent`'s report shows the command `action` of `epoch` got: the one judgement of a
    report's command that sending and collecting a row (collect.py) and the report-by-report check of a
    decision that waits (awaiting.py) both make."""
    cmd = agent.last_command
    if agent.epoch < epoch or cmd is None or cmd.epoch < epoch:
        return Progress.NOT_SHOWN
    if cmd.epoch > epoch or cmd.action != action:
        return Progress.OTHER
    if cmd.state == CommandState.RUNNING:
        return Progress.RUNNING
    return Progress.SUCCEEDED if cmd.state == CommandState.SUCCEEDED else Progress.FAILED


def _succeeded(agent: AgentState, epoch: int) -> bool:
    cmd = agent.last_command
    return cmd is not None and cmd.epoch == epoch and cmd.state == CommandState.SUCCEEDED


def command_succeeded(agent: AgentState, epoch: int, target: str | None) -> bool:
    return _succeeded(agent, epoch)


def memory_verified(agent: AgentState, epoch: int, target: str | None) -> bool:
    return _succeeded(agent, epoch) and agent.memory.verified  # invariant 3: no lease before verified memory


def published(agent: AgentState, epoch: int, target: str | None) -> bool:
    trainer = agent.trainer
    shown = trainer.published_epoch == epoch and trainer.published_version is not None
    return _succeeded(agent, epoch) and shown


def returned_unchanged(agent: AgentState, epoch: int) -> bool:
    """The trainer gave the lease of `epoch` back without new weights (agent/lease.py return_unchanged)."""
    return agent.trainer.returned_epoch == epoch


def lease_returned(agent: AgentState, epoch: int, target: str | None) -> bool:
    """Published, or gave the lease back without new weights: the trainer is done with this lease."""
    return _succeeded(agent, epoch) and (published(agent, epoch, target) or returned_unchanged(agent, epoch))


def serves_target(agent: AgentState, epoch: int, target: str | None) -> bool:
    return _succeeded(agent, epoch) and agent.engine.served_version == target


def serving_target(agent: AgentState, epoch: int, target: str | None) -> bool:
    # invariant 4: rollout reopens only on the verified version
    return _succeeded(agent, epoch) and agent.stage == Stage.SERVING and agent.engine.served_version == target


def trainer_requested(agent: AgentState, epoch: int, target: str | None) -> bool:
    # The agent clears a request at grant: only a report of this rollout's epoch counts.
    return agent.epoch == epoch and agent.trainer.requested


@dataclass(frozen=True)
class EvidenceKind:
    predicate: Predicate
    per_report: bool  # checkable report by report without a decision (Decision.awaiting)
    of_command: bool = True  # shown by the epoch's command; False: after it finished, in the next phase


KINDS: dict[Evidence, EvidenceKind] = {
    Evidence.COMMAND_SUCCEEDED: EvidenceKind(command_succeeded, per_report=True),
    Evidence.MEMORY_VERIFIED: EvidenceKind(memory_verified, per_report=False),
    Evidence.PUBLISHED: EvidenceKind(published, per_report=True),
    Evidence.LEASE_RETURNED: EvidenceKind(lease_returned, per_report=True),
    Evidence.SERVES_TARGET: EvidenceKind(serves_target, per_report=False),  # needs the target
    Evidence.SERVING_TARGET: EvidenceKind(serving_target, per_report=False),  # needs the target
    Evidence.TRAINER_REQUESTED: EvidenceKind(trainer_requested, per_report=True, of_command=False),
}
