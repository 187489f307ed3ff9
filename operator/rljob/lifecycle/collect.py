"""Running a lock-step row: send its command to every pod that has not taken the phase's epoch, collect the
evidence of those that did, and move on once every pod showed it. A stale, duplicated or reordered report
can only make this resend the same epoch (a no-op at the agent), never advance."""

from __future__ import annotations

from dataclasses import dataclass, field

from rljob.api.agent import AgentState, Command, CommandStatus
from rljob.lifecycle.endings import (
    fail_or_recover_after_command_failure,
    past,
    recover,
    restart_gang_if_timed_out,
    stop_without_finishing,
)
from rljob.lifecycle.evidence import KINDS, Progress, command_progress
from rljob.lifecycle.lock_steps import LockStep
from rljob.lifecycle.memory_waits import memory_wait, show_memory_waits
from rljob.lifecycle.model import Awaited, PodObservation
from rljob.lifecycle.roles import Role, role_of
from rljob.lifecycle.step import Step


def run_lock_step(step: Step, row: LockStep) -> None:
    """The handler of every lock-step phase."""
    if row.already_done is not None and row.already_done(step):
        row.then(step, [])
        return
    if _ended_early(step, row):
        return
    done = send_and_collect(step, row)
    if done is not None:
        row.then(step, done)


def _ended_early(step: Step, row: LockStep) -> bool:
    """A lost member or the deadline ended the phase: True when it did."""
    lost = step.lost_member()
    limit = row.deadline(step.spec.phase_timeout_seconds)
    if step.status.stopping and not row.best_effort:
        if lost is None and not past(step, limit):
            return False
        stop_without_finishing(step, lost or f"{step.status.phase.value} past its deadline")
        return True
    if row.best_effort:  # the pods go anyway
        if lost is None and not past(step, limit):
            return False
        row.then(step, [])
        return True
    if lost is not None:
        recover(step, lost)
        return True
    return restart_gang_if_timed_out(step, limit)


def send_and_collect(step: Step, row: LockStep) -> list[AgentState] | None:
    """The agents' states once every pod finished the epoch with the row's evidence; None while waiting
    (Decision.awaiting says on what, when each pod waits on evidence one report can show) or when a pod's
    report restarted the gang or failed the job."""
    step.awaiting = []
    gang = _Round(step, row, step.target_version())
    for pod in sorted(step.gang().values(), key=lambda p: p.index):  # a leader before its followers
        if not gang.take(pod):
            return None
    show_memory_waits(step, gang.memory_waits)
    if gang.waiting and not gang.undecidable:
        step.awaiting = gang.awaited
    return None if gang.waiting else gang.finished


@dataclass
class _Round:
    """One pass of a lock-step row over the gang."""

    step: Step
    row: LockStep
    target: str | None
    finished: list[AgentState] = field(default_factory=list)
    awaited: list[Awaited] = field(default_factory=list)  # each waits on evidence one report can show
    waiting: bool = False
    undecidable: bool = False  # something else is awaited too: every report is decided
    leaders_done: set[int] = field(default_factory=set)  # leaders that showed the row's evidence
    built: dict[tuple[Role, str | None], Command] = field(default_factory=dict)  # by role, LockStep.varies
    memory_waits: list[tuple[str, str]] = field(default_factory=list)  # (pod, what its resume waits for)

    def __post_init__(self) -> None:
        # What every pod of the pass reads, looked up once: a pass visits the whole gang.
        self.epoch = self.step.status.epoch
        self.per_instance = self.step.spec.rollout.pods_per_instance
        self.shown_by = KINDS[self.row.evidence].predicate
        self.per_report = self.row.evidence.per_report
        self.awaited_as = self.row.evidence.awaited_as

    def _awaited(self, pod: PodObservation, agent: AgentState) -> Awaited:
        waits = memory_wait(agent, self.epoch)
        return Awaited(pod.name, agent.boot_id, self.epoch, self.row.action, self.awaited_as, waits)

    def wait(self, awaited: Awaited | None) -> None:
        self.waiting = True
        if awaited is None:
            self.undecidable = True
        else:
            self.awaited.append(awaited)

    def take(self, pod: PodObservation) -> bool:
        """Send to or collect from `pod`; False when its report restarted the gang or failed the job."""
        step, row, epoch = self.step, self.row, self.epoch
        agent = step.agent(pod)
        if agent is None or not pod.running:
            self.wait(None)
            return True
        progress = command_progress(agent, epoch, row.action)
        if progress == Progress.NOT_SHOWN:
            self.send(pod, agent)
            return True
        cmd = agent.last_command
        assert cmd is not None  # shown: this epoch's command or a later one
        if progress == Progress.OTHER:
            # The agent is ahead of our status: our status was rolled back. Never guess: restart the gang.
            recover(step, f"pod {pod.name} reports epoch {cmd.epoch} ({cmd.action.value}), job is at {epoch}")
            return False
        return self.collect(pod, agent, cmd, progress)

    def collect(self, pod: PodObservation, agent: AgentState, cmd: CommandStatus, progress: Progress) -> bool:
        """`pod` reports this epoch's command: it runs, failed, or finished with or without the evidence."""
        if progress == Progress.RUNNING:
            waits = memory_wait(agent, self.epoch)
            if waits is not None:
                self.memory_waits.append((pod.name, waits))
            self.wait(self._awaited(pod, agent))
        elif progress == Progress.FAILED:
            return self.failed(pod, agent, cmd)
        elif not self.shown_by(agent, self.epoch, self.target):
            self.wait(self._awaited(pod, agent) if self.per_report else None)
        else:
            self.finished.append(agent)
            if role_of(pod.index, self.per_instance) == Role.LEADER:
                self.leaders_done.add(pod.index)
        return True

    def send(self, pod: PodObservation, agent: AgentState) -> None:
        """The row's command, unless `pod` is a follower whose leader has yet to show the evidence."""
        role = role_of(pod.index, self.per_instance)
        leader = pod.index - pod.index % self.per_instance
        if role == Role.FOLLOWER and self.row.after_leader and leader not in self.leaders_done:
            self.wait(None)
            return
        key = (role, self.row.varies(agent))
        command = self.built.get(key)
        if command is None:
            command = self.built[key] = self.row.command(self.step, agent, role)
        self.step.send(pod, command)
        self.wait(self._awaited(pod, agent))  # once it is accepted

    def failed(self, pod: PodObservation, agent: AgentState, cmd: CommandStatus) -> bool:
        if self.row.best_effort:
            self.finished.append(agent)
            return True
        if self.step.status.stopping:
            stop_without_finishing(self.step, f"{cmd.action.value} failed on {pod.name}: {cmd.error}")
        else:
            fail_or_recover_after_command_failure(self.step, pod, cmd)
        return False
