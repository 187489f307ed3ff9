"""The event loop every rljob process runs on: uvloop's where it is installed (a dependency on Linux), as
kopf's own CLI (kopf/_kits/loops.py@1.45.2) and the engines' HTTP servers use it; else asyncio's.
The operator's and the agent's frame reads and writes are loop callbacks, which uvloop runs in C."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def runner() -> Iterator[asyncio.Runner]:
    """An asyncio.Runner on uvloop's loop where uvloop is installed, else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        with asyncio.Runner() as plain:
            yield plain
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as fast:
        yield fast


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on the loop `runner` picks."""
    with runner() as loop_runner:
        return loop_runner.run(main)
