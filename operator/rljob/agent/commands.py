"""Accepting operator commands: epochs (idempotency), one command at a time, the transition guards, and
asynchronous execution whose outcome lands in AgentState.last_command. The accepted command is kept in
the pod-local record, so that a restarted agent finishes it (`resume_recorded`) instead of forgetting it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from rljob.agent.engines.base import EngineError, EngineFacts, EngineUnreachable
from rljob.agent.errors import CommandFailed, PermanentFailure, StateLost, conflict
from rljob.agent.metrics import AgentMetrics
from rljob.agent.state import StateStore
from rljob.agent.timing import measure_external
from rljob.api.agent import AgentState, Command, CommandState, CommandStatus

log = logging.getLogger("rljob.agent")


class CommandActions(Protocol):
    """What the desk runs a command with (agent/actions.py Actions)."""

    def check(self, cmd: Command, state: AgentState, facts: EngineFacts | None) -> None: ...

    async def execute(self, cmd: Command) -> None: ...


def is_new(cmd: Command, epoch: int, last: CommandStatus | None, recovering: bool = False) -> bool:
    """The desk's epoch rules, before the stage guards (agent/actions.py): True when `cmd` is a new command
    to check and run, False when it replays `last` (same epoch and action: answered with its status).
    Raises Refused (409) for an epoch reused by another action, an epoch older than `epoch` (the last
    accepted), and while the agent recovers or runs `last`."""
    if last is not None and cmd.epoch == last.epoch:
        if cmd.action != last.action:
            raise conflict("EpochConflict", f"epoch {cmd.epoch} was already used for {last.action.value}")
        return False
    if cmd.epoch < epoch:
        raise conflict("StaleEpoch", f"epoch {cmd.epoch} is older than the last accepted epoch {epoch}")
    if recovering:
        raise conflict("Busy", "the agent restarted and is checking its record against the engine (recovery)")
    if last is not None and last.state == CommandState.RUNNING:
        raise conflict("Busy", f"{last.action.value} (epoch {last.epoch}) is still running")
    return True


class CommandDesk:
    def __init__(
        self,
        store: StateStore,
        actions: CommandActions,
        metrics: AgentMetrics,
        confirm_death: Callable[[str], Awaitable[None]],
        engine_name: str = "the engine",
    ) -> None:
        self._store = store
        self._actions = actions
        self._metrics = metrics
        self._confirm_death = confirm_death  # asks the engine; marks the agent Failed if it is gone
        self._engine_name = engine_name
        self._running: asyncio.Task[None] | None = None

    def submit(self, cmd: Command) -> tuple[int, CommandStatus]:
        """(HTTP status, body): 202 accepted, 200 replay of the same epoch and action; Refused otherwise."""
        st = self._store.state
        last = st.last_command
        if not is_new(cmd, st.epoch, last, self._store.recovering):
            assert last is not None
            self._metrics.commands.labels(cmd.action.value, "replayed").inc()
            return 200, last.model_copy()
        self._actions.check(cmd, st, self._store.facts)
        status = CommandStatus(
            epoch=cmd.epoch, action=cmd.action, state=CommandState.RUNNING, started_at=time.time()
        )
        self._store.command = cmd
        self._store.refit_done = None
        with self._store.change() as s:  # with a record: saved before anything is sent to the engine
            s.epoch = cmd.epoch
            s.last_command = status
        self._metrics.commands.labels(cmd.action.value, "accepted").inc()
        log.info("command accepted: %s epoch=%d", cmd.action.value, cmd.epoch)
        self._running = asyncio.create_task(self._run(cmd), name=f"command-{cmd.epoch}")
        return 202, status.model_copy()

    def resume_recorded(self, cmd: Command) -> None:
        """After the agent's restart: run again the command the record shows Running. Every operation skips
        what the record says is done (a release made, tags resumed, a load returned), so nothing is
        repeated; its outcome lands in last_command as if the process had never stopped."""
        log.info("continuing command %s epoch=%d after the agent's restart", cmd.action.value, cmd.epoch)
        self._running = asyncio.create_task(self._run(cmd), name=f"command-{cmd.epoch}")

    async def wait(self, epoch: int, seconds: float) -> CommandStatus | None:
        def finished() -> bool:
            last = self._store.state.last_command
            return last is None or last.epoch != epoch or last.state != CommandState.RUNNING

        await self._store.wait_until(finished, seconds)
        last = self._store.state.last_command
        return last.model_copy() if last is not None and last.epoch == epoch else None

    async def _run(self, cmd: Command) -> None:
        started = time.monotonic()
        error: str | None = None
        permanent: PermanentFailure | None = None
        reason: str | None = None
        with measure_external() as external:
            try:
                await self._actions.execute(cmd)
            except PermanentFailure as e:
                error, permanent, reason = str(e), e, e.reason
            except CommandFailed as e:
                error, reason = str(e), e.reason
            except StateLost as e:
                error = str(e)
                self._store.fail(error)
            except EngineUnreachable as e:
                error = f"{self._engine_name} unreachable: {e}"
                await self._confirm_death(error)
            except EngineError as e:
                error = str(e)
            except Exception as e:  # a bug must not leave the command Running forever
                log.exception("command %s epoch=%d crashed", cmd.action.value, cmd.epoch)
                error = f"internal error: {e.__class__.__name__}: {e}"
        seconds = time.monotonic() - started
        result = "failed" if error else "succeeded"
        self._metrics.commands.labels(cmd.action.value, result).inc()
        self._metrics.command_seconds.labels(cmd.action.value).observe(seconds)
        log.info(
            "command %s epoch=%d %s in %.3fs%s",
            cmd.action.value,
            cmd.epoch,
            result,
            seconds,
            f": {error}" if error else "",
        )
        with self._store.change() as s:
            assert s.last_command is not None
            s.last_command.state = CommandState.FAILED if error else CommandState.SUCCEEDED
            s.last_command.error = error[:1024] if error else None
            s.last_command.permanent = permanent is not None
            s.last_command.failure_reason = reason
            s.last_command.seconds = seconds
            s.last_command.engine_seconds = min(seconds, external[0])
