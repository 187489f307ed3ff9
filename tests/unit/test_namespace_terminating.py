"""Deleting a namespace that holds a running RLJob (docs/control-plane.md, "Deleting a namespace"): a create
refused because the namespace is being terminated is NamespaceTerminating, not a crash; a conductor stops
on it and on the RLJob's deletionTimestamp; kopf keeps watching a namespace until it is really gone."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kopf._cogs.structs.references import Insights
from kopf._core.reactor import observation
from test_conductor_refusals import INVALID_PULL_POLICY, FakeKube, body

from rljob.controller.conductor import Conductor, ConductorOptions
from rljob.controller.kube import ChildRefused, Kube, NamespaceTerminating
from rljob.controller.namespace_watch import keep_watching_terminating_namespaces
from rljob.kubeclient.apiserver import ApiError

NS = "ns"
# What kube-apiserver v1.34.4 answered the operator in the e2e test (the NamespaceLifecycle plugin).
TERMINATING = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Failure",
    "message": 'pods "demo-0" is forbidden: unable to create new content in namespace ns because it is being '
    "terminated",
    "reason": "Forbidden",
    "details": {
        "name": "demo-0",
        "kind": "pods",
        "causes": [
            {
                "reason": "NamespaceTerminating",
                "message": "namespace ns is being terminated",
                "field": "metadata.namespace",
            }
        ],
    },
    "code": 403,
}
RBAC = {
    "kind": "Status",
    "status": "Failure",
    "message": 'pods is forbidden: User "u" cannot create resource "pods" in API group "" in the namespace '
    '"ns"',
    "reason": "Forbidden",
    "details": {"kind": "pods"},
    "code": 403,
}


def api_error(status: int, answer: dict[str, Any] | str) -> ApiError:
    reason = "Forbidden" if status == 403 else "Error"
    return ApiError(status, reason, answer if isinstance(answer, str) else json.dumps(answer))


class RefusingServer:
    """The API server's side of kubeclient/apiserver.py, answering every call with `err`."""

    def __init__(self, err: ApiError) -> None:
        self.err = err

    async def call(self, verb: str, method: str, path: str, *args: Any, **kwargs: Any) -> bytes:
        raise self.err


def create_pod(err: ApiError) -> Any:
    kube = Kube(RefusingServer(err))  # type: ignore[arg-type]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "demo-0"}, "spec": {"containers": []}}
    return asyncio.run(kube.create(NS, pod))


@pytest.mark.parametrize(
    "answer",
    [
        TERMINATING,
        {**TERMINATING, "details": {}},  # the message alone says so
        {**TERMINATING, "message": "forbidden"},  # the cause alone says so
        "unable to create new content in namespace ns because it is being terminated",  # not JSON
    ],
)
def test_a_create_refused_because_the_namespace_is_terminating_raises_namespace_terminating(
    answer: dict[str, Any] | str,
) -> None:
    with pytest.raises(NamespaceTerminating, match="Pod demo-0: namespace ns is being terminated"):
        create_pod(api_error(403, answer))


def test_other_refusals_keep_their_meaning() -> None:
    with pytest.raises(ApiError) as raised:  # RBAC: a misconfigured operator, not a namespace going
        create_pod(api_error(403, RBAC))
    assert not isinstance(raised.value, NamespaceTerminating) and raised.value.status == 403
    assert create_pod(api_error(409, {"reason": "AlreadyExists", "code": 409})) is None
    with pytest.raises(ChildRefused):
        create_pod(api_error(422, INVALID_PULL_POLICY))


class TerminatingKube(FakeKube):
    """The namespace is being deleted from the first create of `kind` (a dry run or not) on."""

    def __init__(self, kind: str, dry_run: bool) -> None:
        super().__init__()
        self.refuse = (kind, dry_run)
        self.refused: list[str] = []

    async def create(self, namespace: str, manifest: dict[str, Any], *, dry_run: bool = False) -> bool:
        kind, name = manifest["kind"], manifest["metadata"]["name"]
        if (kind, dry_run) == self.refuse or self.refused:
            self.refused.append(name)
            raise NamespaceTerminating(f"{kind} {name}: namespace {namespace} is being terminated")
        return await super().create(namespace, manifest, dry_run=dry_run)


def run(kube: FakeKube, job: dict[str, Any]) -> None:
    conductor = Conductor(kube, job, ConductorOptions(tick_seconds=0.01))  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(conductor.run(lambda: False), 5))  # returns on its own, or times out


@pytest.mark.parametrize(
    ("kind", "dry_run"),
    [("Secret", False), ("Pod", True), ("Pod", False)],
    ids=["token-secret", "pod-dry-run", "gang-pods"],
)
def test_a_conductor_whose_namespace_is_terminating_stops_without_raising(kind: str, dry_run: bool) -> None:
    kube = TerminatingKube(kind, dry_run)
    run(kube, body())
    assert kube.refused and len(set(kube.refused)) == len(kube.refused), kube.refused  # nothing retried
    assert not [c for c in kube.created if c[0] == "Pod" and not c[2]]  # no pod was made
    assert kube.events == []


def test_a_conductor_whose_rljob_is_marked_for_deletion_creates_sends_and_writes_nothing() -> None:
    job = body()
    job["metadata"]["deletionTimestamp"] = "2026-12-01T13:28:52Z"
    kube = FakeKube()
    run(kube, job)
    assert kube.created == [] and kube.patches == [] and kube.events == []


NAMESPACE_ALL_FALSE = {
    # What the namespace controller of 1.34 writes while the pods of a namespace being deleted terminate
    # (OrderedNamespaceDeletion): every deletion condition False, the RLJob not deleted yet.
    "metadata": {"name": NS, "deletionTimestamp": "2026-12-01T13:28:52Z"},
    "status": {
        "phase": "Terminating",
        "conditions": [
            {"type": t, "status": "False", "reason": r}
            for t, r in (
                ("NamespaceDeletionDiscoveryFailure", "ResourcesDiscovered"),
                ("NamespaceDeletionGroupVersionParsingFailure", "ParsedGroupVersions"),
                ("NamespaceDeletionContentFailure", "ContentDeleted"),
                ("NamespaceContentRemaining", "ContentRemoved"),
                ("NamespaceFinalizersRemaining", "ContentHasNoFinalizers"),
            )
        ],
    },
}


def watched(events: list[dict[str, Any]], bodies: list[dict[str, Any]] = ()) -> set[Any]:  # type: ignore[assignment]
    insights = Insights()
    insights.namespaces.add(NS)
    observation.revise_namespaces(insights=insights, namespaces=[NS], raw_events=events, raw_bodies=bodies)
    return insights.namespaces


def test_kopf_alone_stops_watching_a_namespace_whose_pods_are_still_terminating() -> None:
    """The cause (kopf 1.45, Kubernetes 1.34). When this fails, kopf decides otherwise now and
    controller/namespace_watch.py may be unnecessary."""
    assert watched([{"type": "MODIFIED", "object": NAMESPACE_ALL_FALSE}]) == set()


def test_a_namespace_being_deleted_stays_watched_until_it_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(observation, "is_deleted", observation.is_deleted)  # restored afterwards
    assert keep_watching_terminating_namespaces()
    assert watched([{"type": "MODIFIED", "object": NAMESPACE_ALL_FALSE}]) == {NS}
    assert watched([], bodies=[NAMESPACE_ALL_FALSE]) == {NS}  # an operator (re)started meanwhile
    assert watched([{"type": "DELETED", "object": NAMESPACE_ALL_FALSE}]) == set()
