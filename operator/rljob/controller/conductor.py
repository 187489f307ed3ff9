"""The per-RLJob conductor: observe -> decide (pure) -> write status -> act, woken by pod events and
agent state changes. Everything it knows at start-up comes from the RLJob's status, so a restarted
operator picks up where the last one stopped."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rljob.api import InvalidObject, parse_job, parse_status
from rljob.api.agent import AgentState
from rljob.api.spec import RLJobSpec
from rljob.api.status import Phase, RLJobStatus
from rljob.controller import heap, metrics
from rljob.controller.agent_client import AgentClient, AgentEndpoint, AgentWatch, command_frame
from rljob.controller.children import (
    AgentOptions,
    gang_pod,
    headless_service,
    new_token,
    refusal_spec_error,
    token_secret,
)
from rljob.controller.kube import ChildRefused, Kube, NamespaceTerminating, PodList
from rljob.controller.pod_cache import PodCache
from rljob.controller.queueing import AdmissionView, JobQueue, Workloads, queue_name, workload_manifest
from rljob.controller.status_writer import StatusNotStored, StatusWriter
from rljob.lifecycle.machine import AwaitedReport, awaited_report, decide
from rljob.lifecycle.model import Admission, AgentRefusal, Awaited, Decision, Observation

log = logging.getLogger(__name__)
# A decision is made when something it depends on is observed to change, or when time alone would change
# it (Decision.next_due: a deadline, a TTL). Besides: what did not go through (a command an agent did not
# take, a status write held back) is tried again TICK_SECONDS later, and a decision is made at least every
# QUIET_SECONDS whatever happens. A heartbeat of TICK_SECONDS alone was most decisions at 512 pods: 101.6
# an iteration, each over every pod (docs/benchmarks.md@cac2796).
TICK_SECONDS = 2.0
QUIET_SECONDS = 30.0
# A full pod list now and then: a watch that reconnected reports no deletions it missed. At least this
# often, and no more than a list's share of the CPU allows: at 512 pods one list is ~6 MB of JSON, and a list
# a minute was a tenth of the operator's CPU (docs/benchmarks.md@cac2796).
RESYNC_SECONDS = 60.0
RESYNC_SECONDS_PER_POD = 0.5
# While reports stream in, decide at most this share of the time: a decision waits PACE times the
# last one's cost after it, and takes every report that came meanwhile (at 512 pods one decision costs
# ~4 ms and each pod reports once per phase; deciding per report would cost ~2 s a phase).
PACE = 3.0
MAX_PAUSE = 0.05  # seconds
MAX_SPEC_ERROR = 1000  # the status message is bounded (api/status.py)
_POD_EVENT_LIFECYCLE = metrics.POD_EVENTS.labels(change="lifecycle")
_POD_EVENT_READINESS = metrics.POD_EVENTS.labels(change="readiness")
_POD_EVENT_NONE = metrics.POD_EVENTS.labels(change="none")


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
    tick_seconds: float = TICK_SECONDS  # a round at least this often; what did not go through, again then
    quiet_seconds: float = QUIET_SECONDS  # a decision at least this often
    freeze_heap: bool = False  # heap.freeze() after the first round (the operator process; not in tests)


def _same(now: tuple[Any, ...], then: tuple[Any, ...]) -> bool:
    return all(a is b or a == b for a, b in zip(now, then, strict=True))


class AwaitedPods:
    """The last decision's Decision.awaiting, kept report by report as each comes: whether the reports
    since then would make the same decision (lifecycle.machine.decides_nothing_new), in the time of one
    report rather than of a round over the whole gang, so a report that decides nothing wakes nothing.
    Pods whose reports said they succeeded leave `running`; when none is left, or a report says anything
    else, or a command was not accepted, the next round decides."""

    def __init__(self) -> None:
        self._awaited: dict[str, Awaited] = {}
        self._running: set[str] = set()
        self._void = True  # nothing to wait on: every round decides

    def decided(self, awaiting: tuple[Awaited, ...]) -> None:
        self._awaited = {a.pod: a for a in awaiting}
        self._running = set(self._awaited)
        self._void = not awaiting

    def reported(self, pod: str, latest: AgentState | None, took: Callable[[Awaited], bool]) -> None:
        """`pod`'s report `latest` came; `took`: whether its agent accepted the awaited command."""
        if self._void:
            return
        awaited = self._awaited.get(pod)
        seen = awaited_report(awaited, latest, took(awaited)) if awaited else AwaitedReport.DECIDE
        if seen == AwaitedReport.DECIDE:
            self._void = True
        elif seen == AwaitedReport.SUCCEEDED:
            self._running.discard(pod)

    def not_taken(self) -> None:
        self._void = True

    def nothing_new(self) -> bool:
        return not self._void and bool(self._running)


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
        self.pods = PodCache()  # from the pod watch (pod_seen), a list at the start and now and then
        self._resync_at = 0.0  # loop time of the next full pod list
        self._watched: tuple[int, RLJobSpec | None] | None = None  # (pods.version, spec) watches follow
        self._reports = 0  # agent reports received: with pods.version, what moves the observation
        self._decided: tuple[Any, ...] | None = None  # the inputs of the last decision
        self._awaited = AwaitedPods()  # what it waits on (Decision.awaiting), report by report
        self._decided_at = 0.0  # loop time the last decision ended
        self._due_at = 0.0  # loop time the next decision is due whatever is observed (see TICK_SECONDS)
        self._untaken = False  # a command of the last decision was not taken: send it again
        self._decide_seconds = 0.0  # what it cost
        self._parsed: _Parsed | None = None
        self._children_ready = False  # the token Secret and the Service exist
        self._accepted: set[tuple[str, str, int]] = set()  # (pod uid, action, epoch) an agent took
        # Refusals for the next decision, and those already reported: a command re-sent each round and
        # refused each time is one event, not one per round.
        self._refusals: list[AgentRefusal] = []
        self._refused: set[tuple[str, str, int, str]] = set()
        self._workloads = workloads
        self._queue: JobQueue | None = None  # the job's Kueue Workload, once it names a queue
        self._pods_left = 0  # pods seen by the last round, before its deletions
        self._placed: set[int] = set()  # gangs (status.restarts) the scheduler placed whole

    def job_queue(self) -> JobQueue:
        if self._queue is None:
            workloads = self._workloads or Workloads(self.kube.server)
            self._queue = JobQueue(workloads, self.namespace, self.name, self.uid)
        return self._queue

    def workload_seen(self, workload: Mapping[str, Any], deleted: bool = False) -> None:
        """A watch event for this job's Kueue Workload (controller/handlers.py)."""
        self.job_queue().seen(workload, deleted)
        self.poke()

    def poke(self) -> None:
        self.wake.set()

    def pod_seen(self, pod: dict[str, Any], deleted: bool = False) -> None:
        """A watch event for one of this job's pods (controller/handlers.py)."""
        readiness = self.pods.readiness_changes
        if self.pods.seen(pod, deleted):
            _POD_EVENT_LIFECYCLE.inc()
            self.poke()
        else:
            (_POD_EVENT_NONE if self.pods.readiness_changes == readiness else _POD_EVENT_READINESS).inc()

    def _reported(self, pod: str) -> None:
        self._reports += 1
        self._awaited.reported(pod, self._latest(pod), self._took)
        if not self._awaited.nothing_new():
            self.poke()

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

    def deleting(self) -> bool:
        """The RLJob is marked for deletion: kopf's finalizer handler (handlers.clean_up) removes what is
        left of it, and the conductor creates and sends nothing more."""
        return bool(self.body.get("metadata", {}).get("deletionTimestamp"))

    async def run(self, stopped: Callable[[], bool]) -> None:
        """Conduct until `stopped`, the RLJob is marked for deletion, or its namespace is being deleted
        (a create refused as NamespaceTerminating: the RLJob goes with the namespace); returns then, and
        after the job deleted itself (its TTL)."""
        # From the status as stored, not kopf's body of the job: a conductor kopf started again (after a
        # status write the API server answered 504, which it may still have applied; now read back in
        # place, controller/status_writer.py) got a body five transitions behind under load, and wrote
        # the job's epoch back (docs/benchmarks.md@cac2796).
        stored = await self.kube.read_status(self.namespace, self.name)
        if stored is None:  # the RLJob is gone: kopf stops this daemon
            return
        status = parse_status(stored)
        writer = StatusWriter(
            self.kube,
            self.namespace,
            self.name,
            stored,
            retry_seconds=self.options.tick_seconds,
            max_retry_seconds=self.options.quiet_seconds,
        )
        loop = asyncio.get_running_loop()
        async with AgentClient() as agents:
            try:
                while not stopped() and not self.deleting():
                    self.wake.clear()
                    options = self.options
                    due = loop.time() >= self._due_at
                    parsed = await self._checked_spec(agents, status)
                    decision = await self._round(agents, parsed, status, due)
                    progressed = False
                    if decision is not None:
                        # persist first, then act (see Decision)
                        # Most decisions while reports come in change nothing: comparing the models is
                        # cheaper than building the wire form the writer diffs.
                        offered = decision.status != status
                        try:
                            written = offered and await writer.write(decision.status)
                        except StatusNotStored as not_stored:
                            # Nothing of a decision whose status is not stored is carried out: it is
                            # made again when due, and the next round, finding nothing new, waits.
                            self._awaited.not_taken()
                            self._due_at = loop.time() + not_stored.retry_in
                            continue
                        self._observe_metrics(status, decision.status)
                        if written:  # else the same status: keep the object the next round compares
                            status = decision.status
                        if self.deleting():  # seen while deciding: nothing of the decision is carried out
                            return
                        try:
                            progressed = await self._act(parsed.spec, decision) or written
                        except ChildRefused as refused:  # what a dry run could not foresee
                            parsed.refused(refused)
                            continue
                        settled = await self._settle_workload(decision.status)
                        if decision.delete_job:
                            await self.kube.delete_job(self.namespace, self.name)
                            return
                        # a status held back (ready counts alone) is offered again when it would be
                        # written; what else did not go through, a tick from now
                        held_back = writer.held_back_for() if offered and not written else None
                        self._due_at = self._next_due_at(decision, self._untaken or settled, held_back)
                    if options.freeze_heap:
                        heap.freeze()
                    if progressed:
                        continue  # what we sent or wrote changes what we observe: look again at once
                    # Nothing sent, created, deleted or written: a round now would see what this one
                    # saw, so wait to be woken (a report, a pod event, an edit), for the next decision
                    # that is due, or a tick: a round that decides nothing costs little, and it reads
                    # what is read now and then (the full pod list, the Workload: JobQueue.REREAD_SECONDS).
                    now = loop.time()
                    wait = max(0.0, min(self._due_at, self._resync_at, now + options.tick_seconds) - now)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.wake.wait(), wait)
            except NamespaceTerminating as terminating:
                log.info("%s/%s: %s: conducting stops", self.namespace, self.name, terminating)
            finally:
                for watch in self._watches.values():
                    await watch.close()
                self._watches.clear()
                if self._tasks:
                    await asyncio.wait(self._tasks, timeout=5)

    async def _round(
        self, agents: AgentClient, parsed: _Parsed, status: RLJobStatus, due: bool
    ) -> Decision | None:
        """The next decision; None when nothing it depends on changed since the last one (a decision
        that is `due` is made anyway: time is an input too)."""
        loop = asyncio.get_running_loop()
        if not self.pods.listed_once or loop.time() >= self._resync_at:
            pods = await self.kube.list_pods(self.namespace, self.name)
            self.pods.listed(pods, pods.resource_version if isinstance(pods, PodList) else None)
            self._resync_at = loop.time() + max(RESYNC_SECONDS, RESYNC_SECONDS_PER_POD * len(pods))
        self._sync_watches(agents, parsed.spec if parsed.error is None else None)
        self._pods_left = len(self.pods)
        queued = await self._admission(parsed, status)
        generation = self.body.get("metadata", {}).get("generation")
        inputs = (
            self.pods.version, self._reports, generation, parsed, parsed.error, queued.admission,
            queued.message, status, len(self._refusals),
        )  # fmt: skip
        if not due and self._decided is not None and _same(inputs, self._decided):
            return None
        if (
            not due
            and self._decided is not None
            and _same(inputs[:1] + inputs[2:], self._decided[:1] + self._decided[2:])  # only reports came
            and self._awaited.nothing_new()
        ):
            self._decided = inputs  # the decision would wait on: skipped (Decision.awaiting)
            metrics.DECISIONS.labels(outcome="skipped").inc()
            return None
        pause = min(MAX_PAUSE, PACE * self._decide_seconds) - (loop.time() - self._decided_at)
        if not due and pause > 0:
            await asyncio.sleep(pause)  # reports that come meanwhile go into this decision
        states = self._agent_states()
        self._decided = inputs
        obs = Observation(
            now=self.clock(),
            pods=self.pods.observations(),
            agents=states,
            generation=self.body.get("metadata", {}).get("generation"),
            spec_error=parsed.error,
            admission=queued.admission,
            admission_message=queued.message,
            refusals=tuple(self._refusals),
        )
        self._refusals.clear()  # each refusal reaches exactly one decision, hence one event
        began = time.thread_time()  # CPU, not wall: a decision preempted on a busy machine cost no more
        decision = decide(parsed.spec, status, obs)
        self._decide_seconds = time.thread_time() - began
        metrics.DECISIONS.labels(outcome="decided").inc()
        self._decided_at = loop.time()
        self._awaited.decided(decision.awaiting)
        return decision

    def _next_due_at(self, decision: Decision, retry: bool, held_back: float | None) -> float:
        """Loop time at which a decision is due though nothing was observed to change."""
        options = self.options
        after = options.tick_seconds if retry else options.quiet_seconds
        if decision.next_due is not None:
            after = min(after, max(0.0, (decision.next_due - self.clock()).total_seconds()))
        if held_back is not None:
            after = min(after, held_back)
        return asyncio.get_running_loop().time() + after

    def _agent_states(self) -> dict[str, AgentState | None]:
        states: dict[str, AgentState | None] = {}
        for pod in self.pods.pods():
            watch = self._watches.get(pod.name)
            # A report counts only for the pod it came from: a recreated pod has a new uid.
            fresh = watch is not None and watch.endpoint.uid == pod.uid
            states[pod.name] = watch.latest if fresh and watch else None
        return states

    def _latest(self, pod: str) -> AgentState | None:
        watch = self._watches.get(pod)
        return watch.latest if watch is not None else None

    def _took(self, awaited: Awaited) -> bool:
        """The pod's agent accepted the awaited command (its report may not show it yet)."""
        watch = self._watches.get(awaited.pod)
        key = (watch.endpoint.uid, awaited.action.value, awaited.epoch) if watch is not None else None
        return key in self._accepted

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

    async def _settle_workload(self, status: RLJobStatus) -> bool:
        """Tell Kueue what the job did this round: quota given back after an eviction, finished. True
        when it wrote something."""
        queue = queue_name(self.body)
        if queue is None or self._queue is None:
            return False
        spec = self._parsed.spec if self._parsed is not None else None
        suspend = spec is not None and spec.suspend
        ready = status.replicas > 0 and status.ready_replicas == status.replicas
        return await self._queue.settle(
            queue, status.phase, status.message or "", suspend, self._pods_left, ready
        )

    def _placed_gangs(self, spec: RLJobSpec) -> set[int]:
        """Gangs every member of which the scheduler placed (each has a pod IP), at any time so far."""
        members: dict[int, int] = {}
        for pod in self.pods.pods():
            if pod.ip and not pod.observation.deleting:
                members[pod.observation.gang] = members.get(pod.observation.gang, 0) + 1
        self._placed.update(g for g, n in members.items() if n >= spec.replicas)
        return self._placed

    def _sync_watches(self, agents: AgentClient, spec: RLJobSpec | None) -> None:
        """One watch per agent of a placed gang (none while the spec is invalid: the job is failing). The
        first watch request is what lets the agent's startupProbe pass (agent/operator_api.py,
        /probe/gang): no member of a gang the scheduler could not place whole starts SGLang or its
        trainer."""
        if self._watched is not None and self._watched[0] == self.pods.version and self._watched[1] is spec:
            return
        self._watched = (self.pods.version, spec)
        wanted: dict[str, AgentEndpoint] = {}
        placed = self._placed_gangs(spec) if spec is not None else set()
        for pod in self.pods.pods():
            obs = pod.observation
            alive = obs.phase in ("Pending", "Running") and not obs.deleting
            if spec is not None and pod.ip and alive and obs.gang in placed:
                wanted[pod.name] = AgentEndpoint(pod.name, pod.uid, pod.ip, spec.agent.port)
        for name in list(self._watches):
            if name not in wanted or self._watches[name].endpoint != wanted[name]:
                watch = self._watches.pop(name)
                asyncio.get_running_loop().create_task(watch.close())
        for name, endpoint in wanted.items():
            if name not in self._watches:
                self._watches[name] = AgentWatch(agents, endpoint, functools.partial(self._reported, name))

    def _pod(self, spec: RLJobSpec, index: int, gang: int) -> dict[str, Any]:
        manifest = gang_pod(self.name, self.uid, spec, index, gang, self.options.agent, spec.iterations)
        manifest["metadata"]["namespace"] = self.namespace
        return manifest

    async def _act(self, spec: RLJobSpec | None, decision: Decision) -> bool:
        """Carry out the decision's effects; True when any reached the API server or an agent (a command
        already accepted and a pod already deleted are not sent again). Raises ChildRefused when the API
        server refuses a pod as invalid (after the others are made)."""
        ns = self.namespace
        doomed = [(n, self.pods.uid(n)) for n in decision.delete_pods if not self.pods.deleted_by_us(n)]
        await asyncio.gather(*(self.kube.delete_pod(ns, n, uid) for n, uid in doomed))
        for name, uid in doomed:
            self.pods.deleting(name, uid)
        if spec is not None and decision.create_pods:
            manifests = [self._pod(spec, index, decision.status.restarts) for index in decision.create_pods]
            outcomes = await asyncio.gather(
                *(self.kube.create(ns, m) for m in manifests), return_exceptions=True
            )
            for outcome in outcomes:
                if isinstance(outcome, dict):
                    self.pods.seen(outcome)  # the watch's event for it may come after the next round
                elif outcome is None:
                    self._resync_at = 0.0  # it existed already: the cache missed it, list again
            errors = [e for e in outcomes if isinstance(e, BaseException)]
            refused = [e for e in errors if isinstance(e, ChildRefused)]
            if refused or errors:
                raise (refused or errors)[0]
        sent = await self._send(decision)
        if decision.events:  # events are for people: never on the lifecycle's critical path
            self._background(self._post_events(decision))
        return sent or bool(doomed) or bool(spec is not None and decision.create_pods)

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

    async def _send(self, decision: Decision) -> bool:
        """Fan out concurrently; True when an agent accepted a command or refused one for the first time.
        A command an agent already accepted is not sent again while its state report catches up (a
        repeat would be a harmless no-op, but at 64 pods it doubles the traffic, and the agent's reports
        do not show an acceptance: agent/reports.py)."""
        epoch = decision.status.epoch
        self._accepted = {a for a in self._accepted if a[2] >= epoch}
        self._untaken = False
        self._refused = {r for r in self._refused if r[2] >= epoch}
        sends, keys = [], []
        frames: dict[int, str] = {}  # by id(): a decision builds one command per role (LockStep.varies)
        for pc in decision.commands:
            watch = self._watches.get(pc.pod)
            if watch is None:
                continue
            key = (watch.endpoint.uid, pc.command.action.value, pc.command.epoch)
            if key in self._accepted:
                continue
            frame = frames.get(id(pc.command))
            if frame is None:
                frame = frames[id(pc.command)] = command_frame(pc.command)
            sends.append(watch.send(pc.command, frame))
            keys.append(key)
        progressed = False
        for key, outcome in zip(keys, await asyncio.gather(*sends), strict=True):
            if outcome.accepted:
                self._accepted.add(key)
                progressed = True
                continue
            self._awaited.not_taken()  # it is sent again by the next decision
            self._untaken = True  # which is due a tick from now if nothing else comes first
            if (
                outcome.refusal
                and not outcome.refusal.startswith("unreachable")
                and (outcome.permanent or (*key, outcome.refusal) not in self._refused)
            ):
                # A permanent refusal reaches every decision until one is stored: it fails the job.
                self._refused.add((*key, outcome.refusal))
                refusal = AgentRefusal(outcome.pod, outcome.refusal, outcome.error, outcome.permanent)
                self._refusals.append(refusal)  # an event via the next Decision
                progressed = True
        return progressed

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
            metrics.observe_iteration(self.namespace, self.name, new)
