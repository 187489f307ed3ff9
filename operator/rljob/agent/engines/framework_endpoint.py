"""What every engine's framework endpoint shares (Engine.framework_endpoint): the session's waits on the
agent's state, the published version a restarted agent reads back from its record, refusals kept for the
operator, and the pass-through to the engine. Each engine's endpoint (agent/engines/<name>/endpoint.py) adds
the routes it answers itself, their replies and its error shapes."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import aiohttp
from aiohttp import web

from rljob.agent.engines.transport import EngineHTTP
from rljob.api.agent import CommandState, Stage
from rljob.api.spec import RefitSource

if TYPE_CHECKING:  # the core modules the endpoint is handed, not imported (they import the registry)
    from rljob.agent.lease import LeaseDesk
    from rljob.agent.refit_window import RefitWindows
    from rljob.agent.state import StateStore

WAIT_SLICE_S = 30.0  # a wait on the gang re-checks the agent's stage at least this often
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive"})
C = TypeVar("C", bound=EngineHTTP[Any])


class Refusal(Exception):
    """A call the endpoint refuses: `body` in the engine's error shape for the route."""

    def __init__(self, status: int, body: Any, message: str | None = None) -> None:
        super().__init__(str(body) if message is None else message)
        self.status, self.body = status, body


def published_in_lease(store: StateStore) -> str | None:
    """The version the trainer published under the lease it was last granted, once it gave that lease back:
    what the endpoint answers a push, load or resume of that lease with. Read from the recorded state, so
    that a restarted agent answers the same call sent again as the first would have been answered."""
    t = store.state.trainer
    if t.lease_held or store.lease_epoch is None or t.published_epoch != store.lease_epoch:
        return None
    return t.published_version


def next_version(served: str | None) -> str:
    """The version a push that names none publishes: the served one plus one."""
    return str(int(served) + 1) if served is not None and served.isdigit() else "1"


