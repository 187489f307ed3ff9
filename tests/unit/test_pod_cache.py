"""The conductor's pods come from the pod watch, not from a list per round (controller/pod_cache.py):
events and lists merge by resourceVersion, a deleted uid never comes back from a stale list, and the
conductor itself (a fake Kube, the real decide) creates each pod once, deletes each pod once and by its
uid, and does not spin when nothing changes."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from test_conductor_refusals import FakeKube, body

from rljob.controller import conductor as conductor_module
from rljob.controller.children import LABEL_GANG, LABEL_INDEX, LABEL_JOB
from rljob.controller.conductor import Conductor, ConductorOptions
from rljob.controller.kube import PodList
from rljob.controller.pod_cache import PodCache


def pod(
    name: str, uid: str, rv: int, phase: str = "Pending", index: int = 0, gang: int = 0, **meta: Any
) -> dict:
    return {
        "metadata": {
            "name": name, "uid": uid, "resourceVersion": str(rv),
            "labels": {LABEL_JOB: "demo", LABEL_INDEX: str(index), LABEL_GANG: str(gang)}, **meta,
        },
        "status": {"phase": phase, "podIP": "127.0.0.9" if phase == "Running" else None},
    }  # fmt: skip


def test_an_older_object_never_replaces_a_newer_one() -> None:
    cache = PodCache()
    assert cache.seen(pod("a", "u1", 5, "Running"))
    assert not cache.seen(pod("a", "u1", 4, "Pending"))  # a list served from an older cache
    assert cache.observations()[0].running
    assert not cache.seen(pod("a", "u1", 6, "Running"))  # newer, but nothing the conductor reads moved
    assert cache.pods()[0].version == 6
    assert cache.seen(pod("a", "u1", 7, "Running", deletionTimestamp="2026-01-01T00:00:00Z"))
    assert cache.observations()[0].deleting and not cache.observations()[0].running


def ready(p: dict, ok: bool = True) -> dict:
    p["status"]["conditions"] = [{"type": "Ready", "status": "True" if ok else "False"}]
    return p


def test_a_change_of_readiness_alone_is_kept_but_asks_for_no_decision() -> None:
    cache = PodCache()
    assert cache.seen(pod("a", "u1", 5, "Running"))
    version = cache.version
    assert not cache.seen(ready(pod("a", "u1", 6, "Running")))
    assert cache.version == version and cache.observations()[0].ready  # the next decision counts it
    assert not cache.seen(ready(pod("a", "u1", 7, "Running"), ok=False))
    assert not cache.observations()[0].ready
    assert cache.seen(ready(pod("a", "u1", 8, "Failed")))  # readiness and more: a decision
    assert cache.version > version and cache.observations()[0].ready


def test_a_deleted_uid_does_not_come_back_from_a_stale_list() -> None:
    cache = PodCache()
    cache.seen(pod("a", "u1", 5))
    version = cache.version
    assert cache.seen(pod("a", "u1", 9), deleted=True)
    assert len(cache) == 0 and cache.version > version
    assert not cache.listed([pod("a", "u1", 5)], "8")  # listed before the deletion
    assert len(cache) == 0
    assert cache.seen(pod("a", "u2", 12))  # the name's next incarnation
    assert cache.uid("a") == "u2"


def test_a_list_drops_what_it_lacks_unless_the_cache_knows_newer() -> None:
    cache = PodCache()
    cache.seen(pod("old", "u1", 3))
    cache.seen(pod("new", "u2", 20))  # created after the list below was taken
    assert cache.listed([pod("other", "u3", 4)], "10")
    assert [p.name for p in cache.pods()] == ["new", "other"]


def test_a_pod_this_operator_deleted_is_terminating_until_the_watch_says_more() -> None:
    cache = PodCache()
    cache.seen(pod("a", "u1", 5, "Running"))
    cache.deleting("a", "u2")  # another incarnation: not this one
    assert not cache.deleted_by_us("a")
    cache.deleting("a", "u1")
    assert cache.deleted_by_us("a") and cache.observations()[0].deleting
    assert not cache.seen(pod("a", "u1", 5, "Running"))  # the same version again changes nothing
    assert cache.deleted_by_us("a")
    cache.seen(pod("a", "u1", 6, "Running"), deleted=True)
    assert not cache.deleted_by_us("a") and len(cache) == 0


class ListingKube(FakeKube):
    """FakeKube with a pod store: create answers the stored object (uid, resourceVersion), deletes are
    recorded with their uid."""

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[str, dict[str, Any]] = {}
        self.lists = 0
        self.deleted: list[tuple[str, str | None]] = []
        self._rv = itertools.count(100)

    async def list_pods(self, namespace: str, job: str) -> PodList:
        self.lists += 1
        return PodList(list(self.store.values()), str(next(self._rv)))

    async def create(self, namespace: str, manifest: dict[str, Any], *, dry_run: bool = False) -> Any:
        await super().create(namespace, manifest, dry_run=dry_run)
        if manifest["kind"] != "Pod" or dry_run:
            return {"metadata": manifest["metadata"]}
        name = manifest["metadata"]["name"]
        if name in self.store:
            return None
        rv = next(self._rv)
        obj = {
            **manifest,
            "metadata": {**manifest["metadata"], "uid": f"uid-{name}-{rv}", "resourceVersion": str(rv)},
        }
        obj["status"] = {"phase": "Pending"}
        self.store[name] = obj
        return obj

    async def delete_pod(self, namespace: str, name: str, uid: str | None = None) -> None:
        self.deleted.append((name, uid))
        if name in self.store and self.store[name]["metadata"]["uid"] == uid:
            del self.store[name]


def counted_decisions(monkeypatch: Any) -> list[Any]:
    """The phase each decision of the real decide was given, in order."""
    decisions: list[Any] = []
    real = conductor_module.decide

    def counting(*args: Any) -> Any:
        decisions.append(args[1].phase)
        return real(*args)

    monkeypatch.setattr(conductor_module, "decide", counting)
    return decisions


def test_the_conductor_creates_and_deletes_each_pod_once_and_waits_when_nothing_changes(
    monkeypatch: Any,
) -> None:
    kube = ListingKube()
    decisions = counted_decisions(monkeypatch)
    job = body()
    job["spec"]["replicas"] = 2
    conductor = Conductor(kube, job, ConductorOptions(tick_seconds=30))  # type: ignore[arg-type]

    async def scenario() -> None:
        stop = False
        task = asyncio.create_task(conductor.run(lambda: stop))
        await asyncio.sleep(0.3)
        pods = [c for c in kube.created if c[0] == "Pod" and not c[2]]
        assert len(pods) == 2, kube.created  # created once: the cache holds what create answered
        settled = len(decisions)
        assert settled <= 4, decisions
        await asyncio.sleep(0.3)
        assert len(decisions) == settled  # no livelock: nothing changed, nothing decided
        assert kube.lists == 1  # one list at the start, none per round

        # A leftover of an earlier gang appears through the watch: deleted once, by its uid.
        conductor.pod_seen(pod("demo-9", "uid-leftover", 500, index=0, gang=7))
        await asyncio.sleep(0.3)
        assert kube.deleted == [("demo-9", "uid-leftover")], kube.deleted
        # Another event for it (still there, not yet deleted) sends no second delete.
        conductor.pod_seen(pod("demo-9", "uid-leftover", 501, index=0, gang=7))
        await asyncio.sleep(0.3)
        assert kube.deleted == [("demo-9", "uid-leftover")], kube.deleted

        # A gang pod vanishes (its DELETED event): the conductor sees it at once and acts.
        gone = kube.store.pop("demo-0")
        before = len(decisions)
        conductor.pod_seen(gone, deleted=True)
        await asyncio.sleep(0.3)
        assert len(decisions) > before
        assert [c for c in kube.created if c == ("Pod", "demo-0", False)] == [("Pod", "demo-0", False)] * 2
        assert kube.lists == 1
        stop = True
        conductor.poke()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())


def one_pod_conductor(
    monkeypatch: Any, options: ConductorOptions, **spec: Any
) -> tuple[ListingKube, list[Any], Conductor]:
    """A conductor of a one-pod job (spec fields as given) over a ListingKube, its decisions counted."""
    kube = ListingKube()
    decisions = counted_decisions(monkeypatch)
    job = body()
    job["spec"] |= {"replicas": 1, **spec}
    return kube, decisions, Conductor(kube, job, options)  # type: ignore[arg-type]


def test_a_readiness_flip_waits_for_the_quiet_decision_and_is_then_counted(monkeypatch: Any) -> None:
    """A pod whose probe flips asks for no decision of its own; the next one (here the quiet decision,
    due with nothing observed) counts it, and the status says so. A pod that starts running is decided on
    at once."""
    monkeypatch.setattr("rljob.controller.status_writer.PROGRESS_ONLY_SECONDS", 0.0)
    options = ConductorOptions(tick_seconds=0.1, quiet_seconds=1.0)
    kube, decisions, conductor = one_pod_conductor(monkeypatch, options)

    async def scenario() -> None:
        stop = False
        task = asyncio.create_task(conductor.run(lambda: stop))
        await asyncio.sleep(0.3)
        created = kube.store["demo-0"]
        uid, rv = created["metadata"]["uid"], int(created["metadata"]["resourceVersion"])
        running = {**created, "metadata": {**created["metadata"], "resourceVersion": str(rv + 1)}}
        running["status"] = {"phase": "Running", "podIP": "127.0.0.9"}
        before = len(decisions)
        conductor.pod_seen(running)
        await asyncio.sleep(0.1)
        assert len(decisions) > before  # it runs now: decided at once
        settled = len(decisions)
        flipped = {**running, "metadata": {**running["metadata"], "resourceVersion": str(rv + 2)}}
        conductor.pod_seen(ready(flipped))
        assert conductor.pods.uid("demo-0") == uid
        await asyncio.sleep(0.1)
        assert len(decisions) == settled  # readiness alone: no decision of its own
        assert kube.status.get("readyReplicas", 0) == 0
        await asyncio.sleep(1.2)  # the quiet decision counts it
        assert len(decisions) > settled
        assert kube.status["readyReplicas"] == 1 and kube.status["ready"] == "1/1", kube.status
        stop = True
        conductor.poke()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())


def test_with_nothing_observed_the_conductor_decides_at_the_next_deadline(monkeypatch: Any) -> None:
    """Time alone changes a decision only at its next_due: the conductor sleeps until then, neither a
    heartbeat's worth of decisions before (quiet_seconds is far off here) nor late. A gang the kubelet
    never starts stays Pending past phaseTimeoutSeconds.initializing (1 s) and is restarted then."""
    options = ConductorOptions(tick_seconds=30, quiet_seconds=30)
    kube, decisions, conductor = one_pod_conductor(
        monkeypatch, options, phaseTimeoutSeconds={"initializing": 1}
    )

    async def scenario() -> None:
        stop = False
        task = asyncio.create_task(conductor.run(lambda: stop))
        await asyncio.sleep(0.5)
        assert kube.store and kube.status.get("phase") == "Pending", kube.status
        settled = len(decisions)
        await asyncio.sleep(0.3)
        assert len(decisions) == settled  # nothing observed, nothing due yet
        await asyncio.sleep(1.2)  # past the deadline (the phase began within the first 0.5 s)
        assert kube.status.get("restarts") == 1, kube.status
        assert kube.deleted, "the gang that timed out is deleted"
        stop = True
        conductor.poke()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
