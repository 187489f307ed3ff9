"""Trainer-facing API on loopback (no token: the pod boundary is the security boundary), wrapped by the
`rljob.trainer` SDK: lease request/wait/publish/abandon and the refit window."""

from __future__ import annotations

from aiohttp import web
from pydantic import BaseModel, TypeAdapter

from rljob.agent.errors import Refused
from rljob.agent.http_util import (
    MAX_WAIT_S,
    Handler,
    make_error_middleware,
    query_enum,
    query_number,
    read_body,
    reply,
)
from rljob.agent.lease import LeaseDesk
from rljob.agent.metrics import AgentMetrics
from rljob.agent.refit_window import RefitWindows
from rljob.agent.state import StateStore
from rljob.api.agent import (
    AbandonRequest,
    DistributedPush,
    GroupState,
    InitWeightsGroup,
    PublishRequest,
    RefitClose,
    RolloutReport,
    RolloutSamples,
    Stage,
    TensorPush,
)

PUBLISH = TypeAdapter(PublishRequest)
ABANDON = TypeAdapter(AbandonRequest)
TENSOR = TypeAdapter(TensorPush)
DISTRIBUTED = TypeAdapter(DistributedPush)
GROUP = TypeAdapter(InitWeightsGroup)
CLOSE = TypeAdapter(RefitClose)
SAMPLES = TypeAdapter(RolloutSamples)


def build_trainer_app(
    store: StateStore, lease: LeaseDesk, windows: RefitWindows, metrics: AgentMetrics
) -> web.Application:
    async def request_gpu(request: web.Request) -> web.Response:
        return reply(lease.request())

    async def get_lease(request: web.Request) -> web.Response:
        wait = query_number(request, "wait", 0, lo=0, hi=MAX_WAIT_S)
        return reply(await lease.wait_granted(wait) if wait > 0 else lease.status())

    async def publish(request: web.Request) -> web.Response:
        return reply(lease.publish(await read_body(request, PUBLISH)))  # clears the last refusal itself

    async def abandon(request: web.Request) -> web.Response:
        return reply(lease.abandon((await read_body(request, ABANDON)).reason))

    async def get_refit(request: web.Request) -> web.Response:
        """With `wait`: until a window is open and its weight-update group (if any) is no longer Pending."""
        wait = query_number(request, "wait", 0, lo=0, hi=MAX_WAIT_S)
        if wait > 0:
            await store.wait_until(lambda: (v := windows.view()).open and v.group != GroupState.PENDING, wait)
        return reply(windows.view())

    async def push_tensor(request: web.Request) -> web.Response:
        return accepted(await windows.push_tensor(await read_body(request, TENSOR)))

    async def push_distributed(request: web.Request) -> web.Response:
        return accepted(await windows.push_distributed(await read_body(request, DISTRIBUTED)))

    async def init_group(request: web.Request) -> web.Response:
        return accepted(windows.init_group(await read_body(request, GROUP)), 202)

    async def close_window(request: web.Request) -> web.Response:
        body = await read_body(request, CLOSE)
        window = windows.trainer_close(body.error, digest=body.digest)
        return reply(window) if body.error else accepted(window)  # a close with an error is no recovery

    async def report_rollout(request: web.Request) -> web.Response:
        """The trainer's count of completed samples, added to this rollout's report: the cost per rollout
        of docs/profiling.md divides the iteration's GPU-seconds by it."""
        body = await read_body(request, SAMPLES)
        with store.change() as s:
            s.rollout.completed_samples += body.samples
        report: RolloutReport = store.state.rollout
        return reply(report)

    async def get_state(request: web.Request) -> web.Response:
        since = query_number(request, "since", -1, lo=-1, hi=2**53)
        wait = query_number(request, "wait", 0, lo=0, hi=MAX_WAIT_S)
        stage = query_enum(request, "stage", Stage)
        if wait > 0 and since >= 0:
            if stage is None:
                await store.wait_newer(int(since), wait)
            else:
                await store.wait_stage(int(since), stage, wait)
        return reply(store.state)

    def accepted(body: BaseModel, status: int = 200) -> web.Response:
        """A handoff call taken: the trainer's last refusal is behind it (LeaseDesk.accepted)."""
        lease.accepted()
        return reply(body, status)

    @web.middleware
    async def note_refusals(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Refused as e:  # kept for the operator (TrainerReport.last_refusal), then answered
            lease.refused(f"{request.method} {request.path}: {e.error}: {e.reason}")
            raise

    middlewares = [make_error_middleware(metrics), note_refusals]
    app = web.Application(middlewares=middlewares, client_max_size=256 << 20)
    r = app.router
    r.add_post("/v1/trainer/request", request_gpu)
    r.add_get("/v1/trainer/lease", get_lease)
    r.add_post("/v1/trainer/publish", publish)
    r.add_post("/v1/trainer/abandon", abandon)
    r.add_get("/v1/trainer/refit", get_refit)
    r.add_post("/v1/trainer/refit/group", init_group)
    r.add_post("/v1/trainer/refit/tensor", push_tensor)
    r.add_post("/v1/trainer/refit/distributed", push_distributed)
    r.add_post("/v1/trainer/refit/close", close_window)
    r.add_post("/v1/trainer/rollout", report_rollout)
    r.add_get("/v1/trainer/state", get_state)
    return app
