"""SGLang's presence: detect the version and launch facts at start (stage Starting until /server_info
answers, then Ready: rollout opens only when the operator resumes), then notice death (stage Failed,
`fatal` set): a refused connection after it was up, and on versions without a subprocess watchdog (0.5.6)
a scheduler that stopped answering while the HTTP server and its `/ping` live on (C-DEATH-HARD)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from rljob.agent.engines.base import EngineError, EngineUnreachable
from rljob.agent.engines.sglang.client import SGLangClient
from rljob.agent.engines.sglang.quirks import SGLangQuirks
from rljob.agent.state import ServerFacts, StateStore
from rljob.agent.weights_check import Verdict, unverified
from rljob.agent.weights_look import look, timed
from rljob.api.agent import SGLangInfo, Stage, WeightsCheck

log = logging.getLogger("rljob.agent")


SCHEDULER_PROBE_MISSES = 2  # consecutive unanswered probes, with no control call in flight, mean death
# A restarted agent's SGLang was up before: refused connections for this long mean it is gone.
RESTART_UNREACHABLE_S = 3.0
LAUNCH_CHECK_TIMEOUT_S = 60.0  # SGLang hashes every parameter on the GPU: milliseconds at 8B


class SGLangWatch:
    def __init__(
        self, store: StateStore, client: SGLangClient, interval_s: float = 1.0, probe_timeout_s: float = 5.0
    ) -> None:
        self._store = store
        self._client = client
        self._interval = interval_s
        self._probe_timeout = probe_timeout_s
        self._probe_misses = 0
        # A restarted agent (agent/recovery.py): called with what SGLang reports instead of going Ready.
        self.on_recover: Callable[[SGLangInfo], Awaitable[None]] | None = None

    async def run(self) -> None:
        if self._failed():  # restored Failed from the record: nothing to watch
            return
        if not await self._detect():
            return
        quirks = self._client.quirks
        probe = quirks is not None and not quirks.subprocess_watchdog
        while self._store.state.stage != Stage.FAILED:
            await asyncio.sleep(self._interval)
            await self.confirm_death("liveness check")
            if probe and not self._failed():
                await self.probe_scheduler()

    def _failed(self) -> bool:
        return self._store.state.stage == Stage.FAILED  # a method: mypy narrows the attribute otherwise

    async def probe_scheduler(self) -> None:
        """C-DEATH-HARD: on 0.5.6 a scheduler that died without a Python exception (a torch_memory_saver
        `exit(1)`, an OOM kill) leaves `/ping` at 200 (C-HEALTH-PING) and every scheduler-bound call hanging.
        `/get_load` is answered even while paused (C-DP-LOADS-PAUSED), so it is a bounded probe, but only
        while no control call is in flight: a release, a refit or a group init occupies the scheduler."""
        if self._client.control_in_flight:
            return
        started = self._client.control_started
        try:
            if await self._client.scheduler_probe(timeout=self._probe_timeout):
                self._probe_misses = 0  # any HTTP answer: the scheduler replied
            return
        except TimeoutError:
            if self._client.control_in_flight or self._client.control_started != started:
                return  # a control call overlapped: the scheduler may just have been busy with it
        except EngineUnreachable as e:
            await self.confirm_death(f"scheduler probe: {e}")
            return
        self._probe_misses += 1
        log.warning(
            "scheduler probe: /get_load did not answer within %gs (%d/%d)",
            self._probe_timeout,
            self._probe_misses,
            SCHEDULER_PROBE_MISSES,
        )
        if self._probe_misses >= SCHEDULER_PROBE_MISSES:
            self._store.fail(
                f"scheduler dead: /get_load did not answer within {self._probe_timeout:g}s "
                f"{SCHEDULER_PROBE_MISSES} times in a row with no control call in flight; SGLang "
                f"{self._client.quirks.version if self._client.quirks else '?'} has no subprocess watchdog, "
                "so its HTTP server (and /ping) outlive a dead scheduler"
            )

    async def _detect(self) -> bool:
        warned = False
        refused_since: float | None = None
        while True:
            try:
                info = await self._client.server_info(timeout=5)
                quirks = SGLangQuirks.detect(str(info["version"]))
                facts = ServerFacts.from_server_info(info)
                self._client.quirks = quirks
                model = await self._client.model_info(timeout=5)
                served = await self._client.served_version(timeout=5)
                break
            except (EngineUnreachable, TimeoutError) as e:
                log.debug("SGLang not up yet: %s", e)
                if self._store.recovering and isinstance(e, EngineUnreachable):
                    refused_since = refused_since or time.monotonic()
                    if time.monotonic() - refused_since > RESTART_UNREACHABLE_S:
                        self._store.fail(f"SGLang stopped answering while the agent restarted: {e}")
                        return False
                await asyncio.sleep(0.1)
            except (EngineError, KeyError, ValueError) as e:
                if not warned:  # up but answering oddly (e.g. 401: wrong API key): say so once
                    log.warning("SGLang answers but cannot be identified yet: %s", e)
                    warned = True
                await asyncio.sleep(0.25)
        if not quirks.is_supported:
            self._store.fail(f"SGLang {quirks.version} is older than the oldest supported version 0.5.6")
            return False
        self._store.facts = facts
        archs = model.get("architectures")
        self._store.architectures = [str(a) for a in archs] if isinstance(archs, list) else []
        seen = SGLangInfo(
            reachable=True,
            version=quirks.version,
            weight_cache_mode=facts.weight_cache_mode,
            served_version=served,
            model_path=str(model.get("model_path")),
            paused=False,
        )
        if self._store.recovering and self.on_recover is not None:
            await self.on_recover(seen)
            return not self._failed()
        self._store.path_version = served  # the launch checkpoint holds the launch version
        seen.weights = await self._launch_weights(served)
        with self._store.change(stage=Stage.READY) as s:  # not Serving: the operator verifies it first
            s.sglang = seen
        log.info("SGLang %s is up, serving weight_version %s", quirks.version, served)
        return True

    async def _launch_weights(self, served: str) -> WeightsCheck:
        """The checksum of the weights SGLang launched with, before Ready (no command can have released
        them yet): the first refit's "before", and what the operator holds against the committed version's
        checksum when a pod comes up already labelled with it."""
        started = time.perf_counter()
        seen = await look(self._client, weights_released=False, timeout=LAUNCH_CHECK_TIMEOUT_S)
        if seen.held is None:
            return timed(unverified(str(seen.why), served), seen, started)
        self._store.weights_held = seen.held
        report = Verdict(not_checked=["the weights SGLang launched with"]).report(seen.held, served)
        return timed(report, seen, started)

    async def confirm_death(self, cause: str) -> None:
        """A hang is not death; a refused or dropped connection is."""
        try:
            await self._client.ping(timeout=5)
        except EngineUnreachable as e:
            log.error("SGLang is gone (%s): %s", cause, e)
            self._store.fail(f"SGLang stopped answering: {e}")
        except TimeoutError:
            pass
