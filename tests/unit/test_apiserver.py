"""The operator's HTTP to the API server (kubeclient/apiserver.py) and the calls made over it
(controller/kube.py, the leader election's Lease in controller/leader.py): paths, queries, bodies and
credentials as the API server expects them; a refusal raises ApiError with its status and answer; a
connection the server dropped is tried once more, a 401 once more with credentials taken again. Against a
plain aiohttp server standing in for the API server, on a thread of its own so that the sync path can call
it too (the e2e tier runs all of it against a real one)."""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import REGISTRY

from rljob.controller.kube import Kube, api_server
from rljob.controller.leader import ElectionOptions, LeaderElector
from rljob.kubeclient.apiserver import MERGE_PATCH, ApiError, ApiServer
from rljob.kubeclient.credentials import Credentials

JOB = {"metadata": {"name": "job", "uid": "u-1", "resourceVersion": "7"}}


class FakeApiServer:
    """Records every request; answers `answers[path]` (status, body) or 200 with {}; closes the next
    `drop_next` connections unanswered; refuses tokens not in `valid_tokens` (when set) with 401."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.answers: dict[tuple[str, str], tuple[int, Any]] = {}
        self.drop_next = 0
        self.valid_tokens: set[str] | None = None
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.drop_next:
            self.drop_next -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        raw = await request.read()
        self.requests.append(
            {
                "method": request.method,
                "path": request.path,
                "query": dict(request.query),
                "headers": dict(request.headers),
                "body": json.loads(raw) if raw else None,
            }
        )
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if self.valid_tokens is not None and token not in self.valid_tokens:
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        status, body = self.answers.get((request.method, request.path), (200, {}))
        return web.json_response(body, status=status)

    def start(self) -> None:
        async def serve() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self.handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = self._runner.addresses[0][1]
            self.url = f"http://127.0.0.1:{port}"

        self._loop.run_until_complete(serve())
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def fake() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.start()
    yield server
    server.stop()


def server_for(fake: FakeApiServer, token: str = "tok-1", token_path: Path | None = None) -> ApiServer:
    """The operator's client (its call counter included) with credentials from a kubeconfig naming `token`,
    or `tokenFile: token_path`."""
    folder = Path(tempfile.mkdtemp(prefix="rljob-kubeconfig-"))
    user = {"tokenFile": str(token_path)} if token_path else {"token": token}
    doc = {
        "current-context": "k",
        "contexts": [{"name": "k", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": fake.url}}],
        "users": [{"name": "u", "user": user}],
    }
    (folder / "config").write_text(json.dumps(doc))
    return api_server(Credentials.from_kubeconfig(str(folder / "config")))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_status_patch_and_event_reach_their_paths_with_the_credentials(fake: FakeApiServer) -> None:
    async def scenario() -> None:
        kube = Kube(server_for(fake))
        await kube.patch_status("ns", "job", {"phase": "Rollout", "message": None})
        await kube.post_event("ns", JOB, "Normal", "PhaseChanged", "Pending -> Rollout")
        await kube.close()

    run(scenario())
    patch, event = fake.requests
    assert (patch["method"], patch["path"]) == (
        "PATCH",
        "/apis/rljob.io/v1alpha1/namespaces/ns/rljobs/job/status",
    )
    assert patch["headers"]["Content-Type"] == "application/merge-patch+json"
    assert patch["body"] == {"status": {"phase": "Rollout", "message": None}}  # null removes a field
    assert (event["method"], event["path"]) == ("POST", "/api/v1/namespaces/ns/events")
    assert event["body"]["involvedObject"]["uid"] == "u-1" and event["body"]["reason"] == "PhaseChanged"
    assert patch["headers"]["Authorization"] == event["headers"]["Authorization"] == "Bearer tok-1"


def test_pods_are_listed_from_the_watch_cache_by_label_and_come_back_without_managed_fields(
    fake: FakeApiServer,
) -> None:
    pod = {"metadata": {"name": "job-0", "managedFields": [{"manager": "kubelet"}]}}
    fake.answers["GET", "/api/v1/namespaces/ns/pods"] = (
        200,
        {"items": [pod], "metadata": {"resourceVersion": "42"}},
    )

    async def scenario() -> Any:
        kube = Kube(server_for(fake))
        try:
            return await kube.list_pods("ns", "job")
        finally:
            await kube.close()

    pods = run(scenario())
    assert list(pods) == [{"metadata": {"name": "job-0"}}] and pods.resource_version == "42"
    assert fake.requests[0]["query"] == {"labelSelector": "rljob.io/job=job", "resourceVersion": "0"}


def test_children_are_created_dry_run_or_not_deleted_by_uid_and_a_conflict_is_no_error(
    fake: FakeApiServer,
) -> None:
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "job-0"}, "spec": {}}
    fake.answers["POST", "/api/v1/namespaces/ns/pods"] = (
        201,
        {**manifest, "metadata": {"name": "job-0", "uid": "p"}},
    )
    fake.answers["POST", "/api/v1/namespaces/ns/secrets"] = (
        409,
        {"kind": "Status", "reason": "AlreadyExists"},
    )
    fake.answers["DELETE", "/api/v1/namespaces/ns/pods/job-1"] = (
        409,
        {"kind": "Status", "reason": "Conflict"},
    )

    async def scenario() -> tuple[Any, Any]:
        kube = Kube(server_for(fake))
        created = await kube.create("ns", manifest, dry_run=True)
        secret = await kube.create("ns", {"kind": "Secret", "metadata": {"name": "job-token"}})
        await kube.delete_pod("ns", "job-1", uid="old-uid")  # another pod of that name now: not an error
        await kube.close()
        return created, secret

    created, secret = run(scenario())
    assert created["metadata"]["uid"] == "p" and secret is None
    dry, _, delete = fake.requests
    assert dry["query"] == {"dryRun": "All"} and dry["body"] == manifest
    assert delete["body"] == {
        "apiVersion": "v1",
        "kind": "DeleteOptions",
        "gracePeriodSeconds": 0,
        "preconditions": {"uid": "old-uid"},
    }


def test_a_refused_status_patch_raises_api_error_with_the_answer(fake: FakeApiServer) -> None:
    fake.answers["PATCH", "/apis/rljob.io/v1alpha1/namespaces/ns/rljobs/job/status"] = (
        422,
        {"kind": "Status", "code": 422, "reason": "Invalid"},
    )
    fake.answers["POST", "/api/v1/namespaces/ns/events"] = (403, {"kind": "Status", "reason": "Forbidden"})

    async def scenario() -> ApiError:
        kube = Kube(server_for(fake))
        with pytest.raises(ApiError) as raised:
            await kube.patch_status("ns", "job", {"phase": "Nope"})
        await kube.post_event("ns", JOB, "Normal", "PhaseChanged", "x")  # best effort: logged, not raised
        await kube.close()
        return raised.value

    err = run(scenario())
    assert err.status == 422 and err.status_object()["reason"] == "Invalid"


def test_a_dropped_connection_is_tried_once_more(fake: FakeApiServer) -> None:
    async def scenario() -> BaseException | None:
        kube = Kube(server_for(fake))
        try:
            await kube.patch_status("ns", "job", {"phase": "Rollout"})
        except Exception as err:  # what the second drop raises is the point
            return err
        finally:
            await kube.close()
        return None

    fake.drop_next = 1
    assert run(scenario()) is None and len(fake.requests) == 1
    fake.drop_next = 2
    failed = run(scenario())
    assert failed is not None and not isinstance(failed, ApiError) and len(fake.requests) == 1


def test_a_401_reads_the_rotated_token_and_tries_once_more(
    fake: FakeApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kubelet rotated the token: the configuration is loaded again at once after a 401 (the file read
    again); a server that refuses the new one too is an error, not a loop."""
    token = tmp_path / "token"
    token.write_text("tok-1")
    server = server_for(fake, token_path=token)

    async def patch() -> None:
        try:
            await Kube(server).patch_status("ns", "job", {"phase": "Rollout"})
        finally:
            await server.close()

    run(patch())
    token.write_text("tok-2")
    fake.valid_tokens = {"tok-2"}
    run(patch())
    sent = [r["headers"]["Authorization"] for r in fake.requests]
    assert sent == ["Bearer tok-1", "Bearer tok-1", "Bearer tok-2"]
    fake.valid_tokens = set()
    with pytest.raises(ApiError) as raised:
        run(patch())
    assert raised.value.status == 401 and len(fake.requests) == 5


