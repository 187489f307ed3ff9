"""The pods of one RLJob, kept from the operator's pod watch (controller/handlers.py) instead of listed
and parsed whole every round. A list fills the
cache at the start, after a create that found its pod already there, and now and then as a resync (a
watch that reconnected does not report the deletions it missed).

Each pod is kept as the little the conductor reads (name, uid, IP, the lifecycle machine's
PodObservation), not as its JSON. Lists and watch events can arrive out of
order (a list served from the API server's watch cache may be older than an event already seen), so an
object replaces the cached one only when its resourceVersion is newer, and a deleted uid never comes
back from a stale list. resourceVersions are compared as integers: what etcd's revisions are, and what
kube-apiserver hands out; one that is not an integer always counts as newer.

A change of readiness alone is kept but wakes nobody: readiness decides nothing in the lifecycle (only
status.ready and readyReplicas, which the status writer coalesces anyway), and probes that time out on a
loaded node flip it all the time. The next decision, at the latest the quiet one (controller/conductor.py
QUIET_SECONDS), counts them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rljob.controller.observe import pod_ip, pod_observation
from rljob.lifecycle.model import PodObservation


def _version(raw: Any) -> int | None:
    try:
        return int(raw)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class CachedPod:
    name: str
    uid: str
    version: int | None  # metadata.resourceVersion
    ip: str | None
    observation: PodObservation

    @classmethod
    def of(cls, pod: dict[str, Any]) -> CachedPod:
        meta = pod["metadata"]
        version = _version(meta.get("resourceVersion"))
        return cls(meta["name"], meta["uid"], version, pod_ip(pod), pod_observation(pod))

    def seen_as(self, other: CachedPod) -> bool:
        """The same as far as the conductor can tell (only the resourceVersion may differ)."""
        return replace(self, version=other.version) == other

    def seen_as_but_ready(self, other: CachedPod) -> bool:
        """The same but for its readiness (and resourceVersion)."""
        observation = replace(self.observation, ready=other.observation.ready)
        return replace(self, version=other.version, observation=observation) == other


def _newer(new: CachedPod, old: CachedPod) -> bool:
    if new.version is None or old.version is None:
        return True
    return new.version > old.version


class PodCache:
    def __init__(self) -> None:
        self._pods: dict[str, CachedPod] = {}
        self._gone: dict[str, int | None] = {}  # uid -> resourceVersion it was deleted at
        self._deleted: set[str] = set()  # uids this operator asked to delete
        self._observations: tuple[PodObservation, ...] | None = ()
        self.version = 0  # moves whenever what the conductor reads of the pods changes, but readiness
        self.readiness_changes = 0  # moves when readiness alone changed
        self.listed_once = False

    def __len__(self) -> int:
        return len(self._pods)

    def pods(self) -> list[CachedPod]:
        return [self._pods[name] for name in sorted(self._pods)]

    def observations(self) -> tuple[PodObservation, ...]:
        if self._observations is None:
            self._observations = tuple(p.observation for p in self.pods())
        return self._observations

    def uid(self, name: str) -> str | None:
        pod = self._pods.get(name)
        return pod.uid if pod is not None else None

    def _changed(self) -> None:
        self.version += 1
        self._observations = None

    def _drop(self, name: str, version: int | None) -> None:
        pod = self._pods.pop(name)
        self._gone[pod.uid] = version
        self._deleted.discard(pod.uid)
        self._changed()

    def seen(self, raw: dict[str, Any], deleted: bool = False) -> bool:
        """A watch event (or a listed or created pod); True when the conductor should look again."""
        pod = CachedPod.of(raw)
        old = self._pods.get(pod.name)
        if deleted:
            if old is not None and old.uid == pod.uid:
                self._drop(pod.name, pod.version)
                return True
            self._gone[pod.uid] = pod.version
            return False
        if pod.uid in self._gone or (old is not None and not _newer(pod, old)):
            return False
        self._pods[pod.name] = pod
        if old is not None and old.seen_as(pod):
            return False
        if old is not None and old.seen_as_but_ready(pod):
            self._observations = None  # counted by the next decision, which it does not ask for
            self.readiness_changes += 1
            return False
        if old is not None and old.uid != pod.uid:
            self._deleted.discard(old.uid)
        self._changed()
        return True

    def listed(self, items: list[dict[str, Any]], resource_version: str | None) -> bool:
        """A full list at `resource_version`: cached pods it lacks and that are not newer are gone."""
        self.listed_once = True
        changed = False
        names = set()
        for raw in items:
            names.add(raw["metadata"]["name"])
            changed = self.seen(raw) or changed
        at = _version(resource_version)
        for name, pod in list(self._pods.items()):
            if name not in names and (at is None or pod.version is None or pod.version <= at):
                self._drop(name, at)
                changed = True
        if at is not None:  # a later list is at least as new as this one: older tombstones are moot
            self._gone = {uid: v for uid, v in self._gone.items() if v is None or v > at}
        return changed

    def deleting(self, name: str, uid: str | None) -> None:
        """This operator deleted the pod: it counts as terminating until the watch says more, and is
        not deleted again."""
        pod = self._pods.get(name)
        if pod is None or (uid is not None and pod.uid != uid):
            return
        self._deleted.add(pod.uid)
        self._pods[name] = replace(pod, observation=replace(pod.observation, deleting=True))
        self._changed()

    def deleted_by_us(self, name: str) -> bool:
        pod = self._pods.get(name)
        return pod is not None and pod.uid in self._deleted
