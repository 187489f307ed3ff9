"""A restarted agent continues where it was, or says it cannot.

The recorded state (agent/record.py) is checked against what the engine reports (Engine.served: the
served version and model path) and the GPU memory probe the agent verifies releases with. An engine need
not tell which memory parts are released or whether a call is still running (each engine's folder says
what it has), so an announced call without an outcome is resolved only by positive evidence:

- release: every GPU freed what the release's `verify` asks, against the sample taken before the call
  (nothing else frees the engine's memory while it is paused and idle);
- resume: every GPU's used memory grew past the noise since the sample taken before the call;
- disk refit: the engine serves the version the call loads, or names the checkpoint when it is another
  than the one it named before; a reload of the committed version from the checkpoint the engine already
  named (after a lease that brought none) shows neither, so it is never taken as made, and it is not sent
  again while it may still run (a second load may race the first: Engine.load_from_disk);
- a tensor/distributed refit window: never (the trainer's pushes cannot be replayed).

Without evidence within the call's own deadline the agent reports StateUnknown (stage Failed, recovery
Unsure) and the operator replaces the instance. Otherwise the call's outcome is applied as if the agent
had seen the answer, and a command that was running continues (CommandDesk.resume_recorded): every
operation skips what the record says is done, so the operator's repeat of the same epoch is a replay.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rljob.agent.engines.base import Engine, EngineUnreachable
from rljob.agent.gpu_probe import GpuProbe
from rljob.agent.operations import FREED_NOISE_BYTES, freed_target
from rljob.agent.record import Intent
from rljob.agent.state import StateStore
from rljob.api.agent import (
    Action,
    CommandState,
    EngineInfo,
    RecoveryState,
    RefitCommand,
    ReleaseCommand,
    Stage,
)
from rljob.api.spec import ReleaseTag

log = logging.getLogger("rljob.agent")

RESOLVE_CAP_S = 60.0  # the longest a resume's evidence is waited for (its own deadline may be minutes)
POLL_S = 0.05


class Recovery:
    def __init__(
        self,
        store: StateStore,
        engine: Engine,
        probe: GpuProbe,
        resume_command: Callable[[], None],
    ) -> None:
        self.store = store
        self.engine = engine
        self.probe = probe
        self._resume_command = resume_command  # CommandDesk.resume_recorded of the recorded command

    async def run(self, seen: EngineInfo) -> None:
        """`seen`: what the engine reported at detection (reachable, version, served version, model path)."""
        store, st = self.store, self.store.state
        intent = store.intent
        if st.stage == Stage.FAILED:  # failed before the restart: that stays (the pod must be replaced)
            with store.change() as s:
                s.recovery.state = RecoveryState.RECOVERED
                s.recovery.detail = "the agent had reported Failed before its restart"
            return
        if not self._same_server(seen):
            store.unsure(
                f"{self.engine.name} serves weight_version {seen.served_version!r}, the record says "
                f"{st.engine.served_version!r}: not the server this agent recorded"
            )
            return
        detail = f"recorded state matches {self.engine.name}"
        if intent is not None:
            try:
                found = await self._resolve(intent)
            except EngineUnreachable as e:
                store.fail(f"{self.engine.name} stopped answering while the agent recovered: {e}")
                return
            if found is None:
                store.unsure(f"{intent.describe()} was announced and its outcome is unknown")
                return
            detail = found
        self._recovered(seen, detail)

    def _recovered(self, seen: EngineInfo, detail: str) -> None:
        """The record matches the engine: Recovered, and the command that was running runs on."""
        store, st = self.store, self.store.state
        fresh = st.stage == Stage.STARTING  # died before the engine was first seen: start as a fresh agent
        with store.outcome(stage=Stage.READY if fresh else None) as s:  # closes the intent with its outcome
            s.engine.reachable = True
            s.engine.version = seen.version
            s.engine.kind = seen.kind
            s.engine.served_version_source = seen.served_version_source
            s.engine.launch_refusal = seen.launch_refusal
            s.recovery.state = RecoveryState.RECOVERED
            s.recovery.detail = detail[:1024]
            if fresh:
                s.engine = seen
        log.info("agent recovered after restart %d: %s", st.recovery.restarts, detail)
        last = st.last_command
        if last is not None and last.state == CommandState.RUNNING and store.command is not None:
            self._resume_command()

    def _same_server(self, seen: EngineInfo) -> bool:
        """The engine serves a version the record knows: the one recorded, or one a refit was loading. An
        engine that carries no label (EngineFacts.reports_version) cannot say: the GPU evidence decides."""
        store, intent = self.store, self.store.intent
        if store.facts is not None and not store.facts.reports_version:
            return True
        allowed = {store.state.engine.served_version, store.refit_done}
        if intent is not None and intent.call == "refit":
            allowed.add(intent.version)
        return store.state.engine.served_version is None or seen.served_version in allowed

    async def _resolve(self, intent: Intent) -> str | None:
        """The outcome of an announced call, applied to the state; None when it cannot be known (a
        refit window's pushes cannot be replayed)."""
        cmd = self.store.command
        if cmd is None:
            return None
        if intent.call == "release" and cmd.action is Action.RELEASE:
            return await self._released(intent, cmd)
        if intent.call == "resume":
            return await self._resumed(intent)
        if intent.call == "refit" and cmd.action is Action.REFIT and intent.version is not None:
            return await self._refitted(intent, cmd)
        return None

    async def _released(self, intent: Intent, cmd: ReleaseCommand) -> str | None:
        self.store.release_freed, self.store.taken_back = {}, {}  # a new cycle (re-measured by verify)
        if not await self._freed(intent, cmd):
            return None
        self.store.state.released_tags = list(
            dict.fromkeys([*self.store.state.released_tags, *map(ReleaseTag, intent.tags)])
        )
        return f"{intent.describe()}: made (every GPU freed what verify asks)"

    async def _resumed(self, intent: Intent) -> str | None:
        grown = await self._grew(intent)
        if grown is None:
            return None
        resumed = set(intent.tags)
        self.store.state.released_tags = [t for t in self.store.state.released_tags if t.value not in resumed]
        for i, grew in grown.items():  # what it took back counts against the next resume (agent/headroom.py)
            self.store.taken_back[i] = self.store.taken_back.get(i, 0) + grew
        return f"{intent.describe()}: made (every GPU's used memory grew)"

    async def _refitted(self, intent: Intent, cmd: RefitCommand) -> str | None:
        if not await self._loaded(intent, cmd):
            return None
        self.store.refit_done = intent.version
        self.store.state.engine.unloaded = None  # the load completed: the weights can serve
        return f"{intent.describe()}: made ({self.engine.name} serves it)"

    def _deadline(self, seconds: float) -> float:
        """The announced call's command deadline, from when the command started (agent clock)."""
        last = self.store.state.last_command
        started = last.started_at if last is not None and last.started_at else time.time()
        return time.monotonic() + max(1.0, started + seconds - time.time())

    async def _poll(self, until: float, proven: Callable[[], Awaitable[bool]]) -> bool:
        while True:
            try:
                if await proven():
                    return True
            except EngineUnreachable:
                raise
            except (
                Exception
            ) as e:  # the engine's errors, timeouts, the GPU probe's own (NVML has no common base)
                log.warning("recovery evidence: %s: %s", e.__class__.__name__, e)
            if time.monotonic() >= until:
                return False
            await asyncio.sleep(POLL_S)

    async def _freed(self, intent: Intent, cmd: ReleaseCommand) -> bool:
        verify = cmd.verify
        need = freed_target(verify, intent.used_before)
        if not need:
            return False

        async def freed() -> bool:
            now = {g.index: g.used_bytes for g in await self.probe.sample()}
            return set(now) == set(need) and all(intent.used_before[i] - now[i] >= need[i] for i in need)

        until = min(self._deadline(verify.timeout_seconds), time.monotonic() + verify.timeout_seconds)
        return await self._poll(until, freed)

    async def _grew(self, intent: Intent) -> dict[int, int] | None:
        """Per GPU, how much used memory grew since the sample before the resume; None without evidence."""
        if not intent.used_before:
            return None
        grown: dict[int, int] = {}

        async def grew() -> bool:
            now = {g.index: g.used_bytes for g in await self.probe.sample()}
            before = intent.used_before
            grown.update({i: now[i] - before[i] for i in before if i in now})
            return set(now) == set(before) and all(now[i] - before[i] > FREED_NOISE_BYTES for i in before)

        last = self.store.command
        seconds = float(getattr(last, "timeout_seconds", RESOLVE_CAP_S))
        until = min(self._deadline(seconds), time.monotonic() + RESOLVE_CAP_S)
        return grown if await self._poll(until, grew) else None

    async def _loaded(self, intent: Intent, cmd: RefitCommand) -> bool:
        st = self.store.state
        # What the engine serves once the load ran: the version when it is a new one, the path when it
        # named another before it (a successful load sets both). A reload of the version and checkpoint
        # the engine already named shows neither: nothing can tell.
        facts = self.store.facts
        reports = facts is None or facts.reports_version  # a label the engine does not carry shows nothing
        version_shows = reports and intent.version != st.engine.served_version
        path_shows = intent.path is not None and intent.path != st.engine.model_path
        if not (version_shows or path_shows):
            return False

        async def loaded() -> bool:
            served = await self.engine.served(timeout=5)
            if version_shows and served.version == intent.version:
                return True
            # An engine may drop the label of a paused load (Engine.label_weights): the path it loaded shows.
            return path_shows and served.model_path == intent.path

        return await self._poll(self._deadline(cmd.timeout_seconds), loaded)
