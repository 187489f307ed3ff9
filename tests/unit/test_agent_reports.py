"""`GET /v1/state?changes=operator` answers on the revisions the operator acts on (agent/reports.py):
a finished command, a stage reached outside a command, the trainer's report, a failure; not rollout
samples, not a command's acceptance or its steps. Without `changes` every revision answers, as before;
`boot` from another boot answers at once. The trainer's `GET /v1/trainer/state?stage=` answers in that stage
(or Failed) only."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from rljob.agent.lease import LeaseDesk
from rljob.agent.metrics import AgentMetrics
from rljob.agent.operator_api import build_operator_app
from rljob.agent.reports import acted_on, operator_view
from rljob.agent.state import StateStore
from rljob.agent.trainer_api import build_trainer_app
from rljob.api.agent import Action, AgentState, CommandState, CommandStatus, PublishRequest, Stage

TOKEN = "t0ken"


def serving() -> AgentState:
    done = CommandStatus(epoch=4, action=Action.RESUME, state=CommandState.SUCCEEDED)
    return AgentState(revision=1, boot_id="b", stage=Stage.SERVING, epoch=4, last_command=done)


def changed(state: AgentState, edit: Any) -> bool:
    before = operator_view(state)
    after = state.model_copy(deep=True)
    edit(after)
    return acted_on(before, operator_view(after))


def accept(s: AgentState) -> None:
    s.epoch = 5
    s.last_command = CommandStatus(epoch=5, action=Action.DRAIN, state=CommandState.RUNNING)


def test_what_the_operator_acts_on() -> None:
    st = serving()
    assert not changed(st, lambda s: setattr(s.rollout, "samples", 3))  # a rollout sample
    assert not changed(st, lambda s: setattr(s, "revision", 9))
    assert changed(st, lambda s: setattr(s.trainer, "requested", True))  # ends the rollout
    assert changed(st, lambda s: setattr(s.sglang, "served_version", "7"))
    assert not changed(st, accept)  # the operator knows what it sent
    running = st.model_copy(deep=True)
    accept(running)
    assert not changed(running, lambda s: setattr(s.sglang, "paused", True))  # a step of the drain
    assert not changed(running, lambda s: setattr(s, "stage", Stage.DRAINED))
    assert changed(running, lambda s: setattr(s, "fatal", "SGLang died"))
    assert changed(running, lambda s: setattr(s, "stage", Stage.FAILED))
    assert changed(running, lambda s: setattr(s.trainer, "published_version", "5"))

    def finish(s: AgentState) -> None:
        assert s.last_command is not None
        s.last_command.state = CommandState.SUCCEEDED
        s.stage = Stage.DRAINED

    assert changed(running, finish)
    assert acted_on(None, operator_view(st))  # the first report always counts


@contextlib.asynccontextmanager
async def _operator_api() -> AsyncIterator[tuple[StateStore, TestClient[Any, Any], dict[str, str]]]:
    """The agent's operator API on a store at revision 1 (Starting), a client, its auth header."""
    store = StateStore()
    store.commit()
    app = build_operator_app(store, None, AgentMetrics(), TOKEN)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        yield store, client, {"Authorization": f"Bearer {TOKEN}"}


