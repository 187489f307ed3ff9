"""kopf handlers: thin. One daemon per RLJob runs its Conductor; watch events only wake it.

The event handlers are coroutines although they never wait: kopf runs a plain function in a thread
(kopf/_core/actions/invocation.py:134@1.45.2, `invoke`), where it would change a conductor's pod cache
while the conductor reads it and set its asyncio.Event from outside the event loop (not thread-safe),
and each event would cost a thread hop."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import kopf

from rljob.api.crd import GROUP, PLURAL, VERSION
from rljob.controller import queueing
from rljob.controller.agent_link import AgentChannels
from rljob.controller.children import LABEL_JOB, token_secret_name
from rljob.controller.conductor import Conductor, ConductorOptions
from rljob.controller.diffbase import LeanDiffBaseStorage
from rljob.controller.kube import Kube, api_server
from rljob.kubeclient.credentials import Credentials

log = logging.getLogger(__name__)
CONDUCTORS: dict[tuple[str, str], Conductor] = {}
WORKER_IDLE_SECONDS = 0.5
LIST_CHUNK = 100  # objects per page of kopf's lists: the start, and after a watch that failed


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf's watches use the credentials of the operator's own calls (kubeclient/credentials.py). kopf asks
    again after the API server answered 401: the configuration is loaded again (token file, exec plugin).
    (kopf has no tls-server-name: a kubeconfig that needs one serves the operator's calls only.)"""
    kube = memo.get("kube")
    c = kube.server.credentials if isinstance(kube, Kube) else Credentials.load()
    c.invalidate()
    scheme, _space, token = (c.authorization() or "").partition(" ")
    return kopf.ConnectionInfo(
        server=c.server,
        ca_path=c.ca_path,
        insecure=c.insecure or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=c.certificate_path,
        private_key_path=c.private_key_path,
        default_namespace=c.namespace,
        proxy_url=c.proxy_url,
    )


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's bookkeeping goes to annotations under our prefix; status has exactly one writer: us.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="rljob.io")
    settings.persistence.diffbase_storage = LeanDiffBaseStorage(
        prefix="rljob.io", key="last-handled-configuration"
    )
    settings.posting.enabled = False  # we post typed events ourselves
    settings.watching.server_timeout = 60
    settings.watching.client_timeout = 70
    # kopf's worker for an object holds that object's last watch event, parsed whole, until it idles out;
    # the pod cache already keeps the few fields read. A worker made again for the next event costs a task.
    settings.queueing.idle_timeout = WORKER_IDLE_SECONDS
    # Only our pods and Workloads, filtered by the API server (kopf's `labels=` below filter in the
    # operator, after every pod and Workload of the watched namespaces was sent and parsed); and lists in
    # pages, which kopf handles one at a time (kopf/_cogs/clients/fetching.py:43@1.45.2), never a whole
    # list parsed at once. Both settings are kopf 1.45's (pyproject.toml).
    for resource in (("v1", "pods"), (queueing.GROUP, queueing.VERSION, queueing.PLURAL)):
        settings.watching.label_selectors[resource] = LABEL_JOB  # the label exists: any job's
    settings.watching.chunk_size = LIST_CHUNK
    if "kube" not in memo:
        memo["kube"] = Kube(api_server())
    memo.setdefault("options", ConductorOptions())


@kopf.on.cleanup()
async def close_connections(memo: kopf.Memo, **_: Any) -> None:
    """The API calls' session (kubeclient/apiserver.py), made in kopf's event loop."""
    kube = memo.get("kube")
    if isinstance(kube, Kube):
        await kube.close()


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=15.0)
async def conduct(stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    conductor = Conductor(memo["kube"], body, memo["options"], agents=AgentChannels())
    key = (conductor.namespace, conductor.name)
    CONDUCTORS[key] = conductor
    try:
        await conductor.run(lambda: bool(stopped))
        # Returns for a job that deleted itself (its TTL), is marked for deletion or whose namespace is
        # being deleted: idle until kopf stops us (then, on deletion, clean_up runs).
        while not stopped:
            await asyncio.sleep(1)
    finally:
        if CONDUCTORS.get(key) is conductor:
            del CONDUCTORS[key]


@kopf.on.event("pods", labels={LABEL_JOB: kopf.PRESENT})  # type: ignore[arg-type]  # a namespaced resource: kopf's namespace is a str
async def pod_changed(namespace: str, labels: kopf.Labels, event: kopf.RawEvent, **_: Any) -> None:
    """The conductor keeps its pods from these events (controller/pod_cache.py) instead of listing them."""
    conductor = CONDUCTORS.get((namespace, labels.get(LABEL_JOB, "")))
    if conductor is not None:
        conductor.pod_seen(cast(dict[str, Any], event["object"]), deleted=event.get("type") == "DELETED")


@kopf.on.event(GROUP, VERSION, PLURAL)  # type: ignore[arg-type]  # a namespaced resource: kopf's namespace is a str
async def job_changed(namespace: str, name: str, **_: Any) -> None:
    conductor = CONDUCTORS.get((namespace, name))
    if conductor is not None:
        conductor.poke()


@kopf.on.event(queueing.GROUP, queueing.VERSION, queueing.PLURAL, labels={LABEL_JOB: kopf.PRESENT})  # type: ignore[arg-type]  # a namespaced resource: kopf's namespace is a str
async def workload_changed(namespace: str, labels: kopf.Labels, event: kopf.RawEvent, **_: Any) -> None:
    """Kueue admitted, evicted or requeued a job's Workload: its conductor looks at once. Where Kueue is
    not installed kopf finds no such resource and watches nothing."""
    conductor = CONDUCTORS.get((namespace, labels.get(LABEL_JOB, "")))
    if conductor is not None:
        conductor.workload_seen(event["object"], deleted=event.get("type") == "DELETED")


@kopf.on.delete(GROUP, VERSION, PLURAL, retries=5, backoff=2.0)  # type: ignore[arg-type]  # a namespaced resource: kopf's namespace is a str
async def clean_up(namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer: a bare or slow garbage collector must not leave GPU pods behind. Every step is
    idempotent (404 is success), and after its retries kopf lets the object go: it never wedges."""
    kube: Kube = memo["kube"]
    pods = await kube.list_pods(namespace, name)
    await asyncio.gather(*(kube.delete_pod(namespace, p["metadata"]["name"]) for p in pods))
    await kube.delete_named(namespace, "Service", name)
    await kube.delete_named(namespace, "Secret", token_secret_name(name))
