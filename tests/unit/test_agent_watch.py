"""The operator's AgentWatch (controller/agent_client.py) over a real agent operator app: it follows the
agent's channel (`GET /v1/channel`, a WebSocket) state by state and sends commands on it, answered as
POST /v1/commands answers them; it starts over on another boot. While the channel is not open commands
are POSTed; the channel is the only report transport (no state stream, no long-poll)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from rljob.agent.commands import CommandDesk
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.metrics import AgentMetrics
from rljob.agent.operator_api import build_operator_app
from rljob.agent.state import StateStore
from rljob.api.agent import (
    AgentState,
    ChannelFrame,
    Command,
    CommandState,
    DrainCommand,
    GrantCommand,
    Stage,
)
from rljob.controller import agent_client
from rljob.controller.agent_client import AgentClient, AgentEndpoint, AgentWatch

TOKEN = "t0ken"


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _follows(app: web.Application, store: StateStore) -> None:
    async with TestServer(app) as server, AgentClient(TOKEN) as client:
        wakes = []
        endpoint = AgentEndpoint("p-0", "uid", str(server.host), int(server.port or 0))
        watch = AgentWatch(client, endpoint, lambda: wakes.append(1))
        try:
            await until(lambda: watch.latest is not None)
            for stage in (Stage.READY, Stage.SERVING):
                with store.change() as s:
                    s.stage = stage
                await until(lambda: watch.latest is not None and watch.latest.stage == stage)  # noqa: B023
            with store.change() as s:
                s.rollout.samples = 3  # not for the operator: no report
            await asyncio.sleep(0.5)
            assert watch.latest is not None and watch.latest.revision == store.state.revision - 1
            assert len(wakes) == 3  # Starting, Ready, Serving
            # A restarted agent: revisions start again under a new boot id, and count again.
            store.state = AgentState(revision=1, boot_id="another-boot", stage=Stage.STARTING)
            store.commit()
            await until(lambda: watch.latest is not None and watch.latest.boot_id == "another-boot")
            assert watch.latest is not None and watch.latest.revision == 2
        finally:
            await watch.close()


class _Operations:
    """Every command allowed, and it runs until `finish` is set: the guards and the work are
    agent/actions.py's, tested in test_agent_transitions.py and tests/agent."""

    def __init__(self) -> None:
        self.finish = asyncio.Event()

    def check(self, cmd: Command, state: AgentState, facts: SGLangFacts | None) -> None:
        return None

    async def execute(self, cmd: Command) -> None:
        await self.finish.wait()


async def _no_death(cause: str) -> None:
    return None


def _desk(store: StateStore, operations: _Operations) -> CommandDesk:
    return CommandDesk(store, operations, AgentMetrics(), _no_death)


def _app(store: StateStore, requests: list[str], channel: bool = True, desk: Any = None) -> web.Application:
    app = build_operator_app(store, desk, AgentMetrics(), TOKEN)

    @web.middleware
    async def count(request: web.Request, handler: web.RequestHandler) -> web.StreamResponse:
        requests.append(f"{request.method} {request.path} {request.query_string}")
        if request.path == "/v1/channel" and not channel:  # the channel does not open
            raise web.HTTPServiceUnavailable()
        return await handler(request)

    app.middlewares.insert(0, count)
    return app


def test_the_watch_follows_the_channel() -> None:
    store, requests = StateStore(), []
    store.commit()
    asyncio.run(_follows(_app(store, requests), store))
    assert requests and all(r.startswith("GET /v1/channel") for r in requests)  # no long-poll, no stream


