"""The per-RLJob conductor: observe -> decide (pure) -> write status -> act, woken by pod events and
agent state changes. Everything it knows at start-up comes from the RLJob's status, so a restarted
operator picks up where the last one stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from rljob.api import parse_status
from rljob.api.spec import RLJobSpec
from rljob.api.status import RLJobStatus
from rljob.controller import heap, metrics
from rljob.controller.agent_link import AgentChannels, AgentLink
from rljob.controller.children import AgentOptions
from rljob.controller.job_events import EventPoster
from rljob.controller.kube import ChildRefused, Kube, NamespaceTerminating, PodList
from rljob.controller.pacer import QUIET_SECONDS, TICK_SECONDS, Pacer, Skip
from rljob.controller.pod_cache import PodCache
from rljob.controller.queueing import AdmissionView, JobQueue, Workloads, job_facts, queue_name
from rljob.controller.spec_check import ParsedSpec, SpecCheck
from rljob.controller.status_writer import StatusNotStored, StatusWriter
from rljob.lifecycle.machine import decide
from rljob.lifecycle.model import Admission, Decision, Observation

log = logging.getLogger(__name__)
_POD_EVENT_LIFECYCLE = metrics.POD_EVENTS.labels(change="lifecycle")
_POD_EVENT_READINESS = metrics.POD_EVENTS.labels(change="readiness")
_POD_EVENT_NONE = metrics.POD_EVENTS.labels(change="none")


@dataclass(frozen=True)
class ConductorOptions:
    agent: AgentOptions = field(default_factory=AgentOptions)
    tick_seconds: float = TICK_SECONDS  # a round at least this often; what did not go through, again then
    quiet_seconds: float = QUIET_SECONDS  # a decision at least this often
    freeze_heap: bool = False  # heap.freeze() after the first round (the operator process; not in tests)


class _Done(Enum):
    """What a round carried out."""

    NOTHING = "nothing"  # a round now would see what this one saw: wait for a wake
    SOMETHING = "something"  # it sent or wrote something, which changes what is observed: look again
    NOT_CARRIED_OUT = "not carried out"  # the decision was refused or not stored: decide again at once
    STOP = "stop"  # the job is deleted or being deleted


def _first_error(outcomes: list[Any]) -> BaseException | None:
    """The first of the errors among `outcomes`, a ChildRefused before any other."""
    errors = [e for e in outcomes if isinstance(e, BaseException)]
    return next((e for e in errors if isinstance(e, ChildRefused)), errors[0] if errors else None)


class _Stored(Enum):
    """What became of a decision's status."""

    SAME = "same"  # the status the last round compared with: nothing offered
    WRITTEN = "written"
    NOT_WRITTEN = "not written"  # offered: the same on the wire, or ready counts alone held back
    NOT_STORED = "not stored"  # StatusNotStored: the decision is made again when due


