"""A pure model of the pods, agents and trainers around the lifecycle machine, for unit tests.

FakeAgent follows the agent's contract (docs/agent.md): it refuses what the real agent refuses, and
the world records every refusal, so a test can assert that the machine never asks for an illegal
step. The e2e tier runs the real agent; this model exists so hypothesis can explore millions of
interleavings in seconds."""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from rljob.agent.actions import check_follower, check_leader
from rljob.agent.commands import is_new
from rljob.agent.engines.sglang.facts import SGLangFacts
from rljob.agent.errors import Refused
from rljob.api.agent import (
    Action,
    AgentState,
    Command,
    CommandState,
    CommandStatus,
    EngineInfo,
    MemoryReport,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    ResumeHeadroom,
    RolloutReport,
    Stage,
    TrainerReport,
    WeightsCheck,
)
from rljob.api.spec import RLJobSpec
from rljob.api.status import Phase, RLJobStatus
from rljob.lifecycle.awaiting import AwaitedReport, awaited_report
from rljob.lifecycle.machine import decide
from rljob.lifecycle.model import Awaited, Decision, Observation, PodObservation

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def make_spec(**overrides: object) -> RLJobSpec:
    body: dict[str, object] = {
        "replicas": 2,
        "iterations": 3,
        "template": {"spec": {"containers": [{"name": "sglang"}, {"name": "trainer"}]}},
        "weights": {"initialVersion": "0", "initialPath": "/models/base"},
    }
    body.update(overrides)
    return RLJobSpec.model_validate(body)


@dataclass
class FakeAgent:
    """A follower (node_rank > 0) follows agent/follower.py: its own guards, no SGLang to read a version
    from (it reports what the refit and resume commands say the leader serves)."""

    served_version: str | None
    weight_cache_mode: str = "off"
    stage: Stage = Stage.READY
    epoch: int = 0
    last: CommandStatus | None = None
    pending: object | None = None  # the command being executed
    released: list[str] = field(default_factory=list)
    verified: bool = False
    freed: int = 0
    requested: bool = False
    request_epoch: int | None = None
    lease: bool = False
    published: str | None = None
    published_path: str | None = None
    published_epoch: int | None = None
    held: float | None = None  # the last lease's seconds with the trainer, as the agent timed them
    returned_epoch: int | None = None  # the grant whose lease the trainer gave back without weights
    last_refusal: str | None = None  # why the agent refused the trainer's last refused call
    refit_window: str | None = None  # the version of the tensor/distributed refit window open, if any
    kv_flushed_after_refit: bool = True
    fatal: str | None = None
    revision: int = 1
    refusals: list[str] = field(default_factory=list)
    release_calls: list[tuple[str, ...]] = field(default_factory=list)
    node_rank: int = 0
    headroom: ResumeHeadroom | None = None  # the headroom gate of its last resume (agent/headroom.py)
    weights: WeightsCheck | None = None  # the agent's last checksum of SGLang's weights

    def report(self) -> AgentState:
        return AgentState(
            revision=self.revision,
            boot_id="boot",
            stage=self.stage,
            node_rank=self.node_rank,
            epoch=self.epoch,
            last_command=copy.deepcopy(self.last),
            released_tags=list(self.released),
            memory=MemoryReport(freed_bytes=self.freed, verified=self.verified, gpus=1),
            engine=EngineInfo(
                reachable=True,
                version="0.5.23",
                launch_refusal=self.facts().launch_refusal,  # as the agent reports its facts
                served_version=self.served_version,
                paused=self.stage not in (Stage.SERVING, Stage.STARTING),
                weights=self.weights,
            ),
            trainer=TrainerReport(
                requested=self.requested,
                request_epoch=self.request_epoch,
                lease_held=self.lease,
                published_version=self.published,
                published_path=self.published_path,
                published_epoch=self.published_epoch,
                held_seconds=self.held,
                returned_epoch=self.returned_epoch,
                last_refusal=self.last_refusal,
                refit_window_version=self.refit_window,
            ),
            rollout=RolloutReport(samples=3, cache_hit_rate=0.5, generation_tokens_per_second=100.0),
            fatal=self.fatal,
            headroom=copy.deepcopy(self.headroom),
        )

    def facts(self) -> SGLangFacts:
        """What the agent reads from /server_info at start: SGLang's defaults plus the memory saver the
        job needs (weights have no CPU backup, so a resume of released weights is refused)."""
        return SGLangFacts(
            version="0.5.23",
            weight_cache_mode=self.weight_cache_mode,
            memory_saver=True,
            weights_cpu_backup=False,
            dp_size=1,
        )

    def accept(self, cmd: Command) -> Refused | None:
        """POST /v1/commands: None when taken (anew, or a replay of the last command), else the refusal.
        The desk's epoch rules and the agent's own guards (legal stage, double release, weight cache,
        grant before verification, ...): the world refuses exactly what the real agent refuses."""
        try:
            if not is_new(cmd, self.epoch, self.last):
                return None  # idempotent repeat
            if self.node_rank > 0:
                check_follower(cmd, self.report())
            else:
                check_leader(cmd, self.report(), self.facts())
        except Refused as refused:
            self.refusals.append(f"{refused.error}: {refused.reason}")
            return refused
        self.epoch = cmd.epoch
        self.pending = cmd
        self.last = CommandStatus(epoch=cmd.epoch, action=cmd.action, state=CommandState.RUNNING)
        self.revision += 1
        return None

    def finish(
        self, ok: bool = True, permanent: bool = False, reason: str | None = None, error: str | None = None
    ) -> None:
        """The running command completes (the real agent does this in the background); a failure the
        agent knows would repeat on any retry is `permanent`, with a typed `reason`."""
        if self.last is None or self.last.state != CommandState.RUNNING:
            return
        cmd = self.pending
        action = self.last.action
        self.last.seconds = 0.5
        self.revision += 1
        if not ok:
            self.last.state = CommandState.FAILED
            self.last.error = error or "injected failure"
            self.last.permanent, self.last.failure_reason = permanent, reason
            return
        self.last.state = CommandState.SUCCEEDED
        if action == Action.DRAIN:
            self.stage = Stage.DRAINED
        elif action == Action.RELEASE:
            tags = tuple(t.value for t in cmd.tags)  # type: ignore[attr-defined]
            self.release_calls.append(tags)
            self.released.extend(tags)
            self.kv_flushed_after_refit = False
            self.freed, self.verified, self.stage = 10, True, Stage.RELEASED
        elif action == Action.GRANT:
            self.stage, self.lease, self.requested = Stage.GRANTED, True, False
        elif action == Action.REFIT:
            assert isinstance(cmd, RefitCommand)
            self.released = [t for t in self.released if t not in ("weights", "cuda_graph")]
            self.served_version = cmd.version
            self.kv_flushed_after_refit = True  # refit flushes (flush_cache=true / explicit flush)
            self.stage = Stage.REFITTED
        elif action == Action.RESUME:
            assert isinstance(cmd, ResumeCommand)
            if self.node_rank > 0 and cmd.version is not None:
                self.served_version = cmd.version
            self.released = []
            self.verified, self.stage = False, Stage.SERVING

    def trainer_request(self) -> None:
        if self.stage == Stage.SERVING and not self.requested:
            self.requested, self.request_epoch = True, self.epoch
            self.revision += 1

    def trainer_return_unchanged(self) -> None:
        """The endpoint's resume with nothing pushed: the lease goes back without weights."""
        if self.stage == Stage.GRANTED and self.lease:
            self.returned_epoch, self.lease, self.stage = self.epoch, False, Stage.TRAINED
            self.revision += 1

    def trainer_publish(self, version: str, held: float | None = None) -> None:
        if self.stage == Stage.GRANTED and self.lease:
            self.held = held
            self.published, self.published_path = version, f"/weights/{version}"
            self.published_epoch, self.lease, self.stage = self.epoch, False, Stage.TRAINED
            self.revision += 1