async def _answered(
    client: TestClient[Any, Any], path: str, params: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """GET `path` with `params`; its 200 answer's JSON."""
    resp = await client.get(path, params={k: str(v) for k, v in params.items()}, headers=headers)
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


async def _long_poll_scenario() -> None:
    async with _operator_api() as (store, client, auth):

        async def poll(**params: Any) -> dict[str, Any]:
            return await _answered(client, "/v1/state", params, auth)

        since = store.state.revision
        operator = asyncio.create_task(poll(since=since, wait=5, changes="operator"))
        everyone = asyncio.create_task(poll(since=since, wait=5))
        await asyncio.sleep(0.1)
        with store.change() as s:
            s.rollout.samples = 1  # not for the operator
        got = await asyncio.wait_for(everyone, 2)
        assert got["revision"] == since + 1
        await asyncio.sleep(0.1)
        assert not operator.done()
        with store.change() as s:
            s.stage = Stage.READY  # SGLang is up: the operator acts on that
        got = await asyncio.wait_for(operator, 2)
        assert got["revision"] == since + 2 and got["stage"] == "Ready"
        # A `since` of another boot: answered at once, whatever the revision.
        began = asyncio.get_running_loop().time()
        got = await poll(since=10**6, wait=5, changes="operator", boot="an-earlier-boot")
        assert asyncio.get_running_loop().time() - began < 1
        assert got["bootId"] == store.state.boot_id
        bad = await client.get("/v1/state", params={"changes": "some"}, headers=auth)
        assert bad.status == 400


def test_the_long_poll_with_changes_operator_skips_what_the_operator_does_not_act_on() -> None:
    asyncio.run(_long_poll_scenario())


async def _watch_scenario() -> None:
    async with _operator_api() as (store, client, auth):
        loop = asyncio.get_running_loop()
        params = {"since": str(store.state.revision), "wait": "1.5", "changes": "operator", "watch": "true"}
        began = loop.time()
        resp = await client.get("/v1/state", params=params, headers=auth)
        assert resp.status == 200 and resp.content_type == "application/x-ndjson"
        lines: list[tuple[float, dict[str, Any]]] = []

        async def read() -> None:
            while line := await resp.content.readline():
                lines.append((loop.time() - began, AgentState.model_validate_json(line).model_dump()))

        reader = asyncio.create_task(read())
        await asyncio.sleep(0.1)
        with store.change() as s:
            s.rollout.samples = 1  # not for the operator: no line
        await asyncio.sleep(0.1)
        with store.change() as s:
            s.stage = Stage.READY  # a line
        await asyncio.sleep(0.1)
        with store.change() as s:
            s.stage = Stage.SERVING  # another, in the same response
        await asyncio.wait_for(reader, 5)
        ended = loop.time() - began
        assert [(st["revision"], st["stage"]) for _, st in lines] == [(3, Stage.READY), (4, Stage.SERVING)]
        assert lines[0][0] < 1.0 and 1.4 < ended < 3.0  # each line as it happens; the stream ends at `wait`
        # No `since`: the current state at once, then the stream waits for the next one.
        resp = await client.get("/v1/state", params={"wait": "0", "watch": "true"}, headers=auth)
        assert [AgentState.model_validate_json(x).revision for x in (await resp.read()).splitlines()] == [4]
        bad = await client.get("/v1/state", params={"watch": "yes"}, headers=auth)
        assert bad.status == 400


def test_the_watch_streams_each_state_the_operator_acts_on_in_one_response() -> None:
    asyncio.run(_watch_scenario())


async def _trainer_stage_scenario() -> None:
    store = StateStore()
    store.commit()
    app = build_trainer_app(store, LeaseDesk(store), None, AgentMetrics())  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:

        async def poll(**params: Any) -> dict[str, Any]:
            return await _answered(client, "/v1/trainer/state", params)

        since = store.state.revision
        serving = asyncio.create_task(poll(since=since, wait=5, stage="Serving"))
        everyone = asyncio.create_task(poll(since=since, wait=5))
        await asyncio.sleep(0.1)
        with store.change() as s:
            s.stage = Stage.READY  # a revision on the way: answers a plain long-poll only
        assert (await asyncio.wait_for(everyone, 2))["revision"] == since + 1
        await asyncio.sleep(0.1)
        assert not serving.done()
        with store.change() as s:
            s.stage = Stage.SERVING
        got = await asyncio.wait_for(serving, 2)
        assert got["revision"] == since + 2 and got["stage"] == "Serving"
        failed = asyncio.create_task(poll(since=store.state.revision, wait=5, stage="Drained"))
        await asyncio.sleep(0.1)
        store.fail("SGLang died")  # Failed answers a wait for any stage: the trainer raises on it
        assert (await asyncio.wait_for(failed, 2))["stage"] == "Failed"
        bad = await client.get("/v1/trainer/state", params={"since": "1", "wait": "1", "stage": "Busy"})
        assert bad.status == 400 and "stage: one of" in (await bad.json())["reason"]


def test_the_trainers_long_poll_with_a_stage_answers_in_that_stage_only() -> None:
    asyncio.run(_trainer_stage_scenario())


def test_the_agent_times_the_trainers_lease_from_grant_to_publish_or_abandon() -> None:
    store = StateStore()
    lease = LeaseDesk(store)
    lease.request()
    lease.grant(3)
    assert store.state.trainer.lease_held and store.state.trainer.held_seconds is None
    time.sleep(0.05)
    lease.publish(PublishRequest(version="1", path="/w/1"))
    held = store.state.trainer.held_seconds
    assert held is not None and 0.05 <= held < 5
    lease.request()
    lease.grant(8)
    assert store.state.trainer.held_seconds is None  # this lease's time is not known yet
    lease.abandon("the step failed")
    assert store.state.trainer.held_seconds is not None and store.state.trainer.held_seconds < 0.05
    restarted = LeaseDesk(store)  # a restarted agent does not know when the lease it finds was granted
    restarted.request()
    store.state.trainer.lease_held = True
    restarted.publish(PublishRequest(version="2"))
    assert store.state.trainer.held_seconds is None
