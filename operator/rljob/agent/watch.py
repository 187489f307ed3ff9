"""The engine's presence: detect its version and launch facts at start (stage Starting until it answers,
then Ready: rollout opens only when the operator resumes), then notice death (stage Failed, `fatal` set): a
refused connection after it was up, and, on an engine whose HTTP server may outlive it, what its hang
check says (Engine.hang_check)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rljob.agent.engines.base import Engine, EngineError, EngineUnreachable, EngineUnsupported
from rljob.agent.state import StateStore
from rljob.agent.weights_check import Verdict, unverified
from rljob.agent.weights_look import timed
from rljob.api.agent import EngineInfo, Stage, VersionSource, WeightsCheck

log = logging.getLogger("rljob.agent")


# A restarted agent's engine was up before: refused connections for this long mean it is gone.
RESTART_UNREACHABLE_S = 3.0
LAUNCH_CHECK_TIMEOUT_S = 60.0  # the engine hashes every parameter on the GPU: milliseconds at 8B


class EngineWatch:
    def __init__(self, store: StateStore, engine: Engine, interval_s: float = 1.0) -> None:
        self._store = store
        self._engine = engine
        self._interval = interval_s
        # A restarted agent (agent/recovery.py): called with what the engine reports instead of going Ready.
        self.on_recover: Callable[[EngineInfo], Awaitable[None]] | None = None

    async def run(self) -> None:
        if self._failed():  # restored Failed from the record: nothing to watch
            return
        if not await self._detect():
            return
        hang_check = self._engine.needs_hang_check
        while self._store.state.stage != Stage.FAILED:
            await asyncio.sleep(self._interval)
            await self.confirm_death("liveness check")
            if hang_check and not self._failed():
                await self.check_hang()

    def _failed(self) -> bool:
        return self._store.state.stage == Stage.FAILED  # a method: mypy narrows the attribute otherwise

    async def check_hang(self) -> None:
        try:
            dead = await self._engine.hang_check()
        except EngineUnreachable as e:
            await self.confirm_death(f"scheduler probe: {e}")
            return
        if dead is not None:
            self._store.fail(dead)

    async def _detect(self) -> bool:
        name = self._engine.name
        warned = False
        refused_since: float | None = None
        # Restarted before it first saw the engine: nothing ran since launch, and the engine may still load.
        saw_engine = self._store.recovering and self._store.state.stage != Stage.STARTING
        while True:
            try:
                found = await self._engine.discover(timeout=5)
                break
            except EngineUnsupported as e:
                self._store.fail(str(e))
                return False
            except (EngineUnreachable, TimeoutError) as e:
                log.debug("%s not up yet: %s", name, e)
                if saw_engine and isinstance(e, EngineUnreachable):
                    refused_since = refused_since or time.monotonic()
                    if time.monotonic() - refused_since > RESTART_UNREACHABLE_S:
                        self._store.fail(f"{name} stopped answering while the agent restarted: {e}")
                        return False
                await asyncio.sleep(0.1)
            except (EngineError, KeyError, ValueError) as e:
                if not warned:  # up but answering oddly (e.g. 401: wrong API key): say so once
                    log.warning("%s answers but cannot be identified yet: %s", name, e)
                    warned = True
                await asyncio.sleep(0.25)
        facts, served = found.facts, found.served.version
        if not facts.reports_version and saw_engine:
            served = self._store.state.engine.served_version  # the agent's label is in its record
        self._store.facts = facts
        self._store.architectures = list(found.architectures)
        seen = EngineInfo(
            kind=facts.kind,
            reachable=True,
            version=facts.version,
            launch_refusal=facts.launch_refusal,
            served_version=served,
            served_version_source=VersionSource.ENGINE if facts.reports_version else VersionSource.AGENT,
            model_path=found.served.model_path,
            paused=False,
        )
        if self._store.recovering and self.on_recover is not None:
            await self.on_recover(seen)
            return not self._failed()
        self._store.path_version = served  # the launch checkpoint holds the launch version
        seen.weights = await self._launch_weights(served)
        with self._store.change(stage=Stage.READY) as s:  # not Serving: the operator verifies it first
            s.engine = seen
        log.info("%s %s is up, serving weight_version %s", name, facts.version, served)
        return True

    async def _launch_weights(self, served: str | None) -> WeightsCheck:
        """The checksum of the weights the engine launched with, before Ready (no command can have released
        them yet): the first refit's "before", and what the operator holds against the committed version's
        checksum when a pod comes up already labelled with it."""
        started = time.perf_counter()
        seen = await self._engine.read_weights(weights_released=False, timeout=LAUNCH_CHECK_TIMEOUT_S)
        if seen.held is None:
            return timed(unverified(str(seen.why), served), seen, started)
        self._store.weights_held = seen.held
        launched = Verdict(not_checked=[f"the weights {self._engine.name} launched with"])
        report = launched.report(seen.held, served)
        return timed(report, seen, started)

    async def confirm_death(self, cause: str) -> None:
        """A hang is not death; a refused or dropped connection is."""
        name = self._engine.name
        try:
            await self._engine.liveness(timeout=5)
        except EngineUnreachable as e:
            log.error("%s is gone (%s): %s", name, cause, e)
            self._store.fail(f"{name} stopped answering: {e}")
        except TimeoutError:
            pass
