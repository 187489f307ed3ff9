"""One read of the engine's weights checksum, as every engine takes it: none while `why` says it cannot be
taken; else the call, timed, with its failure or timeout turned into the look's reason (EngineUnreachable
propagates: the engine is gone). Each engine's folder (agent/engines/<name>/weights.py) says why not, which
route it calls and how its reply reads."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from rljob.agent.engines.base import EngineError
from rljob.agent.weights_check import Held
from rljob.agent.weights_look import Look


async def timed_look(
    why: str | None, route: str, read: Callable[[], Awaitable[Held]], timeout: float
) -> Look:
    """The look `read` gives within `timeout`; `route` names the call in its reasons."""
    if why is not None:
        return Look(None, why, 0.0)
    started = time.perf_counter()
    try:
        held = await read()
    except (EngineError, ValueError) as e:
        return Look(None, f"{route} gave no checksum: {e}", time.perf_counter() - started)
    except TimeoutError:
        return Look(None, f"{route} did not answer within {timeout:g}s", time.perf_counter() - started)
    return Look(held, None, time.perf_counter() - started)
