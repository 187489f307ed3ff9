"""The operator's Kubernetes calls: every API call the controller makes, and nothing else, as plain JSON
over the shared client (kubeclient/apiserver.py), each counted in rljob_api_calls_total."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import aiohttp

from rljob.api.crd import GROUP, PLURAL, VERSION
from rljob.controller.children import LABEL_JOB, TOKEN_KEY, Refusal, token_secret_name
from rljob.controller.metrics import count_api_call
from rljob.kubeclient.apiserver import MERGE_PATCH, ApiError, ApiServer
from rljob.kubeclient.credentials import Credentials

log = logging.getLogger(__name__)


def api_server(credentials: Credentials | None = None) -> ApiServer:
    """The operator's client: the process's credentials (Credentials.load) unless given; every call
    counted by its verb."""
    return ApiServer(credentials or Credentials.load(), on_call=count_api_call)


class ChildRefused(Exception):
    """The API server refused a child as invalid; retrying the same manifest cannot succeed."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(f"{refusal.kind} {refusal.name}: {refusal.message}")
        self.refusal = refusal


def _refusal(manifest: dict[str, Any], err: ApiError) -> Refusal | None:
    """A Refusal for 422 Invalid, or 400 BadRequest (a body that does not decode); else None."""
    if err.status not in (400, 422):
        return None
    name = manifest["metadata"].get("name", "")
    return Refusal.from_status(manifest["kind"], name, err.status_object(), manifest)


class NamespaceTerminating(Exception):
    """The API server refused to create an object because its namespace is being deleted (403 from the
    NamespaceLifecycle admission plugin): everything in it, the RLJob too, is going, so there is nothing
    left to create or to conduct."""


def _namespace_terminating(err: ApiError) -> bool:
    """403 Forbidden with cause NamespaceTerminating, or the message '... because it is being
    terminated' (what the admission plugin answers); an RBAC 403 is not this."""
    if err.status != 403:
        return False
    status = err.status_object()
    causes = (status.get("details") or {}).get("causes") or []
    if any(isinstance(c, dict) and c.get("reason") == "NamespaceTerminating" for c in causes):
        return True
    return "because it is being terminated" in str(status.get("message") or "")


class Unanswered(Exception):
    """The API server said nothing of the call's outcome: it answered 5xx, or the connection broke, or the
    call timed out, perhaps after the request was sent. A write may or may not have been applied.
    `status`: the HTTP status of the answer, None when none came."""

    def __init__(self, verb: str, status: int | None, detail: str) -> None:
        super().__init__(f"{verb}: HTTP {status} {detail}" if status else f"{verb}: no answer ({detail})")
        self.status = status


@contextlib.contextmanager
def _unanswered(verb: str) -> Iterator[None]:
    """A 5xx answer, a broken connection and a timeout raise Unanswered; any other answer as it is."""
    try:
        yield
    except ApiError as err:
        if err.status < 500:
            raise
        raise Unanswered(verb, err.status, err.reason) from err
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as err:
        raise Unanswered(verb, None, repr(err)) from err


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


