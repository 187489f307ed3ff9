"""The agent of a follower pod: the engine's node rank > 0 of a multi-node instance
(spec.rollout.podsPerInstance).

Only node rank 0 runs the engine's HTTP API; the other nodes run its workers and get release, resume and
refit from node 0 (each engine's folder says how its followers get them). So the operator sends the engine's
lifecycle calls to the instance's leader agent, and a follower's agent never makes one. It does what the
leader's agent cannot see from its own pod, on its own GPUs:

- drain: the GPUs' "before" sample (a drain frees no GPU memory);
- release (sent once the leader's release was verified): every GPU of this pod freed what `verify` asks,
  against that sample; the lease is granted only after every pod of the job verified;
- grant: the trainer's lease, as on the leader;
- refit (once the leader's refit is verified): records the version the leader's engine now serves;
- resume (once the leader's resume is verified): every GPU got back at least half of what it freed
  (the trainer shares the GPU, so its allocator may hold or drop some memory in between; a follower whose
  ranks did not resume regains nothing), then Serving at the leader's version.

The engine's liveness (Engine.liveness) is answered on every node. Each of these is its action's `follow`
in agent/actions.py, which also holds the follower's guards.
"""

from __future__ import annotations

import asyncio
import logging

from rljob.agent.deadline import Deadline
from rljob.agent.engines.base import Engine, EngineUnreachable
from rljob.agent.errors import CommandFailed
from rljob.agent.gpu_probe import GpuMemory
from rljob.agent.operations import VERIFY_MAX_POLL_S, Operations, Record
from rljob.agent.state import StateStore
from rljob.api.agent import (
    AgentState,
    DrainCommand,
    EngineInfo,
    MemoryReport,
    RefitCommand,
    ReleaseCommand,
    ResumeCommand,
    RolloutReport,
    Stage,
)
from rljob.api.spec import ReleaseTag

log = logging.getLogger("rljob.agent")

REGAINED_FRACTION = 0.5  # of what each GPU freed at release, back after the resume


class FollowerWatch:
    """The engine's presence on a follower: Starting until its liveness answers, then Ready; a refused
    connection after that is death (the node's workers are gone)."""

    def __init__(self, store: StateStore, engine: Engine, interval_s: float = 1.0) -> None:
        self._store = store
        self._engine = engine
        self._interval = interval_s
        self.on_recover = None  # the leader's watch hands a restarted agent's record to recovery; not here

    async def run(self) -> None:
        if self._failed():  # a restarted follower: Failed, and that stays
            return
        name = self._engine.name
        while True:
            try:
                await self._engine.liveness(timeout=5)
                break
            except (EngineUnreachable, TimeoutError) as e:
                log.debug("%s (follower) not up yet: %s", name, e)
                await asyncio.sleep(0.1)
        with self._store.change(stage=Stage.READY) as s:
            s.engine = EngineInfo(kind=self._engine.kind, reachable=True, paused=False)
        log.info("%s follower (node rank %d) answers", name, self._store.state.node_rank)
        while not self._failed():
            await asyncio.sleep(self._interval)
            await self.confirm_death("liveness check")

    def _failed(self) -> bool:
        return self._store.state.stage == Stage.FAILED

    async def confirm_death(self, cause: str) -> None:
        name = self._engine.name
        try:
            await self._engine.liveness(timeout=5)
        except EngineUnreachable as e:
            log.error("%s is gone (%s): %s", name, cause, e)
            self._store.fail(f"{name} stopped answering: {e}")
        except TimeoutError:
            pass


class FollowerOperations(Operations):
    """Each command on a follower: measurements of its own GPUs, never an engine lifecycle call."""

    before: list[GpuMemory] | None = None  # the drain's sample
    after_release: list[GpuMemory] | None = None  # once the release was verified

    async def follow_drain(self, cmd: DrainCommand) -> Record:
        before = await self._sample()
        self.before, self.after_release = before, None

        def record(s: AgentState) -> None:
            s.memory = MemoryReport(used_before_bytes=sum(g.used_bytes for g in before), gpus=len(before))
            s.engine.paused = True  # the leader pauses the instance in the same phase

        return record

    async def follow_release(self, cmd: ReleaseCommand) -> Record:
        if self.before is None:  # the agent restarted after the drain: the memory before is unknown
            raise CommandFailed("no GPU sample from before the release (the agent restarted since the drain)")
        unique = list(dict.fromkeys(cmd.tags))
        with self.store.change() as s:  # the leader's call released them on this node's ranks too
            s.released_tags = [*s.released_tags, *unique]
        await self._verify_freed(self.before, cmd.verify, [t.value for t in unique])
        self.after_release = await self._sample()
        return None

    async def follow_refit(self, cmd: RefitCommand) -> Record:
        def record(s: AgentState) -> None:
            s.released_tags = [
                t for t in s.released_tags if t not in (ReleaseTag.WEIGHTS, ReleaseTag.CUDA_GRAPH)
            ]
            s.engine.served_version = cmd.version
            s.engine.paused = True

        return record

    async def follow_resume(self, cmd: ResumeCommand) -> Record:
        if self.before is not None and self.after_release is not None:
            await self._verify_regained(self.before, self.after_release, Deadline(cmd.timeout_seconds))
        self.before = self.after_release = None

        def record(s: AgentState) -> None:
            s.released_tags = []
            s.engine.paused = False
            if cmd.version is not None:
                s.engine.served_version = cmd.version
            s.memory.verified = False
            s.rollout = RolloutReport()

        return record

    async def _verify_regained(
        self, before: list[GpuMemory], released: list[GpuMemory], dl: Deadline
    ) -> None:
        freed = {g.index: g.used_bytes for g in before}
        low = {g.index: g.used_bytes for g in released}
        need = {i: int(REGAINED_FRACTION * max(0, freed[i] - low.get(i, freed[i]))) for i in freed}
        pause = 0.002
        regained = await self._regained(low, need)
        while _short(regained, need) and dl.remaining() > 0:
            await asyncio.sleep(min(pause, dl.remaining()))
            pause = min(pause * 2, VERIFY_MAX_POLL_S)
            regained = await self._regained(low, need)
        short = _short(regained, need)
        if short:
            detail = ", ".join(f"GPU {i} regained {max(0, regained[i])} of {need[i]} bytes" for i in short)
            raise CommandFailed(f"resume not verified within {dl.seconds:g}s on this follower: {detail}")

    async def _regained(self, low: dict[int, int], need: dict[int, int]) -> dict[int, int]:
        """Per GPU of `need`: the used bytes now above the sample taken after the release."""
        now = {g.index: g.used_bytes for g in await self._sample()}
        return {i: now.get(i, 0) - low.get(i, 0) for i in need}


def _short(regained: dict[int, int], need: dict[int, int]) -> list[int]:
    return [i for i in need if regained[i] < need[i]]
