"""kopf's watch-event handlers reach a conductor on the event loop the conductor runs on: kopf runs a
plain function in a thread (kopf/_core/actions/invocation.py:134@1.45.2), where changing the pod cache
races the conductor's rounds and asyncio.Event.set does not wake the loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import kopf
import pytest
from kopf._cogs.structs.references import Resource
from kopf._core.actions.invocation import invoke

from rljob.controller import handlers, queueing
from rljob.controller.children import LABEL_JOB


class _Conductor:
    def __init__(self) -> None:
        self.threads: list[int] = []
        self.wake = asyncio.Event()

    def _on_loop(self) -> None:
        self.threads.append(threading.get_ident())
        self.wake.set()

    def pod_seen(self, pod: dict[str, Any], deleted: bool = False) -> None:
        self._on_loop()

    def poke(self) -> None:
        self._on_loop()

    def workload_seen(self, workload: dict[str, Any], deleted: bool = False) -> None:
        self._on_loop()


EVENT = {"type": "MODIFIED", "object": {"metadata": {"name": "demo-0"}}}
CALLS = {
    "pod_changed": {"namespace": "ns", "labels": {LABEL_JOB: "demo"}, "event": EVENT},
    "job_changed": {"namespace": "ns", "name": "demo"},
    "workload_changed": {"namespace": "ns", "labels": {LABEL_JOB: "demo"}, "event": EVENT},
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_an_event_handler_wakes_its_conductor_on_the_event_loop(name: str, monkeypatch: Any) -> None:
    conductor = _Conductor()
    monkeypatch.setitem(handlers.CONDUCTORS, ("ns", "demo"), conductor)

    async def scenario() -> None:
        await invoke(getattr(handlers, name), kwargs=CALLS[name])  # as kopf calls it
        await asyncio.wait_for(conductor.wake.wait(), 1)

    asyncio.run(scenario())
    assert conductor.threads == [threading.get_ident()]  # asyncio.run's loop runs on this thread


def test_kopf_watches_only_the_pods_and_workloads_of_rljobs_and_lists_them_in_pages() -> None:
    """The selector goes into kopf's list and watch URLs (kopf/_cogs/clients/watching.py:263@1.45.2): the
    API server sends no pod nor Kueue Workload of anything else."""
    settings = kopf.OperatorSettings()
    handlers.configure(settings=settings, memo=kopf.Memo(kube=object(), options=object()))
    pods = Resource("", "v1", "pods", namespaced=True)
    workloads = Resource(queueing.GROUP, queueing.VERSION, queueing.PLURAL, namespaced=True)
    assert settings.watching.label_selectors.collect(pods) == [LABEL_JOB]
    assert settings.watching.label_selectors.collect(workloads) == [LABEL_JOB]
    assert settings.watching.label_selectors.collect(Resource("rljob.io", "v1alpha1", "rljobs")) == []
    assert settings.watching.label_selectors.collect(Resource("metrics.k8s.io", "v1beta1", "pods")) == []
    assert settings.watching.chunk_size == handlers.LIST_CHUNK
