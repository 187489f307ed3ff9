"""Operator-facing API on the pod IP, behind the bearer token: the channel (the operator's one report
transport, and its commands), POST /v1/commands while the channel is not open, and a plain read of the
state for people. /healthz, /metrics, /openapi.json and the probes are open (they carry no token)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import weakref
from collections.abc import Awaitable, Callable

from aiohttp import WSMsgType, web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rljob.agent.commands import CommandDesk
from rljob.agent.errors import Refused
from rljob.agent.http_util import (
    MAX_WAIT_S,
    Handler,
    make_error_middleware,
    parse_body,
    query_number,
    read_body,
    refusal,
    reply,
)
from rljob.agent.metrics import AgentMetrics
from rljob.agent.openapi import build_document
from rljob.agent.state import StateStore
from rljob.api.agent import (
    COMMAND_ADAPTER,
    Action,
    AgentHealth,
    ChannelFrame,
    CommandReply,
    CommandState,
    Stage,
)

# /probe/engine is the engine container's liveness probe: the engine binds 127.0.0.1, which the kubelet
# can't reach, so the kubelet asks the agent, which asks the engine's liveness route (Engine.liveness: any
# answer, paused included).
# /probe/gang is the agent's startupProbe: the kubelet starts the pod's engine and trainer only after it
# passes (a native sidecar's startupProbe, docs/control-plane.md "Gangs that do not fit").
OPEN_PATHS = frozenset({"/healthz", "/metrics", "/openapi.json", "/probe/engine", "/probe/gang"})
MAX_FRAME_BYTES = 2**20  # a command frame is < 1 KiB; a bigger one is not the operator's
# A channel silent this long is pinged, and closed when no pong comes within half of it again: an
# operator whose node went away without closing its connections leaves no handler behind.
CHANNEL_HEARTBEAT_S = 30.0


class OperatorContact:
    """Whether the operator has reached this agent since it booted. The operator watches a gang's agents
    only once the scheduler placed every member, so until then the pod's GPU containers wait."""

    def __init__(self) -> None:
        self.reached = False


def _auth_middleware(token: str, contact: OperatorContact) -> Middleware:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            presented = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(presented, expected):  # constant time
                raise Refused(401, "Unauthorized", "missing or wrong bearer token")
            contact.reached = True
        return await handler(request)

    return auth


