"""Kube's direct calls (controller/kube.py DirectCalls): a status patch and an event go to the API server's
paths with the kubernetes client's credentials, refreshed at most every CREDENTIALS_SECONDS; a refusal raises
ApiException with its status and body, as the client would; a connection the server dropped is tried once
more. Against a plain aiohttp server standing in for the API server (the e2e tier runs them against a real
one: every status the operator writes goes this way)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from rljob.controller.kube import DirectCalls, Kube

JOB = {"metadata": {"name": "job", "uid": "u-1", "resourceVersion": "7"}}


class FakeServer:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.answer = 200
        self.drop_next = 0  # connections to close without an answer

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.drop_next:
            self.drop_next -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        body = await request.json()
        self.requests.append((request.method, request.path, dict(request.headers), body))
        if self.answer >= 400:
            return web.json_response(
                {"kind": "Status", "code": self.answer, "reason": "Invalid"}, status=self.answer
            )
        return web.json_response({"kind": "RLJob", **JOB})


def kube_for(server: TestServer, tokens: list[str]) -> Kube:
    configuration = client.Configuration(host=f"http://{server.host}:{server.port}")
    configuration.api_key = {"BearerToken": "unused"}

    def refresh(c: client.Configuration) -> None:  # a rotated token, as the in-cluster loader's hook
        c.api_key = {"BearerToken": tokens.pop(0)}
        c.api_key_prefix = {"BearerToken": "Bearer"}

    configuration.refresh_api_key_hook = refresh
    return Kube(client.ApiClient(configuration))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_status_patch_and_event_reach_their_paths_with_the_credentials() -> None:
    async def scenario() -> FakeServer:
        fake = FakeServer()
        async with TestServer(fake.app()) as server:
            kube = kube_for(server, ["tok-1", "tok-2"])
            await kube.patch_status("ns", "job", {"phase": "Rollout", "message": None})
            await kube.post_event("ns", JOB, "Normal", "PhaseChanged", "Pending -> Rollout")
            await kube.close()
        return fake

    fake = run(scenario())
    (m1, p1, h1, b1), (m2, p2, h2, b2) = fake.requests
    assert (m1, p1) == ("PATCH", "/apis/rljob.io/v1alpha1/namespaces/ns/rljobs/job/status")
    assert h1["Content-Type"] == "application/merge-patch+json"
    assert b1 == {"status": {"phase": "Rollout", "message": None}}  # null removes a field
    assert (m2, p2) == ("POST", "/api/v1/namespaces/ns/events")
    assert b2["involvedObject"]["uid"] == "u-1" and b2["reason"] == "PhaseChanged"
    # The hook ran once: the second call, within CREDENTIALS_SECONDS, kept the first token.
    assert h1["Authorization"] == h2["Authorization"] == "Bearer tok-1"


def test_credentials_are_refreshed_after_credentials_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DirectCalls, "CREDENTIALS_SECONDS", 0.0)

    async def scenario() -> FakeServer:
        fake = FakeServer()
        async with TestServer(fake.app()) as server:
            kube = kube_for(server, ["tok-1", "tok-2"])
            await kube.patch_status("ns", "job", {"phase": "Rollout"})
            await kube.patch_status("ns", "job", {"phase": "Draining"})
            await kube.close()
        return fake

    fake = run(scenario())
    assert [h["Authorization"] for _, _, h, _ in fake.requests] == ["Bearer tok-1", "Bearer tok-2"]


def test_a_refused_status_patch_raises_api_exception_with_the_answer() -> None:
    async def scenario() -> ApiException:
        fake = FakeServer()
        fake.answer = 422
        async with TestServer(fake.app()) as server:
            kube = kube_for(server, ["tok"])
            with pytest.raises(ApiException) as raised:
                await kube.patch_status("ns", "job", {"phase": "Nope"})
            await kube.post_event("ns", JOB, "Normal", "PhaseChanged", "x")  # best effort: logged, not raised
            await kube.close()
        return raised.value

    err = run(scenario())
    assert err.status == 422 and json.loads(err.body)["reason"] == "Invalid"


def test_a_dropped_connection_is_tried_once_more() -> None:
    async def scenario(drops: int) -> tuple[FakeServer, BaseException | None]:
        fake = FakeServer()
        fake.drop_next = drops
        failed: BaseException | None = None
        async with TestServer(fake.app()) as server:
            kube = kube_for(server, ["tok"])
            try:
                await kube.patch_status("ns", "job", {"phase": "Rollout"})
            except Exception as err:  # what the second drop raises is the point
                failed = err
            await kube.close()
        return fake, failed

    fake, failed = run(scenario(1))
    assert failed is None and len(fake.requests) == 1
    fake, failed = run(scenario(2))
    assert failed is not None and not isinstance(failed, ApiException) and fake.requests == []


def test_a_proxy_keeps_the_clients_own_path() -> None:
    configuration = client.Configuration(host="https://api.example")
    configuration.proxy = "http://proxy.example:3128"
    assert not Kube(client.ApiClient(configuration)).direct.usable
