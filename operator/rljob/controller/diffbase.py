"""kopf's diff base for this operator's resources, built without copying what kopf throws away.

On every watch event kopf builds the object's essence (what its change handlers compare) by deep-copying the
whole body and then deleting `status` and `metadata` (DiffBaseStorage.build in
kopf/_cogs/configs/diffbase.py@1.45.2). Here that is a job's status, pods list and all, on each of its status
writes, and every pod event's managedFields (measured in docs/benchmarks.md at commit 6702d4b). The essence
is the same when built from the body without them: of the metadata kopf reads back only labels and
annotations (and ownerReferences, for its key names). A handler that asks for extra fields gets kopf's own
build.

Pods and Kueue Workloads get no essence at all. kopf builds one for every watch event and then clears it of
its progress annotations (kopf/_core/reactor/processing.py:179-181@1.45.2) whatever the resource's handlers,
but only change handlers and daemons read it, and these two have event handlers only
(controller/handlers.py). None is kopf's own "no essence" (processing.py:180-181)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import kopf

from rljob.controller import queueing

# What kopf's build reads of the metadata: cherry-picked labels and annotations, and the owner references
# its key names look at (StorageKeyMarkingConvention.mark_key in kopf/_cogs/configs/conventions.py@1.45.2).
KEPT_METADATA = ("name", "namespace", "labels", "annotations", "ownerReferences")
WATCHED_ONLY = {("v1", "Pod"), (queueing.GROUP, "Workload")}  # (group, or the core version; kind)


def _watched_only(body: kopf.Body) -> bool:
    api_version = str(body.get("apiVersion") or "")
    return (api_version.split("/")[0], body.get("kind")) in WATCHED_ONLY


class LeanDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def build(self, *, body: kopf.Body, extra_fields: Iterable[Any] | None = None) -> kopf.BodyEssence:
        if _watched_only(body):
            return None  # type: ignore[return-value]
        fields = list(extra_fields or ())
        if fields:  # they may be in the status: the whole body
            return super().build(body=body, extra_fields=fields)
        meta = body.get("metadata") or {}
        lean: dict[str, Any] = {k: v for k, v in body.items() if k not in ("status", "metadata")}
        lean["metadata"] = {k: meta[k] for k in KEPT_METADATA if k in meta}
        return super().build(body=kopf.Body(cast(kopf.RawBody, lean)), extra_fields=fields)
