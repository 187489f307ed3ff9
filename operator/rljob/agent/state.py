"""The agent's state (the AgentState wire model, plus facts read from SGLang at start) and the change
notification behind every long-poll: each committed change bumps the revision and wakes the waiters."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rljob.agent.reports import OperatorReports
from rljob.api.agent import AgentState, Stage


@dataclass(frozen=True)
class ServerFacts:
    """Launch facts from /server_info; they cannot change while the server runs."""

    version: str
    weight_cache_mode: str
    memory_saver: bool
    weights_cpu_backup: bool
    dp_size: int
    dp_attention: bool = False

    @property
    def weight_cache_active(self) -> bool:
        return self.weight_cache_mode != "off"

    @classmethod
    def from_server_info(cls, info: dict[str, Any]) -> ServerFacts:
        return cls(
            version=str(info["version"]),
            weight_cache_mode=str(info.get("weight_cache_mode") or "off"),
            memory_saver=bool(info.get("enable_memory_saver", False)),
            weights_cpu_backup=bool(info.get("enable_weights_cpu_backup", False)),
            # C-REFIT-DP / C-DP-FANOUT: /server_info spreads the resolved ServerArgs (http_server.py:540-557
            # @0.5.6), so dp_size and enable_dp_attention are there on every version.
            dp_size=int(info.get("dp_size") or 1),
            dp_attention=bool(info.get("enable_dp_attention", False)),
        )


class StateStore:
    def __init__(self, on_commit: Callable[[int], None] | None = None) -> None:
        self.state = AgentState(revision=0, boot_id=uuid.uuid4().hex, stage=Stage.STARTING)
        self.facts: ServerFacts | None = None
        self.lease_epoch: int | None = None  # epoch of the grant the trainer holds / published under
        self._tick = asyncio.Event()
        self._on_commit = on_commit
        self.last_commit = time.monotonic()
        self.operator_reports = OperatorReports()  # the revisions `changes=operator` waits for

    @contextlib.contextmanager
    def change(self) -> Iterator[AgentState]:
        """`with store.change() as s: s.stage = ...` -> one revision for the whole change."""
        yield self.state
        self.commit()

    def commit(self) -> None:
        self.state.revision += 1
        self.operator_reports.committed(self.state)
        self.last_commit = time.monotonic()
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

    async def wait_operator(self, since: int, timeout: float) -> None:
        """Until a revision after `since` that the operator acts on (agent/reports.py)."""
        await self.wait_until(lambda: self.operator_reports.revision > since, timeout)

    def fail(self, reason: str) -> None:
        """SGLang died or its state is unknown: the pod must be replaced. Sticky."""
        if self.state.stage == Stage.FAILED:
            return
        with self.change() as s:
            s.stage = Stage.FAILED
            s.fatal = reason[:1024]
            s.sglang.reachable = False
