"""What the agent's core knows of an engine, whichever it is: the errors its calls raise."""

from __future__ import annotations


class EngineUnreachable(Exception):
    """Connection refused, reset or dropped: the engine is not up yet, or it died."""


class EngineError(Exception):
    """The engine answered, with an error: an error status, or a success flag that says it failed."""

    def __init__(self, operation: str, status: int, message: str) -> None:
        super().__init__(f"{operation}: HTTP {status}: {message}")
        self.operation, self.status, self.message = operation, status, message
