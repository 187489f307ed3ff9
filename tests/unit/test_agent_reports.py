"""The states the channel sends the operator (agent/reports.py applies api/agent.py's NOT_SENT_ALONE and
SENT_WHILE_RUNNING): a finished command, a stage reached outside a command, the trainer's report, a failure;
not rollout samples, not a command's acceptance or its steps (tests/unit/test_agent_watch.py: on the
channel). The trainer's `GET /v1/trainer/state?stage=` answers in that stage (or Failed) only."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from rljob.agent.lease import LeaseDesk
from rljob.agent.metrics import AgentMetrics
from rljob.agent.reports import carried, operator_view
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
    return carried(before, operator_view(after))


def accept(s: AgentState) -> None:
    s.epoch = 5
    s.last_command = CommandStatus(epoch=5, action=Action.DRAIN, state=CommandState.RUNNING)


def test_what_the_operator_acts_on() -> None:
    st = serving()
    assert not changed(st, lambda s: setattr(s.rollout, "samples", 3))  # a rollout sample
    assert not changed(st, lambda s: setattr(s, "revision", 9))
    assert changed(st, lambda s: setattr(s.trainer, "requested", True))  # ends the rollout
    assert changed(st, lambda s: setattr(s.engine, "served_version", "7"))
    assert not changed(st, accept)  # the operator knows what it sent
    running = st.model_copy(deep=True)
    accept(running)
    assert not changed(running, lambda s: setattr(s.engine, "paused", True))  # a step of the drain
    assert not changed(running, lambda s: setattr(s, "stage", Stage.DRAINED))
    assert changed(running, lambda s: setattr(s, "fatal", "SGLang died"))
    assert changed(running, lambda s: setattr(s, "stage", Stage.FAILED))
    assert changed(running, lambda s: setattr(s.trainer, "published_version", "5"))

    def finish(s: AgentState) -> None:
        assert s.last_command is not None
        s.last_command.state = CommandState.SUCCEEDED
        s.stage = Stage.DRAINED

    assert changed(running, finish)
    assert carried(None, operator_view(st))  # the first report always counts


async def _answered(
    client: TestClient[Any, Any], path: str, params: dict[str, Any], headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """GET `path` with `params`; its 200 answer's JSON."""
    resp = await client.get(path, params={k: str(v) for k, v in params.items()}, headers=headers)
    assert resp.status == 200, await resp.text()
    return dict(await resp.json())


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


def _grant(store: StateStore, lease: LeaseDesk, epoch: int) -> None:
    """What a grant command does once its pod Released: the lease's record, with the move to Granted."""
    store.state.stage = Stage.RELEASED
    record = lease.grant(epoch)
    with store.change(stage=Stage.GRANTED) as s:
        record(s)


def test_the_agent_times_the_trainers_lease_from_grant_to_publish_or_abandon() -> None:
    store = StateStore()
    lease = LeaseDesk(store)
    lease.request()
    _grant(store, lease, 3)
    assert store.state.trainer.lease_held and store.state.trainer.held_seconds is None
    time.sleep(0.05)
    lease.publish(PublishRequest(version="1", path="/w/1"))
    held = store.state.trainer.held_seconds
    assert held is not None and 0.05 <= held < 5
    lease.request()
    _grant(store, lease, 8)
    assert store.state.trainer.held_seconds is None  # this lease's time is not known yet
    lease.abandon("the step failed")
    assert store.state.trainer.held_seconds is not None and store.state.trainer.held_seconds < 0.05
    restarted = LeaseDesk(store)  # a restarted agent does not know when the lease it finds was granted
    restarted.request()
    store.state.trainer.lease_held = True
    restarted.publish(PublishRequest(version="2"))
    assert store.state.trainer.held_seconds is None
