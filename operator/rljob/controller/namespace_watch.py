"""kopf keeps watching a namespace that is being deleted until the namespace is gone.

With `--namespace`, kopf runs one watch per namespace and stops it when it believes the namespace is
gone: marked for deletion, with status conditions, none of them True (kopf/_core/reactor/observation.py
`is_deleted`, kopf 1.45). Kubernetes 1.34 deletes a namespace's pods first (OrderedNamespaceDeletion,
KEP-5080) and, while they terminate, writes the namespace's deletion conditions all False
(kubernetes/kubernetes#138208). kopf then stops watching RLJobs and pods there while the RLJob still
exists, never sees it marked for deletion, never stops its daemon nor runs its finalizer handler, and
the namespace waits for kopf's finalizer forever (and a restarted operator does not watch a namespace
that is terminating at all). Here a namespace counts as gone only when the API server reports it
DELETED. A DELETED event that a reconnecting watch missed leaves a watch on a namespace that does not
exist: it sees nothing, and serves the namespace again if one of that name is created.

Cluster-wide (`--all-namespaces`) kopf watches no namespace on its own and this changes nothing."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)


def namespace_gone(raw_event: Mapping[str, Any]) -> bool:
    """Only a namespace the API server deleted is gone: one marked for deletion still holds objects
    whose finalizers must run."""
    return raw_event.get("type") == "DELETED"


def keep_watching_terminating_namespaces() -> bool:
    """Make kopf's namespace observation use `namespace_gone`; False (and a warning) when this kopf has no
    such hook, so that an upgrade that moved it is noticed (tests/unit/test_namespace_watch.py)."""
    try:
        from kopf._core.reactor import observation
    except ImportError:
        observation = None  # type: ignore[assignment]
    if not callable(getattr(observation, "is_deleted", None)):
        log.warning(
            "kopf has no observation.is_deleted: a namespace being deleted may stop being watched before "
            "the finalizers of its RLJobs ran (controller/namespace_watch.py)"
        )
        return False
    observation.is_deleted = namespace_gone
    return True