class Conductor:
    def __init__(
        self,
        kube: Kube,
        body: Mapping[str, Any],
        options: ConductorOptions,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        workloads: Workloads | None = None,
        agents: AgentLink | None = None,
    ) -> None:
        meta = body["metadata"]
        self.kube = kube
        self.agents: AgentLink = agents if agents is not None else AgentChannels()
        self.body = body  # kopf's live view: spec edits (suspend, iterations) show up here
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.uid: str = meta["uid"]
        self.options = options
        self.clock = clock
        self.wake = asyncio.Event()
        self.events = EventPoster(kube, self.namespace, body)
        self.pods = PodCache()  # from the pod watch (pod_seen), a list at the start and now and then
        self.pacer = Pacer(options.tick_seconds, options.quiet_seconds)  # when to decide again
        self.spec_check = SpecCheck(kube, body, options.agent)  # the spec parsed, checked, made into pods
        self._workloads = workloads
        self._queue: JobQueue | None = None  # the job's Kueue Workload, once it names a queue
        self._pods_left = 0  # pods seen by the last round, before its deletions

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
        if self.pacer.reported(pod, self.agents.latest(pod), self.agents.took):
            self.poke()

    def deleting(self) -> bool:
        """The RLJob is marked for deletion: kopf's finalizer handler (handlers.clean_up) removes what is
        left of it, and the conductor creates and sends nothing more."""
        return bool(self.body.get("metadata", {}).get("deletionTimestamp"))

    async def run(self, stopped: Callable[[], bool]) -> None:
        """Conduct until `stopped`, the RLJob is marked for deletion, or its namespace is being deleted
        (a create refused as NamespaceTerminating: the RLJob goes with the namespace); returns then, and
        after the job deleted itself (its TTL)."""
        # From the status as stored, not kopf's body: a conductor kopf started again may get a body
        # transitions behind, and would write the job's epoch back.
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
        try:
            while not stopped() and not self.deleting():
                self.wake.clear()
                due = self.pacer.due(loop.time())
                parsed = await self.spec_check.check(status, self.agents.authorize)
                decision = await self._decide(parsed, status, due)
                done = _Done.NOTHING
                if decision is not None:  # persist first, then act (see Decision)
                    status, done = await self._write_and_act(writer, parsed, status, decision)
                if done is _Done.STOP:
                    return
                if done is not _Done.NOT_CARRIED_OUT:
                    await self._rest(done is _Done.SOMETHING)
        except NamespaceTerminating as terminating:
            log.info("%s/%s: %s: conducting stops", self.namespace, self.name, terminating)
        finally:
            await self._close()

    async def _decide(self, parsed: ParsedSpec, status: RLJobStatus, due: bool) -> Decision | None:
        """Observe, and the next decision; None when the pacer skips it (a decision that is `due` is made
        anyway: time is an input too)."""
        loop = asyncio.get_running_loop()
        queued = await self._observe(parsed, status)
        generation = self.body.get("metadata", {}).get("generation")
        inputs = (
            self.pods.version, generation, parsed, parsed.error, queued.admission, queued.message, status,
            len(self.agents.pending_refusals()),
        )  # fmt: skip
        skipped = self.pacer.skip(inputs, due)
        if skipped is not None:
            if skipped is Skip.AWAITED:
                metrics.DECISIONS.labels(outcome="skipped").inc()
            return None
        pause = self.pacer.pause(loop.time(), due)
        if pause > 0:
            await asyncio.sleep(pause)  # reports that come meanwhile go into this decision
        obs = Observation(
            now=self.clock(),
            pods=self.pods.observations(),
            agents=self.agents.states(self.pods),
            generation=generation,
            spec_error=parsed.error,
            admission=queued.admission,
            admission_message=queued.message,
            refusals=self.agents.take_refusals(),  # each reaches exactly one decision, hence one event
        )
        began = time.thread_time()  # CPU, not wall: a decision preempted on a busy machine cost no more
        decision = decide(parsed.spec, status, obs)
        self.pacer.decided(loop.time(), time.thread_time() - began, decision.awaiting)
        metrics.DECISIONS.labels(outcome="decided").inc()
        return decision

    async def _observe(self, parsed: ParsedSpec, status: RLJobStatus) -> AdmissionView:
        """The pods (listed when the pacer says), the agents' watches, and Kueue's word on the job."""
        loop = asyncio.get_running_loop()
        if not self.pods.listed_once or self.pacer.list_due(loop.time()):
            pods = await self.kube.list_pods(self.namespace, self.name)
            self.pods.listed(pods, pods.resource_version if isinstance(pods, PodList) else None)
            self.pacer.listed(loop.time(), len(pods))
        spec = parsed.spec if parsed.error is None else None  # None: the job is failing
        self.agents.follow(self.pods, spec, self._reported)
        self._pods_left = len(self.pods)
        if queue_name(self.body) is None:  # no Workload, and no Kueue client made
            return AdmissionView(Admission.NOT_QUEUED)
        return await self.job_queue().admit(self.body, spec, status, self.spec_check.pod)

    async def _write_and_act(
        self, writer: StatusWriter, parsed: ParsedSpec, status: RLJobStatus, decision: Decision
    ) -> tuple[RLJobStatus, _Done]:
        """Store the decision's status, then carry it out; the status the next round compares with, and
        what was done."""
        stored = await self._write(writer, status, decision)
        if stored is _Stored.NOT_STORED:  # nothing of the decision is carried out: made again when due
            return status, _Done.NOT_CARRIED_OUT
        metrics.observe_status(self.namespace, self.name, status, decision.status)
        if stored is _Stored.WRITTEN:  # else the same status: keep the object the next round compares
            status = decision.status
        if self.deleting():  # seen while deciding: nothing of the decision is carried out
            return status, _Done.STOP
        try:
            acted = await self._act(parsed.spec, decision)
        except ChildRefused as refused:  # what a dry run could not foresee
            parsed.refused(refused)
            return status, _Done.NOT_CARRIED_OUT
        settled = await self._settle_workload(decision.status)
        if decision.delete_job:
            await self.kube.delete_job(self.namespace, self.name)
            return status, _Done.STOP
        # a status held back (ready counts alone) is offered again when it would be written
        held_back = writer.held_back_for() if stored is _Stored.NOT_WRITTEN else None
        next_due = self._seconds_until(decision.next_due)
        self.pacer.carried_out(asyncio.get_running_loop().time(), next_due, settled, held_back)
        return status, _Done.SOMETHING if acted or stored is _Stored.WRITTEN else _Done.NOTHING

    async def _write(self, writer: StatusWriter, status: RLJobStatus, decision: Decision) -> _Stored:
        """Offer the decision's status to the writer; a status not stored is the pacer's to retry."""
        if decision.status == status:  # comparing the models costs less than the wire form the writer diffs
            return _Stored.SAME
        try:
            written = await writer.write(decision.status)
        except StatusNotStored as not_stored:
            self.pacer.not_stored(asyncio.get_running_loop().time(), not_stored.retry_in)
            return _Stored.NOT_STORED
        return _Stored.WRITTEN if written else _Stored.NOT_WRITTEN

    def _seconds_until(self, when: datetime | None) -> float | None:
        return (when - self.clock()).total_seconds() if when is not None else None

    async def _rest(self, progressed: bool) -> None:
        """After a round: look again at once when it sent or wrote something (what we observe changes),
        else wait to be woken (a report, a pod event, an edit) or for what the pacer says is due."""
        if self.options.freeze_heap:
            heap.freeze()
        if progressed:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), self.pacer.wait(loop.time()))

    async def _close(self) -> None:
        await self.agents.close()
        await self.events.close()

    async def _settle_workload(self, status: RLJobStatus) -> bool:
        """Tell Kueue what the job did this round: quota given back after an eviction, finished. True
        when it wrote something."""
        if self._queue is None:
            return False
        spec = self.spec_check.last.spec if self.spec_check.last is not None else None
        return await self._queue.settle(job_facts(self.body, spec, status, self._pods_left))

    async def _act(self, spec: RLJobSpec | None, decision: Decision) -> bool:
        """Carry out the decision's effects; True when any reached the API server or an agent (a command
        already accepted and a pod already deleted are not sent again). Raises ChildRefused when the API
        server refuses a pod as invalid (after the others are made)."""
        ns = self.namespace
        doomed = [(n, self.pods.uid(n)) for n in decision.delete_pods if not self.pods.deleted_by_us(n)]
        await asyncio.gather(*(self.kube.delete_pod(ns, n, uid) for n, uid in doomed))
        for name, uid in doomed:
            self.pods.deleting(name, uid)
        created = False
        if spec is not None and decision.create_pods:
            await self._create_pods(spec, decision)
            created = True
        sent = await self.agents.send(decision)
        if sent.not_taken:
            self.pacer.not_taken()  # the next decision sends it again
        if decision.events:  # events are for people: never on the lifecycle's critical path
            self.events.post(decision.events)
        return sent.progressed or bool(doomed) or created

    async def _create_pods(self, spec: RLJobSpec, decision: Decision) -> None:
        """Create the decision's pods concurrently; raises the first refusal (ChildRefused first) after
        all are tried."""
        manifests = [
            self.spec_check.pod(spec, index, decision.status.restarts) for index in decision.create_pods
        ]
        outcomes = await asyncio.gather(
            *(self.kube.create(self.namespace, m) for m in manifests), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, dict):
                self.pods.seen(outcome)  # the watch's event for it may come after the next round
            elif outcome is None:
                self.pacer.list_again()  # it existed already: the cache missed it
        error = _first_error(outcomes)
        if error is not None:
            raise error
