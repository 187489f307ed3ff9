"""The tensor/distributed refit window: opened by the refit command, used by the trainer to push weights
through the agent (which puts the version on the final push), closed by the trainer. Pushes are forwarded
one at a time, in arrival order. A distributed window's group init runs in the background: the engine
answers it only once the trainer has joined the group."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rljob.agent.engines.base import Engine, EngineError, EngineUnreachable
from rljob.agent.errors import Refused, conflict
from rljob.agent.state import StateStore
from rljob.api.agent import (
    DistributedPush,
    GroupState,
    InitWeightsGroup,
    PushResult,
    RefitWindow,
    TensorPush,
    WeightsDigest,
)
from rljob.api.spec import RefitSource

log = logging.getLogger("rljob.agent")


@dataclass
class OpenWindow:
    version: str
    source: RefitSource
    deadline: float  # event-loop time
    pushes: int = 0
    final_pushed: bool = False
    versioned_by_agent: bool = False  # closed without a final push: the agent sets the version itself
    error: str | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    group: GroupState | None = None
    group_error: str | None = None
    group_task: asyncio.Task[None] | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


# torch's default_pg_timeout (30 min), which an engine's side of the rendezvous waits, plus a margin: the
# agent must hear the engine's own answer, not give up first and lose track of its scheduler.
GROUP_INIT_TIMEOUT_S = 1800.0 + 60.0


class RefitWindows:
    def __init__(
        self, store: StateStore, engine: Engine, group_timeout_s: float = GROUP_INIT_TIMEOUT_S
    ) -> None:
        self._store = store
        self._engine = engine
        self._group_timeout_s = group_timeout_s
        self.current: OpenWindow | None = None
        self.groups: set[str] = set()  # weight-update groups the engine formed through this agent

    # --- agent side (the refit command) ----------------------------------------------------------

    def open(self, version: str, source: RefitSource, seconds: float) -> OpenWindow:
        loop = asyncio.get_running_loop()
        self.current = OpenWindow(version, source, loop.time() + seconds)
        with self._store.change() as s:
            s.trainer.refit_window_version = version
            s.trainer.weights_group = None
        return self.current

    async def wait_closed(self, window: OpenWindow) -> None:
        """Until the trainer closed the window and no push or group init is in flight (TimeoutError at
        the deadline)."""
        async with asyncio.timeout(window.remaining()):
            await window.closed.wait()
            async with window.lock:
                pass

    def shut(self, window: OpenWindow) -> None:
        window.closed.set()
        if self.current is window:
            self.current = None
            with self._store.change() as s:
                s.trainer.refit_window_version = None

    # --- trainer side ----------------------------------------------------------------------------

    def view(self) -> RefitWindow:
        w = self.current
        if w is None:
            return RefitWindow(open=False)
        return RefitWindow(
            open=not w.closed.is_set(),
            version=w.version,
            source=w.source,
            pushes=w.pushes,
            group=w.group,
            group_error=w.group_error,
            architectures=self._store.architectures[:8] or None,
            engine=self._engine.kind,
        )

    def _usable(self, source: RefitSource | None) -> OpenWindow:
        w = self.current
        if w is None or w.closed.is_set():
            raise conflict("NoRefitWindow", "no refit window is open")
        if source is not None and w.source != source:
            raise conflict("WrongSource", f"the open window takes {w.source.value} pushes")
        if w.error is not None:
            raise conflict("RefitWindowFailed", w.error)
        if w.final_pushed:
            raise conflict("FinalPushDone", "the final push (carrying the version) was already forwarded")
        if w.group == GroupState.PENDING:
            raise conflict("Busy", "the weights group is still waiting for the trainer to join it")
        return w

    async def _forward(self, w: OpenWindow, last: bool, call: Any) -> PushResult:
        async with w.lock:
            if w.error is not None:
                raise conflict("RefitWindowFailed", w.error)
            try:
                message = await call(w.version if last else None, max(0.1, w.remaining()))
            except EngineError as e:
                w.error = e.message
                raise Refused(502, "EngineRefused", e.message) from e
            except EngineUnreachable as e:
                w.error = str(e)
                raise Refused(502, "EngineUnreachable", str(e)) from e
            except TimeoutError as e:
                w.error = f"{self._engine.name} did not answer the push before the refit deadline"
                raise Refused(504, "EngineTimeout", w.error) from e
            w.pushes += 1
            w.final_pushed = last
            return PushResult(pushes=w.pushes, message=message)

    async def push_tensor(self, push: TensorPush) -> PushResult:
        w = self._usable(RefitSource.TENSOR)
        started = time.perf_counter()
        size = self._engine.guards.tensor_push(push, self._store.facts)
        checked = time.perf_counter()

        async def call(version: str | None, timeout: float) -> str:
            return await self._engine.push_tensors(push, version, timeout)

        result = await self._forward(w, push.last, call)
        # Where a push's time goes on the agent's side: its checks, then the engine's call (HTTP included).
        done = time.perf_counter()
        timing: dict[str, Any] = {"push": result.pushes, "last": push.last, "bytes": size}
        timing |= {"check_s": round(checked - started, 6), "engine_s": round(done - checked, 6)}
        log.info("tensor push timing %s", json.dumps(timing))
        return result

    async def push_distributed(self, push: DistributedPush) -> PushResult:
        w = self._usable(RefitSource.DISTRIBUTED)
        if not (len(push.names) == len(push.dtypes) == len(push.shapes)):
            raise Refused(422, "InvalidPush", "names, dtypes and shapes must have the same length")
        self._engine.guards.distributed_push(push, self.groups, self._store.facts)

        async def call(version: str | None, timeout: float) -> str:
            return await self._engine.push_distributed(push, version, timeout)

        return await self._forward(w, push.last, call)

    def init_group(self, body: InitWeightsGroup) -> RefitWindow:
        """Start the engine's side of the weights group in the background and answer at once: the call
        blocks until every rank has joined the trainer's rendezvous, so the trainer must be free to run its
        own init_process_group meanwhile. While it is pending, pushes and commands are refused Busy."""
        w = self._usable(RefitSource.DISTRIBUTED)
        self._engine.guards.weights_group(self._store.facts)
        w.group, w.group_error = GroupState.PENDING, None
        with self._store.change() as s:
            s.trainer.weights_group = GroupState.PENDING
        w.group_task = asyncio.create_task(self._run_group(w, body), name="join-weights-group")
        return self.view()

    async def _run_group(self, w: OpenWindow, body: InitWeightsGroup) -> None:
        async with w.lock:  # wait_closed waits for this too: the window does not close while it blocks
            try:
                await self._engine.join_weights_group(body, timeout=self._group_timeout_s)
                w.group = GroupState.READY
                self.groups.add(body.group_name)
            except EngineError as e:
                w.group, w.group_error = GroupState.FAILED, e.message
            except EngineUnreachable as e:
                w.group, w.group_error = GroupState.FAILED, str(e)
            except TimeoutError:
                w.group = GroupState.FAILED
                w.group_error = (
                    f"{self._engine.name} did not join the weights group in {self._group_timeout_s:g}s"
                )
            except asyncio.CancelledError:
                w.group, w.group_error = GroupState.FAILED, "the agent stopped"
                raise
            finally:
                with self._store.change() as s:
                    s.trainer.weights_group = w.group

    def trainer_close(
        self, error: str | None, versioned_by_agent: bool = False, digest: WeightsDigest | None = None
    ) -> RefitWindow:
        """`versioned_by_agent`: the pushes carried no version (a framework's, through its endpoint); the
        refit sets it once the window is closed. `digest`: the pushes' (the refit holds the engine to it)."""
        w = self.current
        if w is None or w.closed.is_set():
            raise conflict("NoRefitWindow", "no refit window is open")
        why = (
            "the framework pushed through the agent's framework endpoint, which carries no digest"
            if versioned_by_agent
            else "the trainer gave no digest when it closed the refit window (RefitClose.digest)"
        )
        self._store.trainer_digest = (w.version, digest, why)
        if error:
            w.error = f"trainer: {error}"
        w.versioned_by_agent = versioned_by_agent and w.pushes > 0
        w.closed.set()
        # Reported before the trainer hears back: a trainer that exits right after closing its window
        # finished (lifecycle/finishing.py), one that exits with it open leaves a refit that cannot end.
        with self._store.change() as s:
            s.trainer.refit_window_version = None
        return self.view()
