"""The tensor/distributed refit window: opened by the refit command, used by the trainer to push weights
through the agent (which adds flush_cache=false and puts weight_version on the final push), closed by the
trainer. Pushes are forwarded one at a time, in arrival order."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rljob.agent.errors import Refused, conflict
from rljob.agent.sglang_client import SGLangClient, SGLangError, SGLangUnreachable
from rljob.agent.state import StateStore
from rljob.api.agent import DistributedPush, InitWeightsGroup, PushResult, RefitWindow, TensorPush
from rljob.api.spec import RefitSource


@dataclass
class OpenWindow:
    version: str
    source: RefitSource
    deadline: float  # event-loop time
    pushes: int = 0
    final_pushed: bool = False
    error: str | None = None
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def remaining(self) -> float:
        return max(0.0, self.deadline - asyncio.get_running_loop().time())


class RefitWindows:
    def __init__(self, store: StateStore, client: SGLangClient) -> None:
        self._store = store
        self._client = client
        self.current: OpenWindow | None = None

    # --- agent side (the refit command) ----------------------------------------------------------

    def open(self, version: str, source: RefitSource, seconds: float) -> OpenWindow:
        loop = asyncio.get_running_loop()
        self.current = OpenWindow(version, source, loop.time() + seconds)
        with self._store.change() as s:
            s.trainer.refit_window_version = version
        return self.current

    async def wait_closed(self, window: OpenWindow) -> None:
        """Until the trainer closed the window and no push is in flight (TimeoutError at the deadline)."""
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
        return RefitWindow(open=not w.closed.is_set(), version=w.version, source=w.source, pushes=w.pushes)

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
        return w

    async def _forward(self, w: OpenWindow, last: bool, call: Any) -> PushResult:
        async with w.lock:
            if w.error is not None:
                raise conflict("RefitWindowFailed", w.error)
            try:
                message = await call(w.version if last else None, max(0.1, w.remaining()))
            except SGLangError as e:
                w.error = e.message
                raise Refused(502, "SGLangRefused", e.message) from e
            except SGLangUnreachable as e:
                w.error = str(e)
                raise Refused(502, "SGLangUnreachable", str(e)) from e
            except TimeoutError as e:
                w.error = "SGLang did not answer the push before the refit deadline"
                raise Refused(504, "SGLangTimeout", w.error) from e
            w.pushes += 1
            w.final_pushed = last
            return PushResult(pushes=w.pushes, message=message)

    async def push_tensor(self, push: TensorPush) -> PushResult:
        w = self._usable(RefitSource.TENSOR)

        async def call(version: str | None, timeout: float) -> str:
            return await self._client.update_weights_from_tensor(
                push.serialized_named_tensors, push.load_format, version, timeout=timeout
            )

        return await self._forward(w, push.last, call)

    async def push_distributed(self, push: DistributedPush) -> PushResult:
        w = self._usable(RefitSource.DISTRIBUTED)
        if not (len(push.names) == len(push.dtypes) == len(push.shapes)):
            raise Refused(422, "InvalidPush", "names, dtypes and shapes must have the same length")

        async def call(version: str | None, timeout: float) -> str:
            return await self._client.update_weights_from_distributed(
                push.names, push.dtypes, push.shapes, push.group_name, version, timeout=timeout
            )

        return await self._forward(w, push.last, call)

    async def init_group(self, body: InitWeightsGroup) -> PushResult:
        w = self._usable(RefitSource.DISTRIBUTED)
        async with w.lock:
            try:
                message = await self._client.init_weights_update_group(
                    body.model_dump(), timeout=max(0.1, w.remaining())
                )
            except SGLangError as e:
                raise Refused(502, "SGLangRefused", e.message) from e
            except SGLangUnreachable as e:
                raise Refused(502, "SGLangUnreachable", str(e)) from e
        return PushResult(pushes=w.pushes, message=message)

    def trainer_close(self, error: str | None) -> RefitWindow:
        w = self.current
        if w is None or w.closed.is_set():
            raise conflict("NoRefitWindow", "no refit window is open")
        if error:
            w.error = f"trainer: {error}"
        w.closed.set()
        return self.view()
