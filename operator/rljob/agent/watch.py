"""SGLang's presence: detect the version and launch facts at start (stage Starting until /server_info
answers, then Ready: rollout opens only when the operator resumes), then notice death (connection refused
after it was up -> stage Failed, `fatal` set)."""

from __future__ import annotations

import asyncio
import logging

from rljob.agent.quirks import SGLangQuirks
from rljob.agent.sglang_client import SGLangClient, SGLangError, SGLangUnreachable
from rljob.agent.state import ServerFacts, StateStore
from rljob.api.agent import SGLangInfo, Stage

log = logging.getLogger("rljob.agent")


class SGLangWatch:
    def __init__(self, store: StateStore, client: SGLangClient, interval_s: float = 1.0) -> None:
        self._store = store
        self._client = client
        self._interval = interval_s

    async def run(self) -> None:
        if not await self._detect():
            return
        while self._store.state.stage != Stage.FAILED:
            await asyncio.sleep(self._interval)
            await self.confirm_death("liveness check")

    async def _detect(self) -> bool:
        warned = False
        while True:
            try:
                info = await self._client.server_info(timeout=5)
                quirks = SGLangQuirks.detect(str(info["version"]))
                facts = ServerFacts.from_server_info(info)
                self._client.quirks = quirks
                model = await self._client.model_info(timeout=5)
                served = await self._client.served_version(timeout=5)
                break
            except (SGLangUnreachable, TimeoutError) as e:
                log.debug("SGLang not up yet: %s", e)
                await asyncio.sleep(0.1)
            except (SGLangError, KeyError, ValueError) as e:
                if not warned:  # up but answering oddly (e.g. 401: wrong API key): say so once
                    log.warning("SGLang answers but cannot be identified yet: %s", e)
                    warned = True
                await asyncio.sleep(0.25)
        if not quirks.supported:
            self._store.fail(f"SGLang {quirks.version} is older than the oldest supported version 0.5.6")
            return False
        self._store.facts = facts
        with self._store.change() as s:
            s.stage = Stage.READY  # not Serving: the operator must first verify what this server serves
            s.sglang = SGLangInfo(
                reachable=True,
                version=quirks.version,
                weight_cache_mode=facts.weight_cache_mode,
                served_version=served,
                model_path=str(model.get("model_path")),
                paused=False,
            )
        log.info("SGLang %s is up, serving weight_version %s", quirks.version, served)
        return True

    async def confirm_death(self, cause: str) -> None:
        """A hang is not death; a refused or dropped connection is."""
        try:
            await self._client.ping(timeout=5)
        except SGLangUnreachable as e:
            log.error("SGLang is gone (%s): %s", cause, e)
            self._store.fail(f"SGLang stopped answering: {e}")
        except TimeoutError:
            pass