def test_the_sync_path_holds_the_lease_as_the_election_does(fake: FakeApiServer) -> None:
    """The leader election's calls (a thread of its own, controller/leader.py): read a Lease that does
    not exist, create it; then renew it with the resourceVersion read; a 409 is a lost race, not a crash."""
    leases = "/apis/coordination.k8s.io/v1/namespaces/ops/leases"
    fake.answers["GET", f"{leases}/rljob-operator"] = (404, {"kind": "Status", "reason": "NotFound"})
    fake.answers["POST", leases] = (201, {})
    elector = LeaderElector(ElectionOptions("ops", identity="me"), server_for(fake))
    assert elector.try_once()
    created = fake.requests[-1]
    assert created["method"] == "POST" and created["body"]["spec"]["holderIdentity"] == "me"
    assert created["headers"]["Authorization"] == "Bearer tok-1"

    lease = {
        "metadata": {"name": "rljob-operator", "resourceVersion": "9"},
        "spec": {"holderIdentity": "me", "renewTime": "2026-12-03T08:00:00.000000Z", "leaseTransitions": 2},
    }
    fake.answers["GET", f"{leases}/rljob-operator"] = (200, lease)
    assert elector.try_once()
    renewed = fake.requests[-1]
    assert (renewed["method"], renewed["path"]) == ("PUT", f"{leases}/rljob-operator")
    assert (
        renewed["body"]["metadata"]["resourceVersion"] == "9"
        and renewed["body"]["spec"]["leaseTransitions"] == 2
    )
    fake.answers["PUT", f"{leases}/rljob-operator"] = (409, {"kind": "Status", "reason": "Conflict"})
    assert not elector.try_once()