def build_operator_app(
    store: StateStore,
    desk: CommandDesk,
    metrics: AgentMetrics,
    token: str,
    engine_liveness: Callable[[], Awaitable[int]] | None = None,
) -> web.Application:
    document = build_document()
    contact = OperatorContact()

    async def get_state(request: web.Request) -> web.Response:
        """The current state, for people and probes: the operator follows the channel instead."""
        return reply(store.state)

    open_channels: weakref.WeakSet[web.WebSocketResponse] = weakref.WeakSet()

    async def channel(request: web.Request) -> web.StreamResponse:
        """`GET /v1/channel`, a WebSocket (api/agent.py ChannelFrame): the states the operator acts on
        (agent/reports.py) newer than `since` of `boot`, as they commit, and an answer to each Command
        frame, the one POST /v1/commands gives."""
        since = int(query_number(request, "since", -1, lo=-1, hi=2**53))
        if request.query.get("boot") not in (None, store.state.boot_id):
            since = -1  # a restarted agent: its revisions started again
        ws = web.WebSocketResponse(max_msg_size=MAX_FRAME_BYTES, heartbeat=CHANNEL_HEARTBEAT_S)
        if not ws.can_prepare(request).ok:
            raise Refused(400, "NotAWebSocket", "/v1/channel upgrades to a WebSocket (Upgrade: websocket)")
        await ws.prepare(request)
        open_channels.add(ws)
        states = asyncio.create_task(send_states(ws, since), name="channel-states")
        try:
            async for msg in ws:
                if msg.type == WSMsgType.TEXT:
                    await ws.send_str(answer(msg.data))
                elif msg.type == WSMsgType.BINARY:
                    await ws.send_str(answer(None))
        except ConnectionResetError:  # the operator went away mid-answer
            pass
        finally:
            states.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionResetError):
                await states
        return ws

    async def send_states(ws: web.WebSocketResponse, since: int) -> None:
        boot = store.state.boot_id

        def news() -> bool:  # another boot's revisions start again
            return since < 0 or store.operator_reports.revision > since or store.state.boot_id != boot

        while not ws.closed:
            if news():
                state = store.state
                # The frame {"state": ...} written around the state's JSON: no copy of the state.
                line = state.model_dump_json(by_alias=True, exclude_none=True)
                await ws.send_str('{"state":' + line + "}")
                since, boot = state.revision, state.boot_id
            await store.wait_until(news, MAX_WAIT_S)

    def answer(data: str | None) -> str:
        cmd = None
        try:
            if data is None:
                raise Refused(400, "InvalidJSON", "a command frame is JSON text, not binary")
            cmd = parse_body(data, COMMAND_ADAPTER)
            status, body = desk.submit(cmd)
            answered = CommandReply(epoch=cmd.epoch, action=cmd.action, status=status, command=body)
        except Refused as e:
            epoch, action = (cmd.epoch, cmd.action) if cmd is not None else _names(data)
            why = refusal(e, metrics, "channel command")
            answered = CommandReply(epoch=epoch, action=action, status=e.status, refusal=why)
        return ChannelFrame(reply=answered).model_dump_json(by_alias=True, exclude_none=True)

    async def close_channels(app: web.Application) -> None:
        # A channel stays open for the pod's life: the server's shutdown would wait for it otherwise.
        for ws in list(open_channels):
            await ws.close(code=1001, message=b"agent shutting down")

    async def post_command(request: web.Request) -> web.Response:
        wait = query_number(request, "wait", 0, lo=0, hi=MAX_WAIT_S)
        cmd = await read_body(request, COMMAND_ADAPTER)
        status, body = desk.submit(cmd)
        if wait > 0 and body.state == CommandState.RUNNING:
            done = await desk.wait(cmd.epoch, wait)
            if done is not None:
                body = done
                status = 202 if done.state == CommandState.RUNNING else 200
        return reply(body, status)

    async def healthz(request: web.Request) -> web.Response:
        st = store.state
        return reply(AgentHealth(ok=st.stage != Stage.FAILED, stage=st.stage, boot_id=st.boot_id))

    async def probe_engine(request: web.Request) -> web.Response:
        try:
            code = await engine_liveness() if engine_liveness is not None else 503
        except Exception:  # any failure to reach the engine is a failed probe, never a 500
            code = 503
        return web.Response(status=200 if code == 200 else 503, text="ok" if code == 200 else "unavailable")

    async def probe_gang(request: web.Request) -> web.Response:
        if contact.reached:
            return web.Response(text="the operator watches this agent: its gang is placed")
        waiting = "waiting for the operator: it watches a gang once all of it is placed"
        return web.Response(status=503, text=waiting)

    async def metrics_route(request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest(metrics.registry))
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(document)

    app = web.Application(middlewares=[make_error_middleware(metrics), _auth_middleware(token, contact)])
    app.on_shutdown.append(close_channels)
    app.router.add_get("/v1/state", get_state)
    app.router.add_get("/v1/channel", channel)
    app.router.add_post("/v1/commands", post_command)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/probe/engine", probe_engine)
    app.router.add_get("/probe/gang", probe_gang)
    return app


def _names(data: str | None) -> tuple[int | None, Action | None]:
    """The epoch and action a command frame names, even one the models refuse: so the reply finds the
    command it answers."""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        raw = json.loads(data or "")
        epoch = raw.get("epoch")
        action = raw.get("action")
        return (
            epoch if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch >= 0 else None,
            Action(action) if action in {a.value for a in Action} else None,
        )
    return None, None
