"""The per-RLJob conductor: observe -> decide (pure) -> write status -> act, woken by pod events and
agent state changes. Everything it knows at start-up comes from the RLJob's status, so a restarted
operator picks up where the last one stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rljob.api import InvalidObject, parse_job, parse_status
from rljob.api.agent import AgentState
from rljob.api.spec import RLJobSpec
from rljob.api.status import Phase, RLJobStatus
from rljob.controller import metrics
from rljob.controller.agent_client import AgentClient, AgentEndpoint, AgentWatch
from rljob.controller.children import (
    AgentOptions,
    gang_pod,
    headless_service,
    new_token,
    refusal_spec_error,
    token_secret,
)
from rljob.controller.kube import ChildRefused, Kube
from rljob.controller.observe import pod_ip, pod_observation
from rljob.controller.queueing import AdmissionView, JobQueue, Workloads, queue_name, workload_manifest
from rljob.controller.status_writer import StatusWriter
from rljob.lifecycle.machine import decide
from rljob.lifecycle.model import Admission, Decision, EventReason, Observation

log = logging.getLogger(__name__)
TICK_SECONDS = 2.0  # time-based decisions (deadlines) need a heartbeat; everything else wakes us
MAX_SPEC_ERROR = 1000  # the status message is bounded (api/status.py)


@dataclass
class _Parsed:
    """One generation of the RLJob as the operator reads it: the spec, or why it cannot be run."""

    generation: int | None
    spec: RLJobSpec | None
    error: str | None = None  # Observation.spec_error: the models refuse it, or the API server a child
    pods_checked: bool = False  # a pod of this spec passed a server-side dry run

    def refused(self, refused: ChildRefused) -> None:
        self.error = refusal_spec_error(refused.refusal)[:MAX_SPEC_ERROR]


@dataclass(frozen=True)
class ConductorOptions:
    agent: AgentOptions = field(default_factory=AgentOptions)
    tick_seconds: float = TICK_SECONDS
    finished_tick_seconds: float = 30.0  # finished jobs only wait for their TTL: a slow heartbeat is enough


class Conductor:
    def __init__(
        self,
        kube: Kube,
        body: Mapping[str, Any],
        options: ConductorOptions,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        workloads: Workloads | None = None,
    ) -> None:
        meta = body["metadata"]
        self.kube = kube
        self.body = body  # kopf's live view: spec edits (suspend, iterations) show up here
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.options = options
        self.clock = clock
        self.wake = asyncio.Event()
        self._watches: dict[str, AgentWatch] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._uids: dict[str, str] = {}  # pod name -> uid, from the last list
        self._parsed: _Parsed | None = None
        self._children_ready = False  # the token Secret and the Service exist
        self._accepted: set[tuple[str, str, int]] = set()  # (pod uid, action, epoch) an agent took
        self._workloads = workloads
        self._queue: JobQueue | None = None  # the job's Kueue Workload, once it names a queue
        self._pods_left = 0  # pods seen by the last round, before its deletions

    def job_queue(self) -> JobQueue:
        if self._queue is None:
            workloads = self._workloads or Workloads(self.kube.api)
            self._queue = JobQueue(workloads, self.namespace, self.name, self.uid)
        return self._queue

    def workload_seen(self, workload: Mapping[str, Any], deleted: bool = False) -> None:
        """A watch event for this job's Kueue Workload (controller/handlers.py)."""
        self.job_queue().seen(workload, deleted)
        self.poke()

    def poke(self) -> None:
        self.wake.set()

    def _parse(self) -> _Parsed:
        """The validated spec, parsed again only when metadata.generation moves (every spec edit does)."""
        generation = self.body.get("metadata", {}).get("generation")
        if self._parsed is None or self._parsed.generation != generation:
            try:
                self._parsed = _Parsed(generation, parse_job(self.body))
            except InvalidObject as err:
                self._parsed = _Parsed(generation, None, str(err)[:MAX_SPEC_ERROR])
        return self._parsed

    async def _checked_spec(self, agents: AgentClient, status: RLJobStatus) -> _Parsed:
        """The spec, with what the API server says about its children: the token Secret and Service
        (created once), and the pods (a server-side dry run of the last pod, once per generation, while
        the job runs). A refusal is the spec's error: decide() fails the job before any pod exists."""
        parsed = self._parse()
        if parsed.spec is None or parsed.error is not None:
            return parsed
        try:
            if not self._children_ready:
                agents.token = await self._ensure_token_and_service(parsed.spec)
                self._children_ready = True
            if not parsed.pods_checked and not status.phase.terminal:
                await self.kube.create(
                    self.namespace,
                    self._pod(parsed.spec, parsed.spec.replicas - 1, status.restarts),
                    dry_run=True,
                )
                parsed.pods_checked = True
        except ChildRefused as refused:
            parsed.refused(refused)
        return parsed

    async def run(self, stopped: Callable[[], bool]) -> None:
        status = parse_status(self.body.get("status"))
        writer = StatusWriter(self.kube, self.namespace, self.name, self.body.get("status"))
        async with AgentClient() as agents:
            try:
                while not stopped():
                    self.wake.clear()
                    parsed = await self._checked_spec(agents, status)
                    decision = await self._round(agents, parsed, status)
                    await writer.write(decision.status)  # persist first, then act (see Decision)
                    self._observe_metrics(status, decision.status)
                    status = decision.status
                    try:
                        await self._act(parsed.spec, decision)
                    except ChildRefused as refused:  # what a dry run could not foresee
                        parsed.refused(refused)
                        continue
                    await self._settle_workload(decision.status)
                    if decision.delete_job:
                        await self.kube.delete_job(self.namespace, self.name)
                        return
                    if decision.commands or decision.create_pods or decision.delete_pods:
                        continue  # effects usually change what we observe: look again at once
                    options = self.options
                    tick = options.finished_tick_seconds if status.phase.terminal else options.tick_seconds
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), tick)
            finally:
                for watch in self._watches.values():
                    await watch.close()
                self._watches.clear()
                if self._tasks:
                    await asyncio.wait(self._tasks, timeout=5)

    async def _round(self, agents: AgentClient, parsed: _Parsed, status: RLJobStatus) -> Decision:
        pods = await self.kube.list_pods(self.namespace, self.name)
        self._uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
        self._sync_watches(agents, parsed.spec if parsed.error is None else None, pods)
        states: dict[str, AgentState | None] = {}
        for pod in pods:
            watch = self._watches.get(pod["metadata"]["name"])
            # A report counts only for the pod it came from: a recreated pod has a new uid.
            fresh = watch is not None and watch.endpoint.uid == pod["metadata"]["uid"]
            states[pod["metadata"]["name"]] = watch.latest if fresh and watch else None
        self._pods_left = len(pods)
        queued = await self._admission(parsed, status)
        obs = Observation(
            now=self.clock(),
            pods=tuple(pod_observation(p) for p in pods),
            agents=states,
            generation=self.body.get("metadata", {}).get("generation"),
            spec_error=parsed.error,
            admission=queued.admission,
            admission_message=queued.message,
        )
        return decide(parsed.spec, status, obs)

    async def _admission(self, parsed: _Parsed, status: RLJobStatus) -> AdmissionView:
        """Kueue's word on the job (controller/queueing.py), creating its Workload when it has none."""
        queue = queue_name(self.body)
        if queue is None:
            return AdmissionView(Admission.NOT_QUEUED)
        spec = parsed.spec if parsed.error is None else None

        def manifest() -> dict[str, Any]:
            assert spec is not None and queue is not None
            pod = self._pod(spec, 0, status.restarts)
            return workload_manifest(
                self.name, self.uid, self.namespace, queue, spec.replicas, pod, active=not spec.suspend
            )

        return await self.job_queue().admission(queue, manifest if spec else None, status.phase.terminal)

    async def _settle_workload(self, status: RLJobStatus) -> None:
        """Tell Kueue what the job did this round: quota given back after an eviction, finished."""
        queue = queue_name(self.body)
        if queue is None or self._queue is None:
            return
        spec = self._parsed.spec if self._parsed is not None else None
        suspend = spec is not None and spec.suspend
        ready = status.replicas > 0 and status.ready_replicas == status.replicas
        await self._queue.settle(queue, status.phase, status.message or "", suspend, self._pods_left, ready)

    def _sync_watches(self, agents: AgentClient, spec: RLJobSpec | None, pods: list[dict[str, Any]]) -> None:
        """One watch per running agent; none while the spec is invalid (the job is failing)."""
        wanted: dict[str, AgentEndpoint] = {}
        for pod in pods:
            ip = pod_ip(pod)
            meta = pod["metadata"]
            running = pod.get("status", {}).get("phase") == "Running" and not meta.get("deletionTimestamp")
            if spec is not None and ip and running:
                wanted[meta["name"]] = AgentEndpoint(meta["name"], meta["uid"], ip, spec.agent.port)
        for name in list(self._watches):
            if name not in wanted or self._watches[name].endpoint != wanted[name]:
                watch = self._watches.pop(name)
                asyncio.get_running_loop().create_task(watch.close())
        for name, endpoint in wanted.items():
            if name not in self._watches:
                self._watches[name] = AgentWatch(agents, endpoint, self.poke)

    def _pod(self, spec: RLJobSpec, index: int, gang: int) -> dict[str, Any]:
        manifest = gang_pod(self.name, self.uid, spec, index, gang, self.options.agent, spec.iterations)
        manifest["metadata"]["namespace"] = self.namespace
        return manifest

    async def _act(self, spec: RLJobSpec | None, decision: Decision) -> None:
        """Raises ChildRefused when the API server refuses a pod as invalid (after the others are made)."""
        ns = self.namespace
        if decision.events:  # events are for people: never on the lifecycle's critical path
            self._background(self._post_events(decision))
        await asyncio.gather(*(self.kube.delete_pod(ns, n, self._uids.get(n)) for n in decision.delete_pods))
        if spec is not None and decision.create_pods:
            manifests = [self._pod(spec, index, decision.status.restarts) for index in decision.create_pods]
            outcomes = await asyncio.gather(
                *(self.kube.create(ns, m) for m in manifests), return_exceptions=True
            )
            errors = [e for e in outcomes if isinstance(e, BaseException)]
            refused = [e for e in errors if isinstance(e, ChildRefused)]
            if refused or errors:
                raise (refused or errors)[0]
        await self._send(decision)

    async def _post_events(self, decision: Decision) -> None:
        body = dict(self.body)
        for event in decision.events:  # in order, so `kubectl describe` reads like the timeline
            await self.kube.post_event(
                self.namespace, body, event.type.value, event.reason.value, event.message
            )

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, decision: Decision) -> None:
        """Fan out concurrently. A command an agent already accepted is not sent again while its state
        report catches up (a repeat would be a harmless no-op, but at 64 pods it doubles the traffic)."""
        epoch = decision.status.epoch
        self._accepted = {a for a in self._accepted if a[2] >= epoch}
        sends, keys = [], []
        for pc in decision.commands:
            watch = self._watches.get(pc.pod)
            if watch is None:
                continue
            key = (watch.endpoint.uid, pc.command.action.value, pc.command.epoch)
            if key in self._accepted:
                continue
            sends.append(watch.client.send(watch.endpoint, pc.command))
            keys.append(key)
        for key, outcome in zip(keys, await asyncio.gather(*sends), strict=True):
            if outcome.accepted:
                self._accepted.add(key)
            elif outcome.refusal and not outcome.refusal.startswith("unreachable"):
                await self.kube.post_event(
                    self.namespace,
                    dict(self.body),
                    "Warning",
                    EventReason.COMMAND_REFUSED.value,
                    f"{outcome.pod}: {outcome.refusal}",
                )

    async def _ensure_token_and_service(self, spec: RLJobSpec) -> str:
        token = await self.kube.read_token(self.namespace, self.name)
        if token is None:
            await self.kube.create(self.namespace, token_secret(self.name, self.uid, new_token()))
            token = await self.kube.read_token(self.namespace, self.name)
            assert token is not None
        await self.kube.create(self.namespace, headless_service(self.name, self.uid, spec))
        return token

    def _observe_metrics(self, old: RLJobStatus, new: RLJobStatus) -> None:
        labels = {"namespace": self.namespace, "job": self.name}
        metrics.ITERATION.labels(**labels).set(new.iteration)
        metrics.RESTARTS.labels(**labels).set(new.restarts)
        if new.weight_version and new.weight_version.isdigit():
            metrics.WEIGHT_VERSION.labels(**labels).set(int(new.weight_version))
        if new.phase != old.phase:
            metrics.TRANSITIONS.labels(phase=new.phase.value).inc()
            closed = [s for s in new.timeline if s.phase == old.phase and s.seconds is not None]
            if closed:
                metrics.PHASE_SECONDS.labels(phase=old.phase.value).observe(closed[-1].seconds or 0.0)
            if new.phase in (Phase.RECOVERING, Phase.FAILED):
                metrics.FAILURES.labels(phase=old.phase.value, reason=new.reason or "").inc()
            log.info(
                "%s/%s: %s -> %s (iteration %d, epoch %d): %s",
                self.namespace,
                self.name,
                old.phase.value,
                new.phase.value,
                new.iteration,
                new.epoch,
                new.message,
            )
        if new.last_iteration is not None and new.last_iteration != old.last_iteration:
            metrics.CONTROL_OVERHEAD.observe(new.last_iteration.control_overhead_seconds)
