"""The agent's look at what SGLang holds: one `/weights_checker` checksum call (C-CHECKER-CHECKSUM), made only
while the weights are mapped (a hash of released weights reads unmapped memory: C-CHECKER-RELEASED), read
into agent/weights_check.Held, timed."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rljob.agent.engines.base import EngineError
from rljob.agent.engines.sglang.client import SGLangClient
from rljob.agent.weights_check import Held, read_reply
from rljob.api.agent import WeightsCheck


@dataclass(frozen=True)
class Look:
    held: Held | None  # None: no checksum, `why` says why
    why: str | None
    seconds: float  # the call's wall time


def why_not(client: SGLangClient, weights_released: bool) -> str | None:
    """Why no checksum can be taken now, or None."""
    quirks = client.quirks
    if quirks is None:
        return "SGLang's version is not known yet"
    if not quirks.checker_checksum:
        return f"SGLang {quirks.version} has no /weights_checker checksum (it has one from 0.5.15.post1)"
    if weights_released:
        return "the weights are released (a checksum would read unmapped memory)"
    return None


async def look(client: SGLangClient, weights_released: bool, timeout: float) -> Look:
    """One checksum of every parameter SGLang holds; EngineUnreachable propagates (SGLang is gone)."""
    why = why_not(client, weights_released)
    if why is not None:
        return Look(None, why, 0.0)
    started = time.perf_counter()
    try:
        held = read_reply(await client.weights_checksum(timeout=timeout))
    except (EngineError, ValueError) as e:
        return Look(None, f"/weights_checker gave no checksum: {e}", time.perf_counter() - started)
    except TimeoutError:
        return Look(
            None, f"/weights_checker did not answer within {timeout:g}s", time.perf_counter() - started
        )
    return Look(held, None, time.perf_counter() - started)


def timed(report: WeightsCheck, look_: Look, started: float) -> WeightsCheck:
    """`report` with the call's and the whole check's wall time."""
    report.checker_seconds = round(look_.seconds, 6)
    report.seconds = round(time.perf_counter() - started, 6)
    return report
