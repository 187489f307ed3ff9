"""When the conductor decides again: the conductor reports what happened (a round's inputs, a decision and
its cost, what did not go through, a pod list), the pacer answers when (controller-runtime's
`Result{RequeueAfter}`). Pure: every time is the event loop's, passed in; it reads no clock and awaits
nothing."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

from rljob.api.agent import AgentState
from rljob.lifecycle.awaiting import AwaitedReport, awaited_report
from rljob.lifecycle.model import Awaited

TICK_SECONDS = 2.0  # what did not go through is tried again this much later; a round at least this often
QUIET_SECONDS = 30.0  # a decision at least this often, whatever is observed
RESYNC_SECONDS = 60.0  # a full pod list at least this often (a reconnected watch misses deletions)
RESYNC_SECONDS_PER_POD = 0.5  # and no more often than this per pod
PACE = 3.0  # while reports stream in, a decision waits this many times the last one's cost after it
MAX_PAUSE = 0.05  # seconds: the longest that wait


class Skip(Enum):
    """Why a round makes no decision."""

    UNCHANGED = "unchanged"  # nothing the last decision depended on changed
    AWAITED = "awaited"  # only reports came, and they decide nothing new (Decision.awaiting)


def _same(now: tuple[Any, ...], then: tuple[Any, ...]) -> bool:
    return all(a is b or a == b for a, b in zip(now, then, strict=True))


class AwaitedPods:
    """The last decision's Decision.awaiting, kept report by report as each comes: whether the reports
    since then would make the same decision (lifecycle.awaiting.awaited_report of each), in the time of one
    report rather than of a round over the whole gang, so a report that decides nothing wakes nothing.
    Pods whose reports said they succeeded leave `running`; when none is left, or a report says anything
    else, or a command was not accepted, the next round decides."""

    def __init__(self) -> None:
        self._awaited: dict[str, Awaited] = {}
        self._running: set[str] = set()
        self._void = True  # nothing to wait on: every round decides

    def decided(self, awaiting: tuple[Awaited, ...]) -> None:
        self._awaited = {a.pod: a for a in awaiting}
        self._running = set(self._awaited)
        self._void = not awaiting

    def reported(self, pod: str, latest: AgentState | None, took: Callable[[Awaited], bool]) -> None:
        """`pod`'s report `latest` came; `took`: whether its agent accepted the awaited command."""
        if self._void:
            return
        awaited = self._awaited.get(pod)
        seen = awaited_report(awaited, latest, took(awaited)) if awaited else AwaitedReport.DECIDE
        if seen == AwaitedReport.DECIDE:
            self._void = True
        elif seen == AwaitedReport.SUCCEEDED:
            self._running.discard(pod)

    def not_taken(self) -> None:
        self._void = True

    def nothing_new(self) -> bool:
        return not self._void and bool(self._running)


class Pacer:
    """A decision is made when an input of the last one changed, when it is due (Decision.next_due, a
    status write's retry, a tick after what did not go through, QUIET_SECONDS after the last), never on
    reports alone that decide nothing new; between rounds the conductor waits for a wake at most a tick."""

    def __init__(self, tick_seconds: float = TICK_SECONDS, quiet_seconds: float = QUIET_SECONDS) -> None:
        self.tick_seconds = tick_seconds
        self.quiet_seconds = quiet_seconds
        self.awaited = AwaitedPods()  # what the last decision waits on, report by report
        self._reports = 0  # reports received: with the round's inputs, what moves the observation
        self._decided: tuple[tuple[Any, ...], int] | None = None  # (inputs, reports) of the last decision
        self._decided_at = 0.0  # when the last decision ended
        self._decide_seconds = 0.0  # what it cost
        self._due_at = 0.0  # when the next decision is due whatever is observed
        self._untaken = False  # a command of the last decision was not taken
        self._resync_at = 0.0  # when the next full pod list is due

    # -- what happened -----------------------------------------------------------------------------

    def reported(self, pod: str, latest: AgentState | None, took: Callable[[Awaited], bool]) -> bool:
        """An agent report came; True when a decision must look at it (wake the conductor)."""
        self._reports += 1
        self.awaited.reported(pod, latest, took)
        return not self.awaited.nothing_new()

    def decided(self, now: float, seconds: float, awaiting: tuple[Awaited, ...]) -> None:
        """A decision ended at `now`, having cost `seconds`; it waits on `awaiting`."""
        self._decided_at = now
        self._decide_seconds = seconds
        self._untaken = False
        self.awaited.decided(awaiting)

    def not_taken(self) -> None:
        """A command of the last decision was not taken: the next decision sends it again."""
        self.awaited.not_taken()
        self._untaken = True

    def not_stored(self, now: float, retry_in: float) -> None:
        """The last decision's status was not stored (nothing of it was carried out): made again then."""
        self.awaited.not_taken()
        self._due_at = now + retry_in

    def carried_out(
        self, now: float, next_due: float | None, retry: bool = False, held_back: float | None = None
    ) -> None:
        """The last decision was carried out at `now`. `next_due`: seconds until time alone changes it;
        `retry`: something else did not settle (a tick from now); `held_back`: seconds until the status
        writer writes what it held back."""
        after = self.tick_seconds if retry or self._untaken else self.quiet_seconds
        if next_due is not None:
            after = min(after, max(0.0, next_due))
        if held_back is not None:
            after = min(after, held_back)
        self._due_at = now + after

    def listed(self, now: float, pods: int) -> None:
        """A full list of `pods` pods was read at `now`."""
        self._resync_at = now + max(RESYNC_SECONDS, RESYNC_SECONDS_PER_POD * pods)

    def list_again(self) -> None:
        """The pod cache missed a pod: the next round lists."""
        self._resync_at = 0.0

    # -- when ------------------------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        """A decision is made now, whatever is observed."""
        return now >= self._due_at

    def list_due(self, now: float) -> bool:
        return now >= self._resync_at

    def skip(self, inputs: tuple[Any, ...], due: bool) -> Skip | None:
        """Why a round with these inputs makes no decision; None: it decides (and they are the last
        decision's inputs from now on)."""
        last = self._decided
        if not due and last is not None and _same(inputs, last[0]):
            if last[1] == self._reports:
                return Skip.UNCHANGED
            if self.awaited.nothing_new():
                self._decided = (inputs, self._reports)
                return Skip.AWAITED
        self._decided = (inputs, self._reports)
        return None

    def pause(self, now: float, due: bool) -> float:
        """Seconds to wait before deciding, so that reports coming meanwhile go into one decision."""
        if due:
            return 0.0
        return max(0.0, min(MAX_PAUSE, PACE * self._decide_seconds) - (now - self._decided_at))

    def wait(self, now: float) -> float:
        """Seconds to wait for a wake after a round that changed nothing: until the next decision or list
        is due, a tick at most."""
        return max(0.0, min(self._due_at, self._resync_at, now + self.tick_seconds) - now)