class Kube:
    """`Kube()`: the operator's client with the credentials of the process (`api_server()`)."""

    def __init__(self, server: ApiServer | None = None) -> None:
        self.server = server or api_server()

    async def close(self) -> None:
        await self.server.close()

    # --- pods ----------------------------------------------------------------------------------

    async def list_pods(self, namespace: str, job: str) -> PodList:
        answer = await self.server.call(
            "list_pods",
            "GET",
            f"/api/v1/namespaces/{namespace}/pods",
            # From the watch cache, not a quorum read (which waits for etcd progress). A slightly stale
            # list only delays a decision: a create that raced gets 409, deletes carry the uid (below),
            # and agent state, not this list, gates every engine call.
            query={"labelSelector": f"{LABEL_JOB}={job}", "resourceVersion": "0"},
        )
        body = json.loads(answer)
        return PodList([_slim(p) for p in body["items"]], (body.get("metadata") or {}).get("resourceVersion"))

    async def create(
        self, namespace: str, manifest: dict[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any] | None:
        """Create a child: the object as the API server stored it (managedFields left out), None when it
        already exists (a restarted operator may repeat itself). `dry_run`: the API server validates and
        admits it, and stores nothing. Raises ChildRefused when the API server refuses it as invalid,
        NamespaceTerminating when its namespace is being deleted."""
        kind = manifest["kind"]
        plural = {"Pod": "pods", "Secret": "secrets", "Service": "services"}[kind]
        verb = f"create_{kind.lower()}{'_dry_run' if dry_run else ''}"
        try:
            answer = await self.server.call(
                verb,
                "POST",
                f"/api/v1/namespaces/{namespace}/{plural}",
                manifest,
                query={"dryRun": "All"} if dry_run else None,
            )
        except ApiError as err:
            if err.status == 409:
                return None
            if _namespace_terminating(err):
                what = f"{kind} {manifest['metadata'].get('name', '')}"
                raise NamespaceTerminating(f"{what}: namespace {namespace} is being terminated") from None
            refusal = _refusal(manifest, err)
            if refusal is not None:
                raise ChildRefused(refusal) from None
            raise
        return _slim(json.loads(answer))

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> None:
        """Grace 0: the gang is being torn down. With `uid`, only that incarnation of the name is
        deleted, never a successor created since the (possibly cached) list was taken."""
        options: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0}
        if uid:
            options["preconditions"] = {"uid": uid}
        try:
            await self.server.call(
                "delete_pod", "DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", options
            )
        except ApiError as err:
            if err.status not in (404, 409):  # 409: the precondition failed, it is another pod now
                raise

    async def delete_named(self, namespace: str, kind: str, name: str) -> None:
        plural = {"Secret": "secrets", "Service": "services"}[kind]
        try:
            await self.server.call(
                f"delete_{kind.lower()}", "DELETE", f"/api/v1/namespaces/{namespace}/{plural}/{name}"
            )
        except ApiError as err:
            if err.status != 404:
                raise

    async def read_token(self, namespace: str, job: str) -> str | None:
        path = f"/api/v1/namespaces/{namespace}/secrets/{token_secret_name(job)}"
        secret = await self._read("read_secret", path)
        return None if secret is None else base64.b64decode(secret["data"][TOKEN_KEY]).decode()

    async def _read(self, verb: str, path: str) -> dict[str, Any] | None:
        """GET an object; None when it is not there (404)."""
        try:
            return dict(json.loads(await self.server.call(verb, "GET", path)))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    # --- the RLJob -----------------------------------------------------------------------------

    async def read_status(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The RLJob's status as the API server has it now ({} for none); None when the RLJob is gone.
        A consistent read (no resourceVersion): kopf's body of a job can be transitions behind. Raises
        Unanswered for a 5xx, a broken connection or a timeout."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
        with _unanswered("read_rljob"):
            job = await self._read("read_rljob", path)
        return None if job is None else dict(job.get("status") or {})

    async def patch_status(self, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A JSON merge patch of the status subresource; the answer, the whole RLJob, is not read. Raises
        Unanswered when the API server may or may not have applied it (a 5xx, a broken connection, a
        timeout), ApiError for any other refusal."""
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        with _unanswered("patch_status"):
            await self.server.call("patch_status", "PATCH", path, {"status": patch}, content_type=MERGE_PATCH)

    async def delete_job(self, namespace: str, name: str) -> None:
        try:
            await self.server.call(
                "delete_rljob", "DELETE", f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}"
            )
        except ApiError as err:
            if err.status != 404:
                raise

    async def post_event(
        self, namespace: str, job: dict[str, Any], type_: str, reason: str, message: str
    ) -> None:
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
            await self.server.call("create_event", "POST", f"/api/v1/namespaces/{namespace}/events", event)
        except ApiError as err:  # events are best effort: never fail a reconcile for one
            log.warning("event %s not posted: %s", reason, err.reason)
        except (aiohttp.ClientError, TimeoutError) as err:
            log.warning("event %s not posted: %r", reason, err)
