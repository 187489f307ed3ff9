"""A status write the API server leaves unanswered (a 5xx, a broken connection, a timeout: kube.Unanswered)
does not end the conductor (issue 32): the writer reads the status back (one GET) and goes on from what is
stored. A write that landed is not sent again; one that did not is sent again at the next write, no
sooner than its pacing allows, and nothing of its decision is carried out until it is stored. Other
answers (a 409, a 422) raise as before. The fake API server is test_conductor_refusals.FakeKube; the
writer, the conductor and decide() are the real ones, and Kube's typed error is checked over HTTP."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from kubernetes.client import Configuration
from test_conductor_refusals import FakeKube, assert_invalid_spec, body, conduct

from rljob.api.status import Phase, RLJobStatus
from rljob.controller.kube import Kube, Unanswered
from rljob.controller.status_writer import (
    MAX_RETRY_SECONDS,
    RETRY_SECONDS,
    StatusNotStored,
    StatusWriter,
    merge_patch,
)
from rljob.kubeclient.apiserver import ApiError, ApiServer
from rljob.kubeclient.credentials import Credentials

GATEWAY_TIMEOUT = Unanswered("patch_status", 504, "Gateway Timeout")


class UnansweredKube(FakeKube):
    """FakeKube whose next patches are answered 504, one for each entry of `landing`: whether the API
    server applied that patch all the same. `unanswered_reads`: the next reads of the status, answered 503."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.landing: list[bool] = []
        self.unanswered_reads = 0
        self.reads = 0

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        if not self.landing:
            return await super().patch_status(namespace, name, patch)
        if self.landing.pop(0):
            await super().patch_status(namespace, name, patch)
        else:
            self.patches.append(patch)
        raise GATEWAY_TIMEOUT

    async def read_status(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        if self.unanswered_reads:
            self.unanswered_reads -= 1
            raise Unanswered("read_rljob", 503, "Service Unavailable")
        return await super().read_status(namespace, name)


def status(phase: Phase, reason: str | None = None) -> RLJobStatus:
    return RLJobStatus(phase=phase, replicas=4, ready_replicas=4, ready="4/4", reason=reason)


ROLLOUT, DRAINING = status(Phase.ROLLOUT), status(Phase.DRAINING)


def writer_on(kube: FakeKube, now: list[float]) -> StatusWriter:
    kube.status = ROLLOUT.wire()
    return StatusWriter(kube, "ns", "job", kube.status, clock=lambda: now[0])  # type: ignore[arg-type]


def test_a_504_whose_write_landed_is_read_back_and_not_sent_again() -> None:
    now = [100.0]
    kube = UnansweredKube()
    writer = writer_on(kube, now)
    kube.landing = [True]

    async def scenario() -> list[bool]:
        wrote = [await writer.write(DRAINING)]  # answered 504, and stored: the read back shows it
        wrote.append(await writer.write(DRAINING))  # nothing left to send
        wrote.append(await writer.write(status(Phase.DRAINING, "m")))  # diffed against what was written
        return wrote

    assert asyncio.run(scenario()) == [True, False, True]
    assert kube.reads == 1  # one GET for the write that went unanswered
    assert kube.patches == [{"phase": "Draining"}, {"reason": "m"}]
    assert kube.status == status(Phase.DRAINING, "m").wire()


def test_a_504_whose_write_did_not_land_is_sent_again_by_the_next_write() -> None:
    now = [100.0]
    kube = UnansweredKube()
    writer = writer_on(kube, now)
    kube.landing = [False]

    async def scenario() -> tuple[float, float, bool]:
        with pytest.raises(StatusNotStored) as first:
            await writer.write(DRAINING)  # answered 504, not stored: the read back shows Rollout
        now[0] += RETRY_SECONDS / 2
        with pytest.raises(StatusNotStored) as early:
            await writer.write(DRAINING)  # paced: not tried before its time
        now[0] += RETRY_SECONDS / 2
        return first.value.retry_in, early.value.retry_in, await writer.write(DRAINING)

    assert asyncio.run(scenario()) == (RETRY_SECONDS, RETRY_SECONDS / 2, True)
    assert kube.reads == 1
    assert kube.patches == [{"phase": "Draining"}, {"phase": "Draining"}]  # the change, sent again once
    assert kube.status == DRAINING.wire()


def test_a_write_that_keeps_failing_is_paced_and_an_unknown_status_is_read_before_the_next_patch() -> None:
    now = [100.0]
    kube = UnansweredKube()
    writer = writer_on(kube, now)
    kube.landing = [False] * 6
    kube.unanswered_reads = 1  # the first read back goes unanswered too: the stored status is not known

    async def scenario() -> list[float]:
        waits = []
        while True:
            try:
                await writer.write(DRAINING)
            except StatusNotStored as not_stored:
                waits.append(not_stored.retry_in)
                now[0] += not_stored.retry_in
                continue
            return waits

    waits = asyncio.run(scenario())
    assert waits == [min(MAX_RETRY_SECONDS, RETRY_SECONDS * 2**n) for n in range(6)]
    assert waits[-1] == MAX_RETRY_SECONDS
    # 6 patches unanswered, each read back; the first read back went unanswered, so the next write read
    # before it diffed (7 reads); then the 7th patch, which was stored.
    assert len(kube.patches) == 7 and kube.reads == 7 and kube.status == DRAINING.wire()


def test_a_conflict_and_a_refusal_still_raise_as_before() -> None:
    now = [100.0]

    class RefusingKube(FakeKube):
        def __init__(self, err: ApiError) -> None:
            super().__init__()
            self.err = err

        async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
            raise self.err

    for code in (409, 422):
        writer = writer_on(RefusingKube(ApiError(code, "Conflict")), now)
        with pytest.raises(ApiError) as raised:
            asyncio.run(writer.write(DRAINING))
        assert raised.value.status == code


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
def test_the_conductor_goes_on_after_an_unanswered_status_write(landed: bool) -> None:
    """The first decision of a spec the models refuse writes Failed; that write is answered 504. The
    conductor does not raise; the status ends Failed, written once more only when it had not landed, and
    the decision's event is posted once, after the status is stored."""
    kube = UnansweredKube()
    kube.landing = [landed]
    job = body(lambda d: d["spec"]["template"]["spec"]["containers"].append({"name": "rljob-agent"}))
    stored = conduct(kube, job)
    assert kube.reads == 2  # at the start, and once back after the 504
    if landed:
        assert_invalid_spec(kube, stored, "spec.template.spec.containers")
    else:
        first, again = kube.patches  # the same change; decided again, a little later
        assert first.keys() == again.keys() and again == merge_patch({}, stored)
        assert first["phase"] == again["phase"] == "Failed"
        kube.patches = [again]
        assert_invalid_spec(kube, stored, "spec.template.spec.containers")


# --- Kube's typed error, over HTTP ------------------------------------------------------------------


class GatewayTimeoutServer:
    """An aiohttp server standing in for the API server: answers the status PATCH with `patch_answer`,
    the RLJob's GET with `job`; closes connections unanswered while `drop` is set."""

    def __init__(self) -> None:
        self.patch_answer = 504
        self.job: dict[str, Any] = {"status": {}}
        self.drop = False
        self.requests: list[tuple[str, str]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.requests.append((request.method, request.path))
        if self.drop:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if request.method == "PATCH":
            return web.json_response({"kind": "Status", "code": self.patch_answer}, status=self.patch_answer)
        return web.json_response(self.job)

    def start(self) -> None:
        async def serve() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self.handle)
            self._runner = web.AppRunner(app)
            await self._runner.setup()
            await web.TCPSite(self._runner, "127.0.0.1", 0).start()
            self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

        self._loop.run_until_complete(serve())
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.fixture
def server() -> Iterator[GatewayTimeoutServer]:
    stand_in = GatewayTimeoutServer()
    stand_in.start()
    yield stand_in
    stand_in.stop()


def kube_of(server: GatewayTimeoutServer) -> Kube:
    def configuration() -> Configuration:
        loaded = Configuration(host=server.url)
        loaded.api_key = {"BearerToken": "Bearer t"}
        return loaded

    return Kube(ApiServer(Credentials.from_configuration(configuration, None)))


@pytest.mark.parametrize(("answer", "unanswered"), [(500, True), (503, True), (504, True), (409, False)])
def test_a_5xx_to_a_status_patch_is_unanswered_and_any_other_refusal_an_api_error(
    server: GatewayTimeoutServer, answer: int, unanswered: bool
) -> None:
    server.patch_answer = answer

    async def scenario() -> BaseException | None:
        kube = kube_of(server)
        try:
            await kube.patch_status("ns", "job", {"phase": "Rollout"})
        except Exception as err:
            return err
        finally:
            await kube.close()
        return None

    err = asyncio.run(scenario())
    assert isinstance(err, Unanswered if unanswered else ApiError)
    assert not isinstance(err, ApiError) or err.status == answer
    assert not isinstance(err, Unanswered) or err.status == answer


def test_a_connection_that_breaks_twice_is_unanswered_without_a_status(server: GatewayTimeoutServer) -> None:
    server.drop = True

    async def scenario() -> BaseException | None:
        kube = kube_of(server)
        try:
            await kube.patch_status("ns", "job", {"phase": "Rollout"})
        except Exception as err:
            return err
        finally:
            await kube.close()
        return None

    err = asyncio.run(scenario())
    assert isinstance(err, Unanswered) and err.status is None


def test_the_writer_reads_back_a_504_over_http_and_takes_it_as_stored(server: GatewayTimeoutServer) -> None:
    server.job = {"metadata": {"name": "job"}, "status": DRAINING.wire()}  # the 504'd patch landed

    async def scenario() -> bool:
        kube = kube_of(server)
        try:
            return await StatusWriter(kube, "ns", "job", ROLLOUT.wire()).write(DRAINING)
        finally:
            await kube.close()

    assert asyncio.run(scenario()) is True
    path = "/apis/rljob.io/v1alpha1/namespaces/ns/rljobs/job"
    assert server.requests == [("PATCH", f"{path}/status"), ("GET", path)]
