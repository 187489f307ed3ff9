"""The Kubernetes client: every API call the controller makes, and nothing else. Sync client calls run
in threads so the conductors' event loop never blocks; the calls of every iteration (status patches,
events) go over aiohttp in the event loop (DirectCalls)."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from rljob.api.crd import GROUP, PLURAL, VERSION
from rljob.controller.children import LABEL_JOB, TOKEN_KEY, Refusal, token_secret_name
from rljob.controller.metrics import API_CALLS

log = logging.getLogger(__name__)
T = TypeVar("T")


def load_config() -> None:
    """In-cluster when run as the chart's Deployment, else the KUBECONFIG the operator was given."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class ChildRefused(Exception):
    """The API server refused a child as invalid; retrying the same manifest cannot succeed."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"{refusal.kind} {refusal.name}: {refusal.message}")
        self.refusal = refusal


def _refusal(manifest: dict[str, Any], err: ApiException) -> Refusal | None:
    """A Refusal for 422 Invalid, or 400 BadRequest (a body that does not decode); else None."""
    if err.status not in (400, 422):
        return None
    try:
        status = json.loads(err.body or "{}")
    except ValueError:
        status = {"message": str(err.body or err.reason)}
    if not isinstance(status, dict):
        status = {"message": str(status)}
    return Refusal.from_status(manifest["kind"], manifest["metadata"].get("name", ""), status)


class NamespaceTerminating(Exception):
    """The API server refused to create an object because its namespace is being deleted (403 from the
    NamespaceLifecycle admission plugin): everything in it, the RLJob too, is going, so there is nothing
    left to create or to conduct."""


def _namespace_terminating(err: ApiException) -> bool:
    """403 Forbidden with cause NamespaceTerminating, or the message '... because it is being
    terminated' (what the admission plugin answers); an RBAC 403 is not this."""
    if err.status != 403:
        return False
    try:
        status = json.loads(err.body or "{}")
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return "because it is being terminated" in str(err.body or "")
    causes = (status.get("details") or {}).get("causes") or []
    if any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating" for c in causes):
        return True
    return "because it is being terminated" in str(status.get("message") or "")


class PodList(list[dict[str, Any]]):
    """A list of pods and the resourceVersion the API server listed them at."""

    def __init__(self, items: list[dict[str, Any]], resource_version: str | None) -> None:
        super().__init__(items)
        self.resource_version = resource_version


