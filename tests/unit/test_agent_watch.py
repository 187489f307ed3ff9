"""The operator's AgentWatch (controller/agent_client.py) over a real agent operator app: it follows the
stream (`watch=true`) state by state, asks again when a stream ends, starts over on another boot, and
also works with an agent that answers one state per request (one that does not stream)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from aiohttp.test_utils import TestServer

from rljob.agent.metrics import AgentMetrics
from rljob.agent.operator_api import build_operator_app
from rljob.agent.state import StateStore
from rljob.api.agent import AgentState, Stage
from rljob.controller import agent_client
from rljob.controller.agent_client import AgentClient, AgentEndpoint, AgentWatch

TOKEN = "t0ken"


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _follows(app: web.Application, store: StateStore, requests: list[str], streams: bool) -> None:
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
            await asyncio.sleep(1.2)  # past a stream's end (wait is 0.5 s here): it asks again
            if streams:  # (a long-poll that times out answers the current state, sample and all)
                assert watch.latest is not None and watch.latest.revision == store.state.revision - 1
                assert len(wakes) == 3  # Starting, Ready, Serving
            # A restarted agent: revisions start again under a new boot id, and count again.
            store.state = AgentState(revision=1, boot_id="another-boot", stage=Stage.STARTING)
            store.commit()
            await until(lambda: watch.latest is not None and watch.latest.boot_id == "another-boot")
            assert watch.latest is not None and watch.latest.revision == 2
        finally:
            await watch.close()
    assert len(requests) >= 3  # the stream was asked for again after it ended


def _app(store: StateStore, requests: list[str], streams: bool = True) -> web.Application:
    app = build_operator_app(store, None, AgentMetrics(), TOKEN)  # type: ignore[arg-type]

    @web.middleware
    async def count(request: web.Request, handler: web.RequestHandler) -> web.StreamResponse:
        if request.path == "/v1/state":
            requests.append(request.query_string)
            if not streams:  # an agent from before the stream: the query parameter is unknown to it
                query = request.rel_url.query.copy()
                query.pop("watch", None)
                request = request.clone(rel_url=request.rel_url.with_query(query))
        return await handler(request)

    app.middlewares.insert(0, count)
    return app


def test_the_watch_follows_the_stream() -> None:
    agent_client.LONG_POLL_SECONDS = 0.5  # streams end quickly: the watch must ask again
    try:
        store, requests = StateStore(), []
        store.commit()
        asyncio.run(_follows(_app(store, requests), store, requests, streams=True))
        assert all("watch=true" in q for q in requests)
    finally:
        agent_client.LONG_POLL_SECONDS = 10.0


def test_the_watch_works_with_an_agent_that_answers_one_state_a_request() -> None:
    agent_client.LONG_POLL_SECONDS = 0.5
    try:
        store, requests = StateStore(), []
        store.commit()
        asyncio.run(_follows(_app(store, requests, streams=False), store, requests, streams=False))
    finally:
        agent_client.LONG_POLL_SECONDS = 10.0
