"""Time a command spends waiting on the engine and the GPU probe, so the agent's own overhead is measurable
(CommandStatus.engine_seconds). A context variable: tasks spawned by the command inherit the counter."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_spent: ContextVar[list[float] | None] = ContextVar("rljob_external_seconds", default=None)


@contextlib.contextmanager
def measure_external() -> Iterator[list[float]]:
    acc = [0.0]
    token = _spent.set(acc)
    try:
        yield acc
    finally:
        _spent.reset(token)


def add_external(seconds: float) -> None:
    acc = _spent.get()
    if acc is not None:
        acc[0] += seconds
