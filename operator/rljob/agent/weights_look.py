"""The agent's look at what the engine holds (Engine.read_weights): its checksum of every parameter, or why
none was taken, with the call's wall time."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rljob.agent.weights_check import Held
from rljob.api.agent import WeightsCheck


@dataclass(frozen=True)
class Look:
    held: Held | None  # None: no checksum, `why` says why
    why: str | None
    seconds: float  # the call's wall time


def timed(report: WeightsCheck, look_: Look, started: float) -> WeightsCheck:
    """`report` with the call's and the whole check's wall time."""
    report.checker_seconds = round(look_.seconds, 6)
    report.seconds = round(time.perf_counter() - started, 6)
    return report
