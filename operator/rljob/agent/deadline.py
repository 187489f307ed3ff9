"""A command's deadline, on the event loop's clock: every call a command makes is bounded by what is left."""

from __future__ import annotations

import asyncio


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._at = asyncio.get_running_loop().time() + seconds

    def remaining(self) -> float:
        return max(0.0, self._at - asyncio.get_running_loop().time())