def test_the_agents_state_read_is_the_current_state_at_once() -> None:
    async def run() -> tuple[int, dict[str, Any], float]:
        store = StateStore()
        store.commit()
        app = build_operator_app(store, None, AgentMetrics(), TOKEN)  # type: ignore[arg-type]
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            url = f"http://{server.host}:{server.port}/v1/state"
            began = asyncio.get_running_loop().time()
            params = {"since": str(store.state.revision), "wait": "5", "watch": "true"}  # no longer read
            async with session.get(url, params=params, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                return r.status, await r.json(), asyncio.get_running_loop().time() - began

    status, body, seconds = asyncio.run(run())
    assert status == 200 and body["revision"] == 1 and seconds < 2


async def _commands(channel: bool) -> tuple[list[str], list[agent_client.CommandOutcome]]:
    store, requests, operations = StateStore(), [], _Operations()
    store.commit()
    app = _app(store, requests, channel=channel, desk=_desk(store, operations))
    async with TestServer(app) as server, AgentClient(TOKEN) as client:
        endpoint = AgentEndpoint("p-0", "uid", str(server.host), int(server.port or 0))
        watch = AgentWatch(client, endpoint, lambda: None)
        try:
            seen = store if not channel else None  # without the channel the watch sees no state
            await until(lambda: watch.latest is not None or seen is not None)
            outcomes = [await watch.send(DrainCommand(epoch=3))]
            outcomes.append(await watch.send(DrainCommand(epoch=3)))  # the same again: a no-op
            outcomes.append(await watch.send(GrantCommand(epoch=3)))  # another action, the same epoch
            outcomes.append(await watch.send(GrantCommand(epoch=4)))  # while the drain runs
            operations.finish.set()

            def succeeded() -> bool:
                latest = watch.latest if seen is None else seen.state
                last = latest.last_command if latest is not None else None
                return last is not None and last.state == CommandState.SUCCEEDED

            await until(succeeded)
            outcomes.append(await watch.send(DrainCommand(epoch=2)))  # older than the last accepted
        finally:
            await watch.close()
    return requests, outcomes


def _check_outcomes(outcomes: list[agent_client.CommandOutcome]) -> None:
    assert [o.accepted for o in outcomes] == [True, True, False, False, False]
    refusals = [o.refusal or "" for o in outcomes[2:]]
    assert refusals[0].startswith("HTTP 409: epoch 3 was already used for drain"), refusals
    assert refusals[1].startswith("HTTP 409: drain (epoch 3) is still running"), refusals
    assert refusals[2].startswith("HTTP 409: epoch 2 is older than the last accepted epoch 3"), refusals


def test_commands_go_over_the_channel_and_are_answered_as_a_post_is() -> None:
    requests, outcomes = asyncio.run(_commands(channel=True))
    _check_outcomes(outcomes)
    assert not [r for r in requests if r.startswith("POST")]


def test_commands_while_the_channel_does_not_open_are_posted() -> None:
    requests, outcomes = asyncio.run(_commands(channel=False))
    _check_outcomes(outcomes)
    assert len([r for r in requests if r.startswith("POST /v1/commands")]) == 5


def test_a_malformed_command_frame_is_refused_with_the_field_and_names_its_command() -> None:
    async def run() -> list[dict[str, Any]]:
        store = StateStore()
        store.commit()
        app = build_operator_app(store, _desk(store, _Operations()), AgentMetrics(), TOKEN)
        async with TestServer(app) as server, aiohttp.ClientSession() as session:
            url = f"http://{server.host}:{server.port}/v1/channel"
            unauthorized = await session.get(url)
            assert unauthorized.status == 401
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with session.ws_connect(url, headers=headers) as ws:
                first = await ws.receive_json()
                assert first["state"]["revision"] == store.state.revision
                await ws.send_str('{"action": "drain", "epoch": 5, "timeoutSeconds": -1}')
                await ws.send_str("not json")
                return [await ws.receive_json(), await ws.receive_json()]

    bad_field, not_json = asyncio.run(run())
    assert bad_field["reply"]["epoch"] == 5 and bad_field["reply"]["action"] == "drain"
    assert bad_field["reply"]["status"] == 422
    assert "body.drain.timeoutSeconds" in bad_field["reply"]["refusal"]["reason"], bad_field
    assert not_json["reply"]["status"] == 400 and "epoch" not in not_json["reply"]


def test_a_command_on_a_channel_that_closes_is_unreachable_at_once() -> None:
    async def run() -> agent_client.CommandOutcome:
        async def closes_on_a_command(request: web.Request) -> web.WebSocketResponse:
            ws = web.WebSocketResponse()
            await ws.prepare(request)
            state = AgentState(revision=1, boot_id="b", stage=Stage.SERVING)
            await ws.send_str(ChannelFrame(state=state).model_dump_json(by_alias=True))
            await ws.receive()
            await ws.close()
            return ws

        app = web.Application()
        app.router.add_get("/v1/channel", closes_on_a_command)
        async with TestServer(app) as server, AgentClient(TOKEN) as client:
            endpoint = AgentEndpoint("p-0", "uid", str(server.host), int(server.port or 0))
            watch = AgentWatch(client, endpoint, lambda: None)
            try:
                await until(lambda: watch.latest is not None)
                return await asyncio.wait_for(watch.send(DrainCommand(epoch=1)), 5)
            finally:
                await watch.close()

    outcome = asyncio.run(run())
    assert not outcome.accepted and (outcome.refusal or "").startswith("unreachable"), outcome