def test_the_sync_path_tries_a_dropped_connection_once_more(fake: FakeApiServer) -> None:
    server = server_for(fake)
    fake.answers["GET", "/version"] = (200, {"gitVersion": "v1.34.4"})
    assert json.loads(server.call_sync("get_version", "GET", "/version"))["gitVersion"] == "v1.34.4"
    fake.drop_next = 1  # the kept-alive connection of the first call is closed by the server
    assert json.loads(server.call_sync("get_version", "GET", "/version"))["gitVersion"] == "v1.34.4"
    fake.drop_next = 2
    with pytest.raises((OSError, ConnectionError)):
        server.call_sync("get_version", "GET", "/version")


def test_each_call_passes_its_verb_to_the_builders_hook_once(fake: FakeApiServer) -> None:
    """The client counts nothing itself: every call, in the event loop or from a thread, passes its verb
    and its body's bytes to the `on_call` its builder gave, once however often it is tried."""
    verbs: list[tuple[str, int]] = []
    server = ApiServer(server_for(fake).credentials, on_call=lambda verb, sent: verbs.append((verb, sent)))
    path = "/apis/rljob.io/v1alpha1/namespaces/ns/rljobs/job/status"

    async def patch() -> None:
        try:
            await server.call("patch_status", "PATCH", path, {"status": {}}, content_type=MERGE_PATCH)
        finally:
            await server.close()

    fake.drop_next = 1  # tried twice, one call
    run(patch())
    server.call_sync("get_version", "GET", "/version")
    assert verbs == [("patch_status", len(b'{"status":{}}')), ("get_version", 0)]
    assert [r["path"] for r in fake.requests] == [path, "/version"]


def test_the_operators_client_counts_its_calls_by_verb(fake: FakeApiServer) -> None:
    """controller/kube.py builds the client with the operator's counter: rljob_api_calls_total{verb}."""

    def counted() -> float:
        return REGISTRY.get_sample_value("rljob_api_calls_total", {"verb": "read_rljob"}) or 0.0

    async def read() -> None:
        kube = Kube(server_for(fake))
        try:
            await kube.read_status("ns", "job")
        finally:
            await kube.close()

    before = counted()
    run(read())
    assert counted() == before + 1 and len(fake.requests) == 1
