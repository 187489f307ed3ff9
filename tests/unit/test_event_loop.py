"""rljob/event_loop.py: the operator, the agent and the test host run on uvloop's loop where installed."""

from __future__ import annotations

import asyncio
import importlib.util

from rljob import event_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_run_returns_what_the_coroutine_returns_on_uvloop_where_installed() -> None:
    module = event_loop.run(_loop_module())
    if importlib.util.find_spec("uvloop") is not None:
        assert module.startswith("uvloop")
    else:
        assert module.startswith("asyncio")


def test_the_runner_closes_its_loop() -> None:
    with event_loop.runner() as runner:
        loop = runner.get_loop()
        assert runner.run(asyncio.sleep(0, result=7)) == 7
    assert loop.is_closed()