class FrameworkSession(Generic[C]):
    """One pod's framework session: the version it published in the current lease, if any."""

    # Routes a framework must not reach the engine with, and why: each would bypass the gang's lock-step.
    not_through: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        store: StateStore,
        lease: LeaseDesk,
        windows: RefitWindows,
        client: C,
        refit_source: RefitSource | None = None,
    ) -> None:
        self.store = store
        self.lease = lease
        self.windows = windows
        self.client = client  # the agent's: its version (quirks) and the calls that pass through
        self.refit_source = refit_source  # the RLJob's spec.refit.source, when the operator passed it
        self.published: str | None = published_in_lease(store)  # a restarted agent: the record's

    def refusal(self, status: int, message: str) -> Refusal:
        """A refusal of `message` in the engine's error shape for the routes it does not answer itself."""
        raise NotImplementedError

    def refused(self, request: web.Request, refusal: Refusal) -> None:
        """What the endpoint refused, for the operator (TrainerReport.last_refusal)."""
        self.lease.refused(f"{request.method} {request.path}: {refusal}")

    # --- waits ---------------------------------------------------------------------------------------

    async def _until(self, done: Callable[[], bool], failed: Callable[[], str | None]) -> str | None:
        """Wait until `done()`; the reason when `failed()` says one first (never a hopeless wait: the
        agent's Failed stage ends every wait, and the operator's phase deadlines end the gang's)."""
        while True:
            why = self._failed() or failed()
            if why is not None:
                return why
            if done():
                return None
            await self.store.wait_until(lambda: done() or bool(self._failed() or failed()), WAIT_SLICE_S)

    def _failed(self) -> str | None:
        st = self.store.state
        if st.stage == Stage.FAILED:
            return f"the pod's agent failed ({st.fatal or 'Failed'}): the pod must be replaced"
        return None

    async def _settled(self, refusal: Callable[[str], Exception]) -> None:
        """A handoff call that reaches a restarted agent while it checks its record waits for the verdict,
        then is answered from the recovered state; a pod the recovery gave up refuses it."""
        why = await self._until(lambda: not self.store.recovering, lambda: None)
        if why is not None:
            raise refusal(why)

    def _command_failed(self, *actions: str) -> Callable[[], str | None]:
        """Why the agent's last command failed, where it is one of `actions`."""

        def failed() -> str | None:
            cmd = self.store.state.last_command
            if cmd is not None and cmd.action.value in actions and cmd.state == CommandState.FAILED:
                return f"the {cmd.action.value} failed: {cmd.error}"
            return None

        return failed

    async def _until_lease_held(self) -> str | None:
        return await self._until(lambda: self.store.state.trainer.lease_held, lambda: None)

    async def _until_window_open(self, version: str, what: str) -> str | None:
        """Until the refit window of `version` is open for the trainer's pushes (a `what`)."""
        return await self._until(
            lambda: (w := self.windows.view()).open and w.version == version,
            lambda: self._command_failed("refit")() or self._served_already(version, what),
        )

    def _close_window(self, version: str) -> None:
        """The trainer's pushes of `version` are done: its window closes, the agent labels the weights."""
        window = self.windows.view()
        if window.open and window.version == version:
            self.windows.trainer_close(None, versioned_by_agent=True)

    async def _until_refitted(self, version: str) -> str | None:
        """Until this pod refitted `version` (or serves it already)."""
        return await self._until(
            lambda: (
                self.store.state.engine.served_version == version
                and self.store.state.stage in (Stage.REFITTED, Stage.SERVING)
            ),
            self._command_failed("refit"),
        )

    async def _until_serving(self, version: str) -> str | None:
        """Until this pod serves `version` again after its refit and resume."""
        return await self._until(
            lambda: (
                self.store.state.stage == Stage.SERVING and self.store.state.engine.served_version == version
            ),
            self._command_failed("refit", "resume"),
        )

    def _served_already(self, version: str, what: str) -> str | None:
        """A `what` for weights the pod already serves: their refit window closed, none will open again."""
        st = self.store.state
        if st.stage == Stage.SERVING and st.engine.served_version == version:
            return f"weights {version} are refitted and served: this {what} came after their refit window"
        return None

    def _serving_freely(self) -> bool:
        """The pod serves and the trainer holds no lease: a framework's call is the engine's to answer."""
        return self.store.state.stage == Stage.SERVING and not self.store.state.trainer.lease_held

    # --- everything else: the engine's ---------------------------------------------------------------

    async def refuse_passing(self, request: web.Request) -> None:
        """An engine's own refusal of a call it would otherwise pass through."""

    async def pass_through(self, request: web.Request) -> web.StreamResponse:
        refused = self.not_through.get(request.path)
        if refused is not None:
            raise self.refusal(400, f"{request.path} is not taken through the RLJob endpoint: {refused}")
        await self.refuse_passing(request)
        if self.store.state.stage in (Stage.STARTING, Stage.READY):
            # Not yet serving what the operator verified: held, as a launching engine holds its clients.
            why = await self._until(lambda: self.store.state.stage == Stage.SERVING, lambda: None)
            if why is not None:
                raise self.refusal(503, why)
        try:
            return await self._forward(request)
        except aiohttp.ClientError as e:
            raise self.refusal(502, f"{self.client.name} did not answer: {e}") from e

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        body = await request.read()
        async with self.client.forward(request.method, str(request.rel_url), headers, body) as upstream:
            reply = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS:
                    reply.headers[key] = value
            await reply.prepare(request)
            async for chunk in upstream.content.iter_any():
                await reply.write(chunk)
            await reply.write_eof()
            return reply


def framework_app(session: FrameworkSession[Any]) -> web.Application:
    """The endpoint's application, its routes still to add: a refusal becomes its status and body."""

    @web.middleware
    async def refusals(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)  # type: ignore[no-any-return]
        except Refusal as e:
            session.refused(request, e)
            return web.Response(status=e.status, text=json.dumps(e.body), content_type="application/json")

    return web.Application(middlewares=[refusals], client_max_size=256 << 20)