@dataclass
class FakePod:
    index: int
    name: str
    gang: int
    phase: str = "Pending"
    broken: str | None = None
    completed: tuple[str, ...] = ()  # containers that exited 0
    deleting: bool = False  # deletionTimestamp set, still terminating
    unschedulable: str | None = None  # the scheduler's PodScheduled message when no node fits


class World:
    """Pods + agents + clock, driven by Decisions; all I/O replaced by plain data."""

    def __init__(self, spec: RLJobSpec, weight_cache_mode: str = "off") -> None:
        self.spec = spec
        self.status = RLJobStatus()
        self.now = T0
        self.pods: dict[str, FakePod] = {}
        self.agents: dict[str, FakeAgent] = {}
        self.weight_cache_mode = weight_cache_mode
        self.decisions: list[Decision] = []
        self.stale: dict[str, AgentState] = {}  # reports to replay instead of the fresh one, once
        self.last_committed: list[str] = []
        # False: a deleted pod is gone at once. True: it terminates (deleting) until `pods_terminate`.
        self.graceful_delete = False

    # --- observing and deciding --------------------------------------------------------------

    def observe(self) -> Observation:
        agents: dict[str, AgentState | None] = {}
        for name, pod in self.pods.items():
            agent = self.agents.get(name)
            if pod.phase != "Running" or agent is None:
                agents[name] = None
            else:
                agents[name] = self.stale.pop(name, None) or agent.report()
        pods = tuple(
            PodObservation(
                index=p.index,
                name=p.name,
                gang=p.gang,
                phase=p.phase,
                ready=p.phase == "Running",
                deleting=p.deleting,
                broken=p.broken,
                completed=p.completed,
                unschedulable=p.unschedulable,
            )
            for p in self.pods.values()
        )
        return Observation(now=self.now, pods=pods, agents=agents, generation=1)

    def step(self, obs: Observation | None = None) -> Decision:
        decision = decide(self.spec, self.status, obs or self.observe())
        self.apply(decision)
        return decision

    def apply(self, decision: Decision) -> None:
        self.decisions.append(decision)
        self.status = decision.status
        for name in decision.delete_pods:
            if self.graceful_delete and name in self.pods:
                self.pods[name].deleting = True
                continue
            self.pods.pop(name, None)
            self.agents.pop(name, None)
        for index in decision.create_pods:
            name = f"job-{index}"
            if name not in self.pods:
                self.pods[name] = FakePod(index=index, name=name, gang=decision.status.restarts)
        for pc in decision.commands:
            agent = self.agents.get(pc.pod)
            if agent is not None:
                agent.accept(pc.command)

    # --- the world moving on ----------------------------------------------------------------

    def start_pods(self) -> None:
        for name, pod in self.pods.items():
            if pod.phase == "Pending":
                pod.phase = "Running"
                committed = self.spec.weights.initial_version
                node_rank = pod.index % self.spec.rollout.pods_per_instance
                self.agents[name] = FakeAgent(
                    served_version=None if node_rank else committed,
                    weight_cache_mode="off" if node_rank else self.weight_cache_mode,
                    node_rank=node_rank,
                )

    def pods_terminate(self) -> None:
        """Pods being deleted are gone (their grace period ended)."""
        for name in [n for n, p in self.pods.items() if p.deleting]:
            del self.pods[name]
            self.agents.pop(name, None)

    def finish_all(self, ok: bool = True) -> None:
        for agent in self.agents.values():
            agent.finish(ok)

    def trainers_request(self) -> None:
        for agent in self.agents.values():
            agent.trainer_request()

    def trainers_publish(self, version: str, held: dict[str, float] | None = None) -> None:
        """`held`: per pod, the seconds its agent says the trainer held the GPU."""
        for name, agent in self.agents.items():
            agent.trainer_publish(version, (held or {}).get(name))

    def tick(self, seconds: float = 1.0) -> None:
        self.now += timedelta(seconds=seconds)

    def refusals(self) -> list[str]:
        return [r for a in self.agents.values() for r in a.refusals]

    def settle(self) -> None:
        """Finish and decide until the phase changes: with followers, a row that waits for the leader
        takes one more decision (the followers' commands go out once their leader finished)."""
        phase = self.status.phase
        for _ in range(4):
            self.tick()
            self.finish_all()
            self.step()
            if self.status.phase != phase:
                return

    def run_iteration(self, version: str, held: dict[str, float] | None = None) -> None:
        """Drive one full iteration from Rollout back to Rollout (or Succeeded); `held` as in
        trainers_publish."""
        assert self.status.phase == Phase.ROLLOUT, self.status.phase
        self.to_training()
        self.tick(20)
        self.trainers_publish(version, held)
        self.step()  # -> Refitting
        self.settle()  # -> Resuming
        self.settle()  # -> Rollout / Succeeded

    def to_training(self) -> None:
        """From Rollout, 10 s of it, to Training with every trainer's lease granted."""
        self.trainers_request()
        self.tick(10)
        self.step()  # -> Draining, drain sent
        self.settle()  # drain -> Releasing
        self.settle()  # release -> Training
        self.tick()
        self.finish_all()  # grant
        self.step()
        assert self.status.phase == Phase.TRAINING, self.status.phase

    def bring_up(self) -> None:
        self.step()  # creates pods
        self.start_pods()
        self.step()  # -> Initializing
        self.step()  # -> Resuming (every pod already serves the initial weights)
        self.settle()  # -> Rollout


def release_commands(decision: Decision) -> list[ReleaseCommand]:
    return [pc.command for pc in decision.commands if isinstance(pc.command, ReleaseCommand)]


def decides_nothing_new(
    awaiting: Sequence[Awaited],
    changed: Collection[str],
    agents: Mapping[str, AgentState | None],
    accepted: Collection[str],
) -> bool:
    """The pure answer the conductor's pacer keeps report by report (controller/pacer.py AwaitedPods):
    after a decision that waits only on `awaiting`, True when the reports of the pods in `changed` since
    then would make the same decision (nothing new sent, no status field changed): each is an awaited pod's
    report, none says DECIDE, and one awaited pod still runs its command (its report says so, or it does not
    show the command yet and the pod is in `accepted`). Anything else is decided: a failed command, another
    epoch or boot, a Failed stage or `fatal`, the last awaited pod finishing, a pod not awaited, a command
    not yet accepted (it is sent again)."""
    awaited = {a.pod for a in awaiting}
    if not awaited or not awaited.issuperset(changed):
        return False
    reports = [awaited_report(a, agents.get(a.pod), a.pod in accepted) for a in awaiting]
    return AwaitedReport.DECIDE not in reports and AwaitedReport.RUNNING in reports
