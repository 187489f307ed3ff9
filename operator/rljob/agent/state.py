"""The agent's state (the AgentState wire model, plus the facts the engine reported at start) and the
change notification behind the channel and the trainer's long-polls: each commit bumps the revision and
wakes the waiters.
With a pod-local record (agent/record.py) every commit is also saved there, and a non-idempotent engine
call is announced (`announce`) before it is made and closed (`outcome`) with its result."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from rljob.agent.errors import CommandFailed
from rljob.agent.record import AgentRecord, Intent
from rljob.agent.reports import OperatorReports
from rljob.agent.stages import check_move
from rljob.api.agent import (
    COMMAND_ADAPTER,
    STATE_UNKNOWN,
    AgentState,
    Command,
    CommandState,
    RecoveryState,
    Stage,
)
from rljob.api.spec import DrainMode

if TYPE_CHECKING:
    from rljob.agent.engines.base import EngineFacts
    from rljob.agent.weights_check import Held
    from rljob.api.agent import WeightsDigest

log = logging.getLogger("rljob.agent")


class StateStore:
    def __init__(
        self, on_commit: Callable[[int], None] | None = None, record: AgentRecord | None = None
    ) -> None:
        self.state = AgentState(revision=0, boot_id=uuid.uuid4().hex, stage=Stage.STARTING)
        self.facts: EngineFacts | None = None
        self.lease_epoch: int | None = None  # epoch of the grant the trainer holds / published under
        self._tick = asyncio.Event()
        self._on_commit = on_commit
        self.last_commit = time.monotonic()
        self.operator_reports = OperatorReports()  # the revisions the channel sends the operator
        # Kept in the record beside the state report (what a restarted agent needs to continue):
        self.record = record
        self.boots = 1  # agent processes started in this pod, this one included
        self.command: Command | None = None  # the last accepted command, re-run if it was still running
        # How the engine was paused: after a retract its queue holds the retracted requests, which its idle
        # proof must tell from work (Engine.prove_idle).
        self.pause_mode: DrainMode | None = None
        self.release_before: dict[int, int] = {}  # per-GPU used bytes before the last release
        # The headroom gate's inputs (agent/headroom.py): per GPU, what the last release freed (verified),
        # and what the resumes since took back (measured around each).
        self.release_freed: dict[int, int] = {}
        self.taken_back: dict[int, int] = {}
        self.refit_done: str | None = None  # the running refit's load call returned, loading this version
        self.path_version: str | None = None  # the version the engine's model path holds (None: unknown)
        # A reload of this version resumed weights the release discarded: its disk load is still owed.
        self.reload_owed: str | None = None
        self.intent: Intent | None = None  # a non-idempotent call announced and not closed
        # Not in the record (a restarted agent compares without them and says so): the trainer's last digest,
        # (version, digest or None with why), and the parameters of the agent's last look at the engine's
        # weights.
        self.trainer_digest: tuple[str, WeightsDigest | None, str] | None = None
        self.weights_held: Held | None = None
        self.architectures: list[str] = []  # the engine's, where it says: the SDK's digest reads them

    # --- the record ------------------------------------------------------------------------------

    def payload(self) -> dict[str, Any]:
        return {
            "boots": self.boots,
            "state": self.state.model_dump(mode="json", by_alias=True, exclude_none=True),
            "leaseEpoch": self.lease_epoch,
            "command": (
                COMMAND_ADAPTER.dump_python(self.command, mode="json", by_alias=True)
                if self.command is not None
                else None
            ),
            "pauseMode": self.pause_mode.value if self.pause_mode is not None else None,
            "releaseBefore": {str(k): v for k, v in self.release_before.items()},
            "releaseFreed": {str(k): v for k, v in self.release_freed.items()},
            "takenBack": {str(k): v for k, v in self.taken_back.items()},
            "refitDone": self.refit_done,
            "pathVersion": self.path_version,
            "reloadOwed": self.reload_owed,
            "intent": self.intent.wire() if self.intent is not None else None,
        }

    def _save(self) -> None:
        if self.record is None:
            return
        try:
            self.record.save(self.payload())
        except OSError as e:  # the next save may succeed; a call is announced only once saved
            log.error("cannot save the agent record %s: %s", self.record.path, e)

    def announce(self, intent: Intent) -> None:
        """Before a non-idempotent engine call: the record says it is about to happen. A call that
        cannot be announced is not made (CommandFailed): a restart would not know it happened."""
        self.intent = intent
        if self.record is None:
            return
        try:
            self.record.save(self.payload())
        except OSError as e:
            self.intent = None
            raise CommandFailed(f"cannot record {intent.describe()} before making it: {e}") from e

    @contextlib.contextmanager
    def outcome(self, stage: Stage | None = None) -> Iterator[AgentState]:
        """After the announced call answered: its outcome and the closed intent in one revision."""
        self._move(stage)
        yield self.state
        self.intent = None
        self.commit()

    def restore(self, data: dict[str, Any]) -> None:
        """A restarted agent: the recorded state under this process's boot id, Recovering."""
        st = AgentState.model_validate(data["state"])
        st.boot_id = self.state.boot_id
        st.recovery.state = RecoveryState.RECOVERING
        st.recovery.restarts = int(data.get("boots") or 1)
        st.recovery.detail = None
        if st.headroom is not None:  # a wait is this process's: a re-run command checks again
            st.headroom.waiting = False
        self.state = st
        self.boots = int(data.get("boots") or 1) + 1
        self.lease_epoch = data.get("leaseEpoch")
        command = data.get("command")
        self.command = COMMAND_ADAPTER.validate_python(command) if command else None
        self.pause_mode = DrainMode(data["pauseMode"]) if data.get("pauseMode") else None
        self.release_before = {int(k): int(v) for k, v in (data.get("releaseBefore") or {}).items()}
        self.release_freed = {int(k): int(v) for k, v in (data.get("releaseFreed") or {}).items()}
        self.taken_back = {int(k): int(v) for k, v in (data.get("takenBack") or {}).items()}
        self.refit_done = data.get("refitDone")
        self.path_version = data.get("pathVersion")
        self.reload_owed = data.get("reloadOwed")
        self.intent = Intent.from_wire(data["intent"]) if data.get("intent") else None

    @property
    def recovering(self) -> bool:
        return self.state.recovery.state == RecoveryState.RECOVERING

    @contextlib.contextmanager
    def change(self, stage: Stage | None = None) -> Iterator[AgentState]:
        """`with store.change(stage=...) as s: ...` -> one revision for the whole change."""
        self._move(stage)
        yield self.state
        self.commit()

    def _move(self, stage: Stage | None) -> None:
        """The only place the stage changes, by a move agent/stages.py declares (else IllegalMove)."""
        if stage is not None:
            check_move(self.state.stage, stage)
            self.state.stage = stage

    def commit(self) -> None:
        self.state.revision += 1
        self.operator_reports.committed(self.state)
        self.last_commit = time.monotonic()
        self._save()
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()
        if self._on_commit is not None:
            self._on_commit(self.state.revision)

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until `predicate()` holds after some commit; False when `timeout` passes first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not predicate():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._tick.wait(), remaining)
        return True

    async def wait_newer(self, since: int, timeout: float) -> None:
        await self.wait_until(lambda: self.state.revision > since, timeout)

    async def wait_stage(self, since: int, stage: Stage, timeout: float) -> None:
        """Until a revision after `since` in `stage`, or Failed: a trainer waiting for Serving is answered
        once, not on each of the refit's and the resume's revisions."""
        await self.wait_until(
            lambda: self.state.revision > since and self.state.stage in (stage, Stage.FAILED), timeout
        )

    def fail(self, reason: str) -> None:
        """The engine died or its state is unknown: the pod must be replaced. Sticky."""
        if self.state.stage == Stage.FAILED:
            return
        with self.change(stage=Stage.FAILED) as s:
            s.fatal = reason[:1024]
            s.engine.reachable = False

    def unsure(self, detail: str) -> None:
        """A restarted agent cannot tell what the engine did (an announced call without an outcome and no
        evidence either way): Failed with StateUnknown, so that the operator replaces the instance rather
        than the agent guessing. Sticky, like `fail`."""
        if self.state.stage == Stage.FAILED:
            return
        log.error("state unknown after the agent's restart: %s", detail)
        with self.change(stage=Stage.FAILED) as s:
            s.fatal = f"{STATE_UNKNOWN}: {detail}"[:1024]
            s.recovery.state = RecoveryState.UNSURE
            s.recovery.detail = detail[:1024]
            if s.last_command is not None and s.last_command.state == CommandState.RUNNING:
                s.last_command.state = CommandState.FAILED  # the command cannot continue either
                s.last_command.error = s.fatal
