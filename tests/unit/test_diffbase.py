"""The lean diff base (controller/diffbase.py) builds the very essence kopf's own does, for a job with a
big status and for a pod with managedFields, without deep-copying the status."""

from __future__ import annotations

import copy
from typing import Any

import kopf

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


def test_the_essence_is_kopfs_own() -> None:
    for raw in (job(512), pod(), {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}):
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