def _slim(obj: dict[str, Any]) -> dict[str, Any]:
    """Without metadata.managedFields: half of a pod's JSON, and nothing the operator reads."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


class DirectCalls:
    """Requests straight to the API server over aiohttp, with the kubernetes client's configuration (the
    server, its CA, the client certificate, the credentials: refreshed as the client would, at most every
    CREDENTIALS_SECONDS). The client's sync call, its `validate_call`, its serialization and the thread hop
    cost ~3 ms of the operator's CPU a call, this ~1.7 ms: at 64 pods the 13 calls of an iteration were
    ~15 % of the operator's CPU (docs/benchmarks.md). The session belongs to the event loop that made it.
    A configuration with a proxy keeps the client's own path (`usable` is False)."""

    CREDENTIALS_SECONDS = 60.0
    TIMEOUT = aiohttp.ClientTimeout(total=60, connect=10)  # the API server's own request timeout is 60 s

    def __init__(self, configuration: client.Configuration) -> None:
        self._config = configuration
        self.usable = not configuration.proxy
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._headers: dict[str, str] = {}
        self._headers_at = float("-inf")

    def _ssl(self) -> ssl.SSLContext:
        c = self._config
        ctx = ssl.create_default_context(cafile=c.ssl_ca_cert)
        if not c.verify_ssl:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        elif c.assert_hostname is False:
            ctx.check_hostname = False
        if c.cert_file:
            ctx.load_cert_chain(c.cert_file, c.key_file)
        return ctx

    def _open(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(
                ssl=self._ssl() if self._config.host.startswith("https") else False
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self.TIMEOUT)
            self._loop = loop
        return self._session

    def _credentials(self) -> dict[str, str]:
        now = time.monotonic()
        if now - self._headers_at >= self.CREDENTIALS_SECONDS:
            auth = self._config.auth_settings()  # runs the refresh hook (a rotated token, an exec plugin)
            self._headers = {
                a["key"]: a["value"] for a in auth.values() if a["in"] == "header" and a["value"]
            }
            self._headers_at = now
        return self._headers

    async def send(self, verb: str, method: str, path: str, body: dict[str, Any], content_type: str) -> None:
        """Counted as `verb` (rljob_api_calls_total, as Kube._call). The answer is read and dropped; >= 400
        raises ApiException, as the client would. A connection that breaks is tried once more on a new one
        (urllib3 retries too): a kept-alive connection the server closed fails the first write."""
        API_CALLS.labels(verb=verb).inc()
        headers = {**self._credentials(), "Content-Type": content_type, "Accept": "application/json"}
        data = json.dumps(body, separators=(",", ":")).encode()
        server_hostname = self._config.tls_server_name or None
        for attempt in (1, 2):
            try:
                async with self._open().request(
                    method,
                    self._config.host + path,
                    data=data,
                    headers=headers,
                    server_hostname=server_hostname,
                ) as resp:
                    answer = await resp.read()
            except aiohttp.ClientConnectionError:
                if attempt == 2:
                    raise
                continue
            if resp.status >= 400:
                err = ApiException(status=resp.status, reason=resp.reason)
                err.body = answer.decode(errors="replace")  # set, not passed: older clients take no `body`
                raise err
            return

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.api = api_client or client.ApiClient()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.direct = DirectCalls(self.api.configuration)

    async def close(self) -> None:
        await self.direct.close()

    async def _call(self, verb: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        API_CALLS.labels(verb=verb).inc()
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _call_raw(self, verb: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> bytes:
        """The answer's body, unparsed: the client's typed models cost more to build than the whole call.
        Read in the thread too, so that the event loop never waits on the socket."""

        def call() -> bytes:
            return bytes(fn(*args, _preload_content=False, **kwargs).data)

        API_CALLS.labels(verb=verb).inc()
        return await asyncio.to_thread(call)

    # --- pods ----------------------------------------------------------------------------------

    async def list_pods(self, namespace: str, job: str) -> PodList:
        result = await self._call_raw(
            "list_pods",
            self.core.list_namespaced_pod,
            namespace,
            label_selector=f"{LABEL_JOB}={job}",
            # From the watch cache: a quorum read waits ~100 ms for etcd progress on every round. A
            # slightly stale list only delays a decision: a create that raced gets 409, deletes carry
            # the uid (below), and agent state, not this list, gates every SGLang call.
            resource_version="0",
        )
        body = json.loads(result)
        return PodList([_slim(p) for p in body["items"]], (body.get("metadata") or {}).get("resourceVersion"))

    async def create(
        self, namespace: str, manifest: dict[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any] | None:
        """Create a child: the object as the API server stored it (managedFields left out), None when it
        already exists (a restarted operator may repeat itself). `dry_run`: the API server validates and
        admits it, and stores nothing. Raises ChildRefused when the API server refuses it as invalid,
        NamespaceTerminating when its namespace is being deleted."""
        kind = manifest["kind"]
        fn = {
            "Pod": self.core.create_namespaced_pod,
            "Secret": self.core.create_namespaced_secret,
            "Service": self.core.create_namespaced_service,
        }[kind]
        extra = {"dry_run": "All"} if dry_run else {}
        verb = f"create_{kind.lower()}{'_dry_run' if dry_run else ''}"
        try:
            return _slim(json.loads(await self._call_raw(verb, fn, namespace, manifest, **extra)))
        except ValidationError as err:  # the client's own models refused the body: nothing was sent
            name = manifest["metadata"].get("name", "")
            raise ChildRefused(Refusal.from_client_errors(kind, name, err.errors())) from None
        except ApiException as err:
            if err.status == 409:
                return None
            if _namespace_terminating(err):
                what = f"{kind} {manifest['metadata'].get('name', '')}"
                raise NamespaceTerminating(f"{what}: namespace {namespace} is being terminated") from None
            refusal = _refusal(manifest, err)
            if refusal is not None:
                raise ChildRefused(refusal) from None
            raise

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> None:
        """Grace 0: the gang is being torn down. With `uid`, only that incarnation of the name is
        deleted, never a successor created since the (possibly cached) list was taken."""
        options = client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid) if uid else None
        )
        try:
            await self._call(
                "delete_pod", self.core.delete_namespaced_pod, name=name, namespace=namespace, body=options
            )
        except ApiException as err:
            if err.status not in (404, 409):  # 409: the precondition failed, it is another pod now
                raise

    async def delete_named(self, namespace: str, kind: str, name: str) -> None:
        fn = {"Secret": self.core.delete_namespaced_secret, "Service": self.core.delete_namespaced_service}[
            kind
        ]
        try:
            await self._call(f"delete_{kind.lower()}", fn, name, namespace)
        except ApiException as err:
            if err.status != 404:
                raise

    async def read_token(self, namespace: str, job: str) -> str | None:
        try:
            secret = await self._call(
                "read_secret", self.core.read_namespaced_secret, token_secret_name(job), namespace
            )
        except ApiException as err:
            if err.status == 404:
                return None
            raise
        return base64.b64decode(secret.data[TOKEN_KEY]).decode()

    # --- the RLJob -----------------------------------------------------------------------------

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A JSON merge patch of the status subresource; the answer, the whole RLJob, is not read."""
        if not self.direct.usable:
            await self._call_raw(
                "patch_status",
                self.custom.patch_namespaced_custom_object_status,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
                {"status": patch},
            )
            return
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        await self.direct.send(
            "patch_status", "PATCH", path, {"status": patch}, "application/merge-patch+json"
        )

    async def delete_job(self, namespace: str, name: str) -> None:
        try:
            await self._call(
                "delete_rljob",
                self.custom.delete_namespaced_custom_object,
                GROUP,
                VERSION,
                namespace,
                PLURAL,
                name,
            )
        except ApiException as err:
            if err.status != 404:
                raise

    async def post_event(
        self, namespace: str, job: dict[str, Any], type_: str, reason: str, message: str
    ) -> None:
        # A plain body and the answer unparsed: the client's typed models cost most of the call (7 events
        # an iteration were 2 ms each at 64 pods, docs/benchmarks.md).
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        meta = job["metadata"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "RLJob",
                "name": meta["name"],
                "namespace": namespace,
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": "rljob-operator"},
            "reportingComponent": "rljob.io/operator",
            "reportingInstance": "rljob-operator",
        }
        try:
            if self.direct.usable:
                await self.direct.send(
                    "create_event",
                    "POST",
                    f"/api/v1/namespaces/{namespace}/events",
                    event,
                    "application/json",
                )
            else:
                await self._call_raw("create_event", self.core.create_namespaced_event, namespace, event)
        except ApiException as err:  # events are best effort: never fail a reconcile for one
            log.warning("event %s not posted: %s", reason, err.reason)
        except (aiohttp.ClientError, TimeoutError) as err:
            log.warning("event %s not posted: %r", reason, err)
