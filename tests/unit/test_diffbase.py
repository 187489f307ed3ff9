"""The lean diff base (controller/diffbase.py) builds the very essence kopf's own does, for a job with a
big status, without deep-copying the status; and none for the pods and Workloads that only event handlers
watch, which kopf's own cause detection takes."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import kopf
from kopf._cogs.structs import bodies, patches, references
from kopf._core.actions import loggers
from kopf._core.engines import indexing
from kopf._core.intents import registries
from kopf._core.reactor import inventory, processing

from rljob.controller import handlers, queueing
from rljob.controller.diffbase import LeanDiffBaseStorage

ARGS = {"prefix": "rljob.io", "key": "last-handled-configuration"}


def job(pods: int) -> dict[str, Any]:
    return {
        "apiVersion": "rljob.io/v1alpha1",
        "kind": "RLJob",
        "metadata": {
            "name": "job",
            "namespace": "ns",
            "uid": "u-1",
            "resourceVersion": "42",
            "generation": 3,
            "labels": {"team": "rl"},
            "annotations": {
                "rljob.io/last-handled-configuration": '{"spec": {"replicas": 1}}',
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
                "note": "kept",
            },
            "finalizers": ["kopf.zalando.org/KopfFinalizerMarker"],
            "managedFields": [{"manager": "kopf", "fieldsV1": {"f:status": {}}}],
        },
        "spec": {"replicas": pods, "template": {"spec": {"containers": [{"name": "sglang"}]}}},
        "status": {
            "phase": "Rollout",
            "pods": [{"name": f"job-{i}", "stage": "Serving"} for i in range(pods)],
        },
    }


def pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "job-0",
            "namespace": "ns",
            "labels": {"rljob.io/job": "job"},
            "ownerReferences": [{"kind": "RLJob", "name": "job", "uid": "u-1"}],
            "managedFields": [{"manager": "kubelet"}] * 20,
        },
        "spec": {"containers": [{"name": "sglang", "image": "x"}], "nodeName": "node-0"},
        "status": {"phase": "Running", "podIP": "10.0.0.1"},
    }


def workload() -> dict[str, Any]:
    return {
        "apiVersion": f"{queueing.GROUP}/{queueing.VERSION}",
        "kind": "Workload",
        "metadata": {"name": "job-w", "namespace": "ns", "labels": {"rljob.io/job": "job"}},
        "spec": {"queueName": "q"},
    }


def test_the_essence_is_kopfs_own() -> None:
    kindless = {k: v for k, v in pod().items() if k != "kind"}  # not known to be a pod: built
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    for raw in (job(512), kindless, config_map):
        ours = LeanDiffBaseStorage(**ARGS).build(body=kopf.Body(copy.deepcopy(raw)))
        theirs = kopf.AnnotationsDiffBaseStorage(**ARGS).build(body=kopf.Body(copy.deepcopy(raw)))
        assert ours == theirs
        assert "status" not in ours


def test_extra_fields_get_kopfs_own_build() -> None:
    raw = job(2)
    ours = LeanDiffBaseStorage(**ARGS).build(body=kopf.Body(raw), extra_fields=["status.phase"])
    theirs = kopf.AnnotationsDiffBaseStorage(**ARGS).build(body=kopf.Body(raw), extra_fields=["status.phase"])
    assert ours == theirs and ours["status"] == {"phase": "Rollout"}


def test_the_status_is_not_copied(monkeypatch: Any) -> None:
    copied: list[Any] = []
    real = copy.deepcopy

    def spy(obj: Any, memo: Any = None) -> Any:
        copied.append(obj)
        return real(obj, memo)

    monkeypatch.setattr(copy, "deepcopy", spy)
    raw = job(64)
    LeanDiffBaseStorage(**ARGS).build(body=kopf.Body(raw))
    assert copied and not any(isinstance(c, dict) and "status" in c for c in copied)
    copied.clear()
    kopf.AnnotationsDiffBaseStorage(**ARGS).build(body=kopf.Body(raw))
    assert any(isinstance(c, dict) and "status" in c for c in copied)  # what the lean build avoids


def test_pods_and_workloads_get_no_essence_and_kopf_detects_their_events_without_one() -> None:
    storage = LeanDiffBaseStorage(**ARGS)
    assert storage.build(body=kopf.Body(pod())) is None
    assert storage.build(body=kopf.Body(workload())) is None
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings, memo=kopf.Memo(kube=object(), options=object()))
    assert isinstance(settings.persistence.diffbase_storage, LeanDiffBaseStorage)
    for raw, plural in ((pod(), "pods"), (workload(), queueing.PLURAL)):
        group, _, version = raw["apiVersion"].rpartition("/")
        resource = references.Resource(group, version, plural, namespaced=True, kind=raw["kind"])

        async def detect(raw: dict[str, Any] = raw, resource: references.Resource = resource) -> Any:
            body = bodies.Body(raw)
            logger = loggers.LocalObjectLogger(body=body, settings=settings)
            return processing._detect_causes(  # what kopf 1.45.2 runs on every watch event
                indexers=indexing.OperatorIndexers(), registry=registries.get_default_registry(),
                settings=settings, resource=resource, raw_event={"type": "MODIFIED", "object": raw},
                body=body, patch=patches.Patch(), memory=inventory.ResourceMemory(),
                local_logger=logger, event_logger=logger,
            )  # fmt: skip

        found = asyncio.run(detect())
        assert found.watching_cause is not None  # controller/handlers.py's event handler runs
        assert found.changing_cause is None and found.spawning_cause is None
