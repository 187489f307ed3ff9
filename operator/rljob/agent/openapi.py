"""The agent's OpenAPI 3.1 document, generated from the wire models (api/agent.py). Committed as
docs/agent-openapi.json; regenerate with `python -m rljob.agent.openapi > docs/agent-openapi.json`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter

from rljob.api.agent import (
    AGENT_API_VERSION,
    COMMAND_ADAPTER,
    AbandonRequest,
    AgentHealth,
    AgentState,
    ChannelFrame,
    CommandReply,
    CommandStatus,
    DistributedPush,
    InitWeightsGroup,
    LeaseStatus,
    PublishRequest,
    PushResult,
    RefitClose,
    RefitWindow,
    Refusal,
    RolloutReport,
    RolloutSamples,
    TensorPush,
    TrainerReport,
)

REF = "#/components/schemas/{model}"
TRAINER_SERVER = "http://127.0.0.1:8472"


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    responses: dict[int, str | None]  # status -> schema name (None: no JSON body)
    body: str | None = None
    query: tuple[tuple[str, str, str], ...] = ()  # (name, type, description)
    trainer: bool = False  # on the loopback trainer listener, no token
    open: bool = False  # operator listener, but no token
    text: str | None = field(default=None)  # content type of a non-JSON 200


_SINCE = ("since", "integer", "Return as soon as the revision is greater than this.")
_WAIT = ("wait", "number", "Seconds to long-poll (capped at 30).")
_STAGE = (
    "stage",
    "string",
    "With `since` and `wait`: return on a newer revision in this stage (or Failed) only, not on every one.",
)
_BOOT = ("boot", "string", "The boot_id `since` belongs to: another boot answers at once.")
_REFUSALS = {400: "Refusal", 409: "Refusal", 422: "Refusal"}

ROUTES: tuple[Route, ...] = (
    Route(
        "get",
        "/v1/state",
        "The agent's current state, at once (for people and probes; the operator follows /v1/channel).",
        {200: "AgentState"},
    ),
    Route(
        "post",
        "/v1/commands",
        "Submit a command (executes asynchronously; same epoch again is a no-op).",
        {200: "CommandStatus", 202: "CommandStatus", **_REFUSALS},
        body="Command",
        query=(("wait", "number", "Seconds to wait for the command to finish (capped at 30)."),),
    ),
    Route(
        "get",
        "/v1/channel",
        "A WebSocket (101 Switching Protocols), the agent's one report transport: every frame from the agent "
        "is a ChannelFrame, a state the operator acts on (agent/reports.py; the first at once or as soon as "
        "the revision is greater than `since`) or the reply to a command; the operator sends Command frames "
        "(the POST /v1/commands body) and gets a CommandReply each, with the status and body POST "
        "/v1/commands would answer.",
        {101: "ChannelFrame", 400: "Refusal"},
        query=(_SINCE, _BOOT),
    ),
    Route("get", "/healthz", "The agent answers.", {200: "AgentHealth"}, open=True),
    Route("get", "/metrics", "Prometheus metrics.", {200: None}, open=True, text="text/plain"),
    Route("get", "/openapi.json", "This document.", {200: None}, open=True, text="application/json"),
    Route(
        "get",
        "/probe/engine",
        "Liveness of the engine container: the engine's liveness route through the agent (kubelet probes "
        "can't reach 127.0.0.1). 200 while paused; 503 when the engine doesn't answer.",
        {200: None, 503: None},
        open=True,
        text="text/plain",
    ),
    Route(
        "get",
        "/probe/gang",
        "Startup probe of the agent container: 200 once the operator has reached this agent (it watches a "
        "gang's agents only after the scheduler placed every member), 503 before. As a native sidecar's "
        "startupProbe it holds back the pod's engine and trainer containers.",
        {200: None, 503: None},
        open=True,
        text="text/plain",
    ),
    Route(
        "post",
        "/v1/trainer/request",
        "The trainer asks for the GPU.",
        {200: "TrainerReport", 409: "Refusal"},
        trainer=True,
    ),
    Route(
        "get",
        "/v1/trainer/lease",
        "Long-poll until the GPU lease is granted.",
        {200: "LeaseStatus"},
        query=(_WAIT,),
        trainer=True,
    ),
    Route(
        "post",
        "/v1/trainer/publish",
        "Publish the new version and return the lease.",
        {200: "TrainerReport", **_REFUSALS},
        body="PublishRequest",
        trainer=True,
    ),
    Route(
        "post",
        "/v1/trainer/abandon",
        "Return the lease without publishing.",
        {200: "TrainerReport", **_REFUSALS},
        body="AbandonRequest",
        trainer=True,
    ),
    Route(
        "get",
        "/v1/trainer/refit",
        "Long-poll until a tensor/distributed refit window opens and its weight-update group is not Pending.",
        {200: "RefitWindow"},
        query=(_WAIT,),
        trainer=True,
    ),
    Route(
        "post",
        "/v1/trainer/refit/group",
        "Start the engine's join of the weights group in the background (distributed windows); answers at "
        "once. The engine joins the trainer's rendezvous: the trainer runs its own init_process_group "
        "(rank 0), then waits on GET /v1/trainer/refit?wait= for group Ready or Failed.",
        {202: "RefitWindow", **_REFUSALS},
        body="InitWeightsGroup",
        trainer=True,
    ),
    Route(
        "post",
        "/v1/trainer/refit/tensor",
        "Forward one update_weights_from_tensor bucket.",
        {200: "PushResult", 502: "Refusal", 504: "Refusal", **_REFUSALS},
        body="TensorPush",
        trainer=True,
    ),
    Route(
        "post",
        "/v1/trainer/refit/distributed",
        "Forward one update_weights_from_distributed call.",
        {200: "PushResult", 502: "Refusal", 504: "Refusal", **_REFUSALS},
        body="DistributedPush",
        trainer=True,
    ),
    Route(
        "post",
        "/v1/trainer/refit/close",
        "The trainer is done pushing.",
        {200: "RefitWindow", **_REFUSALS},
        body="RefitClose",
        trainer=True,
    ),
    Route(
        "post",
        "/v1/trainer/rollout",
        "Report the samples this rollout generated (added to the rollout report; send before asking for "
        "the GPU): the cost per rollout in status divides the iteration's GPU-seconds by them.",
        {200: "RolloutReport", **_REFUSALS},
        body="RolloutSamples",
        trainer=True,
    ),
    Route(
        "get",
        "/v1/trainer/state",
        "Agent state for the trainer; long-polls like /v1/state.",
        {200: "AgentState", 400: "Refusal"},
        query=(_SINCE, _WAIT, _STAGE),
        trainer=True,
    ),
)

MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m
    for m in (
        AgentState,
        ChannelFrame,
        CommandReply,
        CommandStatus,
        Refusal,
        AgentHealth,
        TrainerReport,
        LeaseStatus,
        PublishRequest,
        AbandonRequest,
        RefitWindow,
        InitWeightsGroup,
        TensorPush,
        DistributedPush,
        RefitClose,
        PushResult,
        RolloutReport,
        RolloutSamples,
    )
}


def _schemas() -> dict[str, Any]:
    inputs: list[tuple[str, Any, TypeAdapter[Any]]] = [
        (name, "validation", TypeAdapter(model)) for name, model in MODELS.items()
    ]
    inputs.append(("Command", "validation", COMMAND_ADAPTER))
    keyed, defs = TypeAdapter.json_schemas(inputs, ref_template=REF)
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    command = keyed[("Command", "validation")]
    schemas["Command"] = {
        "title": "Command",
        "description": "POST /v1/commands body, by `action`.",
        **command,
    }
    return dict(sorted(schemas.items()))


def _operation(route: Route) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, "operationId": _operation_id(route)}
    if route.query:
        op["parameters"] = [
            {"name": n, "in": "query", "required": False, "schema": _query_schema(n, t), "description": d}
            for n, t, d in route.query
        ]
    if route.body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": REF.format(model=route.body)}}},
        }
    responses: dict[str, Any] = {}
    for status, schema in sorted(route.responses.items()):
        resp: dict[str, Any] = {
            "description": "Switching Protocols" if status == 101 else "OK" if status < 300 else "Refused"
        }
        if schema is not None:
            resp["content"] = {"application/json": {"schema": {"$ref": REF.format(model=schema)}}}
        elif route.text is not None:
            resp["content"] = {
                route.text: {"schema": {"type": "string" if route.text != "application/json" else "object"}}
            }
        responses[str(status)] = resp
    if not route.trainer and not route.open:
        responses["401"] = {
            "description": "Missing or wrong bearer token",
            "content": {"application/json": {"schema": {"$ref": REF.format(model="Refusal")}}},
        }
        op["security"] = [{"bearer": []}]
    else:
        op["security"] = []
    if route.trainer:
        op["servers"] = [{"url": TRAINER_SERVER, "description": "trainer listener (loopback, no token)"}]
        op["tags"] = ["trainer"]
    else:
        op["tags"] = ["operator"]
    op["responses"] = responses
    return op


def _query_schema(name: str, kind: str) -> dict[str, Any]:
    if name == "wait":
        return {"type": kind, "minimum": 0, "maximum": 30}
    if kind == "boolean":
        return {"type": kind}
    if kind == "string":
        return {"type": kind, "maxLength": 64}
    return {"type": kind, "minimum": -1}


def _operation_id(route: Route) -> str:
    parts = [p for p in route.path.strip("/").replace(".", "_").split("/") if p not in ("v1",)]
    return route.method + "_" + "_".join(parts)


def build_document(*, trainer: bool = True) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for route in ROUTES:
        if route.trainer and not trainer:
            continue
        paths.setdefault(route.path, {})[route.method] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "rljob-agent",
            "version": AGENT_API_VERSION,
            "description": "In-pod agent between the rljob operator, the trainer and the inference engine. "
            "Operator routes "
            "listen on the pod IP and need the bearer token; trainer routes listen on loopback only.",
        },
        "servers": [{"url": "http://{pod_ip}:8471", "variables": {"pod_ip": {"default": "127.0.0.1"}}}],
        "paths": paths,
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def main() -> None:
    json.dump(build_document(), sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
